"""FSDP1's ``state_dict_type`` context and ``set_state_dict_type`` / ``get_state_dict_type``
for fsdp2 models (see [Note: FSDP1 state dicts] in _state_dict.py); re-exported by
``fsdp2.fsdp1``. The core never imports it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import torch.nn as nn

from fsdp2.fsdp1._state_dict import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    as_enum,
    config_settings,
    get_state_dict,
    load_state_dict,
)

_SETTINGS_ATTR = "_fsdp1_state_dict_settings"
_OVERRIDDEN = ("state_dict", "load_state_dict", _SETTINGS_ATTR)
_MISSING = object()

_MODEL_CONFIGS = {
    StateDictType.FULL_STATE_DICT: FullStateDictConfig,
    StateDictType.LOCAL_STATE_DICT: LocalStateDictConfig,
    StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig,
}
OPTIM_CONFIGS = {
    StateDictType.FULL_STATE_DICT: FullOptimStateDictConfig,
    StateDictType.LOCAL_STATE_DICT: LocalOptimStateDictConfig,
    StateDictType.SHARDED_STATE_DICT: ShardedOptimStateDictConfig,
}


def _class_names(value: object) -> set[str]:
    return {c.__name__ for c in type(value).__mro__}


def check_config(
    config: object, kind: StateDictType, base: type, by_kind: Mapping[StateDictType, type], api: str
) -> Any:
    """``config``, or the default config of ``kind``; torch's classes of the same names pass
    (hence ``Any``: the result is read by attribute, as ours would be)."""
    want = by_kind[kind]
    if config is None:
        return want()
    if base.__name__ not in _class_names(config):
        raise TypeError(
            f"{api}: expected {_article(base.__name__)} {base.__name__} (for {kind.name}: "
            f"{want.__name__}(...)), got "
            f"{type(config).__name__}"
        )
    name = type(config).__name__
    if name != base.__name__ and name != want.__name__:
        raise ValueError(
            f"{api}: {kind.name} takes a {want.__name__} (or {base.__name__}), got {name}"
        )
    return config


def _article(word: str) -> str:
    return "an" if word[0] in "AEIOU" else "a"


def _default_settings() -> StateDictSettings:
    kind = StateDictType.SHARDED_STATE_DICT
    return StateDictSettings(kind, _MODEL_CONFIGS[kind](), OPTIM_CONFIGS[kind]())


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The state dict settings of ``module`` (FSDP1's ``FSDP.get_state_dict_type``).

    Args:
        module: the root module given to ``state_dict_type`` / ``set_state_dict_type``.

    Returns:
        The ``StateDictSettings`` set on ``module``; without any, SHARDED with default configs
        (fsdp2's ``model.state_dict()``; FSDP1's default is FULL).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"get_state_dict_type: module must be an nn.Module, got {type(module).__name__}"
        )
    settings = module.__dict__.get(_SETTINGS_ATTR)
    return settings if isinstance(settings, StateDictSettings) else _default_settings()


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> StateDictSettings:
    """Make ``module.state_dict()`` / ``module.load_state_dict(sd)`` return / load state dicts
    of kind ``state_dict_type``, and ``optim_state_dict`` / ``optim_state_dict_to_load``
    default to it, until changed (FSDP1's ``FSDP.set_state_dict_type``); see [Note: FSDP1
    state dicts].

    Sets instance attributes ``state_dict`` and ``load_state_dict`` on ``module`` (call it on
    the root). ``module.state_dict()`` then calls ``get_state_dict`` (collective for FULL), also
    when a parent module's ``state_dict()`` reaches it (its keys get the parent's prefix);
    ``module.load_state_dict(sd, strict=...)`` calls ``load_state_dict``.

    Args:
        module: the root module (sharded with ``fully_shard`` / ``shard_model``).
        state_dict_type: a ``StateDictType`` (torch's enum of the same name is accepted).
        state_dict_config: the model's config, of the class matching the type (e.g.
            ``FullStateDictConfig`` for FULL) or the base class; ``None``: the default.
        optim_state_dict_config: the optimizer's config (e.g. ``FullOptimStateDictConfig``);
            ``None``: the default of the type.

    Returns:
        The previous ``StateDictSettings`` (SHARDED with default configs if none was set).

    Raises:
        TypeError: a module that is not an ``nn.Module``, a type that is not a
            ``StateDictType`` or a config of the wrong kind (a model config as optimizer config).
        ValueError: a config for another state dict type (``FullStateDictConfig`` with
            SHARDED), or ``rank0_only`` with a type other than FULL.
    """
    api = "set_state_dict_type"
    settings = _make_settings(
        module, state_dict_type, state_dict_config, optim_state_dict_config, api
    )
    previous = get_state_dict_type(module)
    _install(module, settings)
    return previous


def _make_settings(
    module: object,
    state_dict_type: object,
    state_dict_config: object,
    optim_state_dict_config: object,
    api: str,
) -> StateDictSettings:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{api}: module must be an nn.Module, got {type(module).__name__}")
    kind = as_enum(StateDictType, state_dict_type, "state_dict_type", api)
    model_config = check_config(
        state_dict_config, kind, StateDictConfig, _MODEL_CONFIGS, f"{api}: state_dict_config"
    )
    optim_config = check_config(
        optim_state_dict_config,
        kind,
        OptimStateDictConfig,
        OPTIM_CONFIGS,
        f"{api}: optim_state_dict_config",
    )
    config_settings(kind, model_config, api)
    config_settings(kind, optim_config, api)
    return StateDictSettings(kind, model_config, optim_config)


def _install(module: nn.Module, settings: StateDictSettings) -> None:
    # module.__dict__ directly: nn.Module.__setattr__ has nothing to do with these attributes
    module.__dict__[_SETTINGS_ATTR] = settings
    module.__dict__["state_dict"] = functools.partial(_typed_state_dict, module)
    module.__dict__["load_state_dict"] = functools.partial(_typed_load_state_dict, module)


def _typed_state_dict(
    module: nn.Module,
    destination: dict[str, Any] | None = None,
    prefix: str = "",
    keep_vars: bool = False,
) -> dict[str, Any]:
    """``module.state_dict()`` under ``set_state_dict_type``; ``keep_vars`` is ignored."""
    settings = get_state_dict_type(module)
    sd = get_state_dict(module, settings.state_dict_type, settings.state_dict_config)
    out: dict[str, Any] = {} if destination is None else destination
    for key, value in sd.items():
        out[prefix + key] = value
    return out


def _typed_load_state_dict(
    module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
) -> object:
    """``module.load_state_dict(sd)`` under ``set_state_dict_type``."""
    if assign:
        raise ValueError(
            "load_state_dict: assign=True is not supported under state_dict_type; leave the "
            "context (or call type(model).load_state_dict) to assign"
        )
    settings = get_state_dict_type(module)
    return load_state_dict(
        module,
        dict(state_dict),
        settings.state_dict_type,
        settings.state_dict_config,
        strict=strict,
    )


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> Iterator[None]:
    """Inside the context, ``module.state_dict()`` / ``module.load_state_dict(sd)`` return /
    load state dicts of kind ``state_dict_type`` and ``optim_state_dict`` /
    ``optim_state_dict_to_load`` default to it (FSDP1's ``FSDP.state_dict_type``); see
    ``set_state_dict_type`` and [Note: FSDP1 state dicts].

    On exit (also on an exception) ``module`` gets back exactly what it had before, so
    contexts nest.

    Args:
        module: the root module (sharded with ``fully_shard`` / ``shard_model``).
        state_dict_type: a ``StateDictType`` (torch's enum of the same name is accepted).
        state_dict_config: the model's config (e.g. ``FullStateDictConfig(rank0_only=True)``);
            ``None``: the default of the type.
        optim_state_dict_config: the optimizer's config (e.g. ``FullOptimStateDictConfig``);
            ``None``: the default of the type.

    Yields:
        None.

    Raises:
        TypeError: as ``set_state_dict_type``.
        ValueError: as ``set_state_dict_type``.
    """
    api = "state_dict_type"
    settings = _make_settings(
        module, state_dict_type, state_dict_config, optim_state_dict_config, api
    )
    saved = {name: module.__dict__.get(name, _MISSING) for name in _OVERRIDDEN}
    _install(module, settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value
