"""FSDP1-style ``summon_full_params``, model and optimizer state dicts (FULL / SHARDED /
LOCAL) and the ``state_dict_type`` context for fsdp2 models; re-exported by ``fsdp2.fsdp1``.
The core never imports it."""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .fully_shard import FSDPModule

_E = TypeVar("_E", bound=enum.Enum)
_V = TypeVar("_V")


def _as_enum(cls: type[_E], value: object, what: str, api: str = "shard_model") -> _E:
    if isinstance(value, cls):
        return value
    # torch's FSDP1 enums carry the same names: accept them so imports can move one at a time
    if isinstance(value, enum.Enum) and value.name in cls.__members__:
        return cls[value.name]
    raise TypeError(f"{api}: {what} must be a {cls.__name__}, got {value!r}")


def _device_type() -> str:
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc.type if acc is not None and dist.get_backend() != "gloo" else "cpu"


# ---------------------------------------------------------------------------------------------
# summon_full_params and FSDP1-style state dicts
#
# [Note: FSDP1 state dicts]
# The type is an argument of ``get_state_dict`` / ``load_state_dict`` / ``optim_state_dict`` /
# ``optim_state_dict_to_load``, or comes from ``state_dict_type`` (FSDP1's context manager) /
# ``set_state_dict_type``, which record ``StateDictSettings`` on the root module and set
# instance attributes ``state_dict`` / ``load_state_dict`` on it, so that ``model.state_dict()``
# and ``model.load_state_dict(sd)`` return / load that kind (restored on exit). Without
# settings the type is SHARDED (what fsdp2's ``model.state_dict()`` returns anyway), where
# FSDP1 defaults to FULL.
# * FULL: full plain tensors under the original names (what an unsharded model returns);
#   gathered on every rank (collective), kept only on rank 0 with ``rank0_only``. Loading
#   passes them to ``model.load_state_dict``, which shards full tensors locally; with
#   ``rank0_only`` rank 0 broadcasts them first.
# * SHARDED: ``model.state_dict()`` itself, DTensors (fsdp2's native format, and DCP's).
# * LOCAL: each rank's local shards (``DTensor.to_local()``), plain tensors keyed by FQN. Unlike
#   FSDP1 (flat-parameter ``ShardedTensor``s), they are only meaningful to a model sharded the
#   same way on the same number of ranks.
# Keys with FSDP1's wrapper prefixes (``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``)
# load: ``load_state_dict`` strips them first.
#
# Optimizer state dicts have FSDP1's format: ``{"state": {fqn: {"step": t, "exp_avg": ...}},
# "param_groups": [{hyperparameters..., "params": [fqn, ...]}]}``, keyed by each parameter's
# first name in ``model.named_parameters()`` (a tied parameter has one entry). Optimizer state
# of an fsdp2 parameter is a DTensor with the parameter's layout; FULL gathers it
# (``full_tensor()``), SHARDED keeps the DTensors (the optimizer's own: DCP loads into them),
# LOCAL takes ``to_local()``; other values (AdamW's scalar ``step``) stay as they are.
# ``optim_state_dict_to_load`` turns such a dict back into ``optim.load_state_dict``'s format
# (integer ids in the optimizer's own group order, so the checkpoint's order does not matter)
# and every parameter-shaped tensor into a DTensor of the parameter's layout, without
# communication: a full tensor is cut locally (``distribute_tensor(src_data_rank=None)``), a
# LOCAL shard is wrapped (``DTensor.from_local``), a DTensor of another layout redistributed.
# torch's FSDP1 saves SHARDED model and optimizer state as ``ShardedTensor``s; DCP reshards
# them into our DTensors by key, so a DCP checkpoint of either loads into the other. A DCP
# load target needs optimizer state to exist: ``init_optim_state(optim)`` creates it.

_FSDP1_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


class StateDictType(enum.Enum):
    """Which state dict ``get_state_dict`` / ``load_state_dict`` use; see [Note: FSDP1 state
    dicts]."""

    FULL_STATE_DICT = enum.auto()  # full plain tensors, as an unsharded model
    LOCAL_STATE_DICT = enum.auto()  # this rank's local shards, plain tensors
    SHARDED_STATE_DICT = enum.auto()  # DTensors (model.state_dict())


@dataclass(frozen=True)
class StateDictConfig:
    offload_to_cpu: bool = False
    """Move the returned tensors to CPU (a no-op for CPU meshes)."""


@dataclass(frozen=True)
class FullStateDictConfig(StateDictConfig):
    rank0_only: bool = False
    """Only rank 0 gets the tensors (the others get ``{}``); loading: only rank 0 passes them."""


@dataclass(frozen=True)
class LocalStateDictConfig(StateDictConfig):
    pass


@dataclass(frozen=True)
class ShardedStateDictConfig(StateDictConfig):
    _use_dtensor: bool = True
    """Accepted for FSDP1 compatibility; values are always DTensors."""


@dataclass(frozen=True)
class OptimStateDictConfig:
    offload_to_cpu: bool = True
    """``optim_state_dict`` moves plain tensors (FULL's full tensors, LOCAL's shards,
    scalars) to CPU; SHARDED keeps the DTensors where they are."""


@dataclass(frozen=True)
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False
    """Only rank 0 gets the optimizer state (the others get ``{}``); loading: only rank 0
    passes it (``optim_state_dict_to_load`` broadcasts)."""


@dataclass(frozen=True)
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False
    """Move the optimizer state to CPU."""


@dataclass(frozen=True)
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    _use_dtensor: bool = True
    """Accepted for FSDP1 compatibility; values are always DTensors."""


@dataclass(frozen=True)
class StateDictSettings:
    state_dict_type: StateDictType
    """The state dict kind."""
    state_dict_config: StateDictConfig
    """Its model state dict configuration."""
    optim_state_dict_config: OptimStateDictConfig
    """Its optimizer state dict configuration."""


def strip_fsdp1_prefixes(state_dict: Mapping[str, _V]) -> dict[str, _V]:
    """A copy of ``state_dict`` whose keys lost FSDP1's wrapper prefixes
    (``_fsdp_wrapped_module.`` and ``_checkpoint_wrapped_module.``, anywhere in the key)."""
    out: dict[str, _V] = {}
    for key, value in state_dict.items():
        for prefix in _FSDP1_PREFIXES:
            key = key.replace(prefix, "")
        out[key] = value
    return out


def _managed_params(module: nn.Module, recurse: bool) -> list[_FullParam]:
    """The managed parameters of ``module``'s ``fully_shard`` group (and of every group under
    it if ``recurse``), in a rank-independent order, after resharding each group."""
    if isinstance(module, FSDPModule):
        states = module._fsdp_modules(recurse)
    elif recurse:
        states = []
        for m in module.modules():
            if isinstance(m, FSDPModule) and m._fsdp_state() not in states:
                states.append(m._fsdp_state())
    else:
        raise ValueError(
            f"summon_full_params: {type(module).__name__} is not an FSDPModule; with "
            "recurse=False pass a module that fully_shard (or shard_model) was applied to"
        )
    out: list[_FullParam] = []
    for state in states:
        group = state.group
        if group is None:
            continue
        group.reshard()  # the sharded DTensors become the registered parameters
        out.extend(_FullParam(p.sharded, p.owners) for p in group.params)
    return out


@dataclass
class _FullParam:
    sharded: nn.Parameter
    owners: list[tuple[nn.Module, str]]
    full: nn.Parameter | None = None


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Inside the context, the parameters managed by ``module``'s ``fully_shard`` group (and,
    if ``recurse``, by every group under ``module``) are full plain ``nn.Parameter``s
    registered under their original names, as ``FSDP.summon_full_params`` (FSDP1) does.

    Collective: every rank of the groups' meshes must enter and leave together. Gathers in the
    parameters' own dtype (full precision, not the mixed-precision ``param_dtype``). Must not be
    used inside forward or backward, and no forward may run inside the context. Ignored
    parameters are left alone.

    Args:
        module: an ``FSDPModule``, or with ``recurse`` any module containing some.
        recurse: also the groups of submodules; ``False`` only ``module``'s own group.
        writeback: on exit, copy the full parameters (edited in place or not) back into the
            shards; with ``False`` edits are discarded.
        rank0_only: only rank 0 sees full parameters; the others keep their sharded DTensors.
        offload_to_cpu: the full parameters (and grads) live on CPU.
        with_grads: each full parameter's ``.grad`` is the full gradient (all-gathered from the
            sharded gradient), or ``None`` where the sharded parameter has none.

    Raises:
        ValueError: ``rank0_only`` with ``writeback`` (as FSDP1), or ``recurse=False`` on a
            module that is not an ``FSDPModule``.
    """
    if rank0_only and writeback:
        raise ValueError(
            "summon_full_params: writeback=True is not supported with rank0_only=True (the "
            "other ranks would not see the edits); pass writeback=False"
        )
    params = _managed_params(module, recurse)
    keep = not rank0_only or dist.get_rank() == 0
    with torch.no_grad():
        for fp in params:
            full = _full(fp.sharded.data, offload_to_cpu)
            grad = fp.sharded.grad
            full_grad = _full(grad, offload_to_cpu) if with_grads and grad is not None else None
            if not keep:
                continue
            fp.full = nn.Parameter(full, requires_grad=fp.sharded.requires_grad)
            fp.full.grad = full_grad
            for m, name in fp.owners:
                m._parameters[name] = fp.full
    try:
        yield
    finally:
        with torch.no_grad():
            for fp in params:
                if writeback and fp.full is not None:
                    _copy_full_into(fp.sharded, fp.full.detach())
                for m, name in fp.owners:
                    m._parameters[name] = fp.sharded


def _full(t: torch.Tensor, offload_to_cpu: bool) -> torch.Tensor:
    full = t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()
    return full.cpu() if offload_to_cpu else full


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` into this rank's part of ``param`` (a DTensor or a plain tensor); no
    communication, as every rank holds ``full``."""
    if not isinstance(param, DTensor):
        param.copy_(full)
        return
    # src_data_rank=None: each rank keeps its own chunk of its own copy of ``full``
    local = distribute_tensor(
        full.to(param.device), param.device_mesh, param.placements, src_data_rank=None
    ).to_local()
    param.to_local().copy_(local)


def _state_dict_config(
    state_dict_type: object, config: StateDictConfig | None, what: str
) -> tuple[StateDictType, bool, bool]:
    kind = _as_enum(StateDictType, state_dict_type, "state_dict_type", what)
    offload = bool(getattr(config, "offload_to_cpu", False))
    rank0_only = bool(getattr(config, "rank0_only", False))
    if rank0_only and kind is not StateDictType.FULL_STATE_DICT:
        raise ValueError(f"{what}: rank0_only is only supported with FULL_STATE_DICT")
    return kind, offload, rank0_only


def get_state_dict(
    model: nn.Module,
    state_dict_type: StateDictType,
    config: StateDictConfig | None = None,
) -> dict[str, torch.Tensor]:
    """``model``'s state dict of kind ``state_dict_type``, as FSDP1's
    ``with FSDP.state_dict_type(model, state_dict_type, config): model.state_dict()``;
    see [Note: FSDP1 state dicts].

    Collective for ``FULL_STATE_DICT`` (every rank must call it). Keys are the original
    parameter and buffer names (no FSDP1 wrapper prefixes).

    Args:
        model: a module sharded with ``fully_shard`` / ``shard_model`` (plain modules work too).
        state_dict_type: a ``StateDictType`` (torch's enum of the same name is accepted).
        config: a ``StateDictConfig`` (or torch's): ``offload_to_cpu`` moves plain tensors to
            CPU (FULL and LOCAL; SHARDED keeps the DTensors where they are); ``rank0_only``
            (FULL only) leaves ``{}`` on the other ranks.

    Returns:
        The state dict: full plain tensors (FULL), DTensors (SHARDED) or local shards (LOCAL).

    Raises:
        TypeError: a type that is not a ``StateDictType``.
        ValueError: ``rank0_only`` with a type other than FULL.
    """
    kind, offload, rank0_only = _state_dict_config(state_dict_type, config, "get_state_dict")
    sd = _module_state_dict(model)
    if kind is StateDictType.SHARDED_STATE_DICT:
        return {k: v.cpu() if offload and not isinstance(v, DTensor) else v for k, v in sd.items()}
    if kind is StateDictType.LOCAL_STATE_DICT:
        return {
            k: (v.to_local() if isinstance(v, DTensor) else v).detach().cpu()
            if offload
            else (v.to_local() if isinstance(v, DTensor) else v).detach()
            for k, v in sd.items()
        }
    out = {k: _full(v, offload) for k, v in sd.items()}  # collective: every rank gathers
    return {} if rank0_only and dist.get_rank() != 0 else out


def load_state_dict(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    state_dict_type: StateDictType,
    config: StateDictConfig | None = None,
    *,
    strict: bool = True,
) -> object:
    """Load ``state_dict`` of kind ``state_dict_type`` into ``model``, as FSDP1's
    ``with FSDP.state_dict_type(model, state_dict_type, config): model.load_state_dict(sd)``;
    see [Note: FSDP1 state dicts]. FSDP1 wrapper prefixes are stripped from the keys first, so
    a state dict saved by torch's FSDP1 loads.

    Collective for ``FULL_STATE_DICT`` with ``rank0_only`` (rank 0 broadcasts; the other
    ranks' ``state_dict`` is ignored and may be ``{}``).

    Args:
        model: a module sharded with ``fully_shard`` / ``shard_model`` (plain modules work too).
        state_dict: the state dict, of kind ``state_dict_type``.
        state_dict_type: a ``StateDictType`` (torch's enum of the same name is accepted).
        config: a ``StateDictConfig`` (or torch's); only ``rank0_only`` (FULL) matters.
        strict: as ``nn.Module.load_state_dict``: every key must match.

    Returns:
        ``model.load_state_dict``'s missing / unexpected keys (LOCAL: ``None``).

    Raises:
        TypeError: a type that is not a ``StateDictType``.
        ValueError: ``rank0_only`` with a type other than FULL, or LOCAL shards of the wrong
            shape.
        KeyError: LOCAL with ``strict`` and a key missing or unexpected.
        RuntimeError: ``model.load_state_dict``'s errors (FULL, SHARDED).
    """
    kind, _, rank0_only = _state_dict_config(state_dict_type, config, "load_state_dict")
    sd = strip_fsdp1_prefixes(state_dict)
    if kind is StateDictType.LOCAL_STATE_DICT:
        _load_local(model, sd, strict)
        return None
    if kind is StateDictType.FULL_STATE_DICT and rank0_only:
        sd = _broadcast_from_rank0(sd)
    # the class's method: ``state_dict_type`` may have replaced the instance attribute
    return type(model).load_state_dict(model, sd, strict=strict)


def _module_state_dict(model: nn.Module, keep_vars: bool = False) -> dict[str, Any]:
    """``model.state_dict()`` of its class (not an instance attribute ``state_dict_type`` set)."""
    return type(model).state_dict(model, keep_vars=keep_vars)


def _load_local(model: nn.Module, sd: Mapping[str, object], strict: bool) -> None:
    own = _module_state_dict(model, keep_vars=True)
    if strict and own.keys() != sd.keys():
        raise KeyError(
            "load_state_dict(LOCAL_STATE_DICT): keys differ; missing "
            f"{sorted(own.keys() - sd.keys())}, unexpected {sorted(sd.keys() - own.keys())}"
        )
    with torch.no_grad():
        for key, target in own.items():
            if key not in sd:
                continue
            value = sd[key]
            assert isinstance(value, torch.Tensor), f"{key}: expected a tensor, got {value!r}"
            local = target.to_local() if isinstance(target, DTensor) else target
            if local.shape != value.shape:
                raise ValueError(
                    f"load_state_dict(LOCAL_STATE_DICT): {key} has local shape "
                    f"{tuple(local.shape)} here but {tuple(value.shape)} in the state dict; "
                    "LOCAL state dicts load only into a model sharded the same way"
                )
            local.copy_(value)


def _broadcast_from_rank0(sd: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """Every rank gets rank 0's ``sd`` (tensors broadcast over the default group)."""
    rank = dist.get_rank()
    meta = [
        [(k, tuple(v.shape), v.dtype) for k, v in sd.items() if isinstance(v, torch.Tensor)]
        if rank == 0
        else None
    ]
    dist.broadcast_object_list(meta, src=0)
    device = torch.device(_device_type())
    out: dict[str, torch.Tensor] = {}
    for key, shape, dtype in meta[0]:  # type: ignore[union-attr]
        if rank == 0:
            value = sd[key]
            assert isinstance(value, torch.Tensor), f"{key}: expected a tensor"
            t = value.detach().to(device).contiguous()
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=0)
        out[key] = t
    return out


# ---------------------------------------------------------------------------------------------
# state_dict_type: FSDP1's context manager and settings

_SETTINGS_ATTR = "_fsdp1_state_dict_settings"
_OVERRIDDEN = ("state_dict", "load_state_dict", _SETTINGS_ATTR)
_MISSING = object()

_MODEL_CONFIGS = {
    StateDictType.FULL_STATE_DICT: FullStateDictConfig,
    StateDictType.LOCAL_STATE_DICT: LocalStateDictConfig,
    StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig,
}
_OPTIM_CONFIGS = {
    StateDictType.FULL_STATE_DICT: FullOptimStateDictConfig,
    StateDictType.LOCAL_STATE_DICT: LocalOptimStateDictConfig,
    StateDictType.SHARDED_STATE_DICT: ShardedOptimStateDictConfig,
}


def _class_names(value: object) -> set[str]:
    return {c.__name__ for c in type(value).__mro__}


def _check_config(
    config: object, kind: StateDictType, base: type, by_kind: Mapping[StateDictType, type], api: str
) -> Any:
    """``config``, or the default config of ``kind``; torch's classes of the same names pass."""
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
    return StateDictSettings(kind, _MODEL_CONFIGS[kind](), _OPTIM_CONFIGS[kind]())


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
    kind = _as_enum(StateDictType, state_dict_type, "state_dict_type", api)
    model_config = _check_config(
        state_dict_config, kind, StateDictConfig, _MODEL_CONFIGS, f"{api}: state_dict_config"
    )
    optim_config = _check_config(
        optim_state_dict_config,
        kind,
        OptimStateDictConfig,
        _OPTIM_CONFIGS,
        f"{api}: optim_state_dict_config",
    )
    _state_dict_config(kind, model_config, api)
    _state_dict_config(kind, optim_config, api)
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


# ---------------------------------------------------------------------------------------------
# Optimizer state dicts


def _optim_settings(
    model: nn.Module, state_dict_type: object, config: object, api: str
) -> tuple[StateDictType, bool, bool]:
    """The type and (offload_to_cpu, rank0_only): from the arguments, else ``model``'s
    settings."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{api}: model must be an nn.Module, got {type(model).__name__}")
    settings = get_state_dict_type(model)
    if state_dict_type is None:
        kind = settings.state_dict_type
        if config is None:
            config = settings.optim_state_dict_config
    else:
        kind = _as_enum(StateDictType, state_dict_type, "state_dict_type", api)
    config = _check_config(config, kind, OptimStateDictConfig, _OPTIM_CONFIGS, f"{api}: config")
    return _state_dict_config(kind, config, api)


def _check_optim(optim: object, api: str) -> torch.optim.Optimizer:
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError(
            f"{api}: optim must be a torch.optim.Optimizer over the model's parameters, got "
            f"{type(optim).__name__}"
        )
    return optim


def _check_group(group: object, api: str) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{api}: group must be None or a ProcessGroup, got {group!r}")


def _check_osd(osd: object, api: str, what: str = "optim_state_dict") -> Mapping[str, Any]:
    if not isinstance(osd, Mapping) or not {"state", "param_groups"} <= osd.keys():
        got = sorted(osd) if isinstance(osd, Mapping) else type(osd).__name__
        raise ValueError(
            f"{api}: {what} must be a dict with 'state' and 'param_groups' (an optimizer state "
            f"dict), got {got}"
        )
    if not isinstance(osd["param_groups"], (list, tuple)) or not isinstance(osd["state"], Mapping):
        raise ValueError(
            f"{api}: {what}['param_groups'] must be a list of dicts and {what}['state'] a dict"
        )
    return osd


def _param_names(model: nn.Module) -> dict[int, list[str]]:
    """``id(parameter) -> its names`` in ``model.named_parameters(remove_duplicate=False)``
    order (the first is the one ``named_parameters()`` gives). Includes the sharded parameter
    of a group that is unsharded right now (its full parameters are registered)."""
    names: dict[int, list[str]] = {}
    order: dict[str, int] = {}
    for i, (name, p) in enumerate(model.named_parameters(remove_duplicate=False)):
        names.setdefault(id(p), []).append(name)
        order[name] = i
    prefixes: dict[int, str] = {}
    for prefix, m in model.named_modules(remove_duplicate=False):
        prefixes.setdefault(id(m), prefix)
    seen: set[int] = set()
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._fsdp_state().group
        if group is None or id(group) in seen:
            continue
        seen.add(id(group))
        for fp in group.params:
            if id(fp.sharded) in names:
                continue
            fqns = [
                f"{prefixes[id(owner)]}.{attr}" if prefixes[id(owner)] else attr
                for owner, attr in fp.owners
                if id(owner) in prefixes
            ]
            if fqns:
                names[id(fp.sharded)] = sorted(fqns, key=lambda n: order.get(n, len(order)))
    return names


def _optim_params(optim: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    return [list(group["params"]) for group in optim.param_groups]


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: Mapping[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    state_dict_type: StateDictType | None = None,
    config: OptimStateDictConfig | None = None,
) -> dict[str, Any]:
    """``optim``'s state dict keyed by parameter names, in FSDP1's format
    (``FSDP.optim_state_dict``): ``{"state": {fqn: {"step": ..., "exp_avg": ...}},
    "param_groups": [{..., "params": [fqn, ...]}]}``; see [Note: FSDP1 state dicts].

    Collective for FULL (every rank must call it; the optimizer must hold state for the same
    parameters on every rank, as it does after fsdp2 training). FULL values are full plain
    tensors (only on
    rank 0 with ``rank0_only``: the other ranks get ``{}``), SHARDED values the optimizer's
    DTensors (a DCP save or load target), LOCAL values this rank's shards. Non-DTensor values
    (AdamW's ``step``) stay plain tensors. Parameters without state (never stepped) have no
    entry; a tied parameter appears once, under its first name.

    Args:
        model: the module whose parameters ``optim`` holds (the root passed to ``shard_model``).
        optim: the optimizer.
        optim_state_dict: an ``optim.state_dict()`` to convert; ``None``: ``optim.state_dict()``.
        group: accepted for FSDP1 compatibility and unused (each DTensor carries its mesh).
        state_dict_type: a ``StateDictType``; ``None``: the type set by ``state_dict_type`` /
            ``set_state_dict_type`` on ``model``, else SHARDED.
        config: an ``OptimStateDictConfig`` of the type (``None``: the one set on ``model`` if
            the type came from there, else the type's default): ``offload_to_cpu`` moves plain
            tensors to CPU (default ``True`` as FSDP1, except LOCAL; SHARDED keeps DTensors
            where they are); ``rank0_only`` (FULL only).

    Returns:
        The optimizer state dict.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: ``optim`` holds a parameter that is not in ``model``, a malformed
            ``optim_state_dict``, a config of another type, or ``rank0_only`` with a type
            other than FULL.
    """
    api = "optim_state_dict"
    kind, offload, rank0_only = _optim_settings(model, state_dict_type, config, api)
    _check_optim(optim, api)
    _check_group(group, api)
    osd = _check_osd(optim.state_dict() if optim_state_dict is None else optim_state_dict, api)
    names = _param_names(model)
    params = _optim_params(optim)
    if len(osd["param_groups"]) != len(params):
        raise ValueError(
            f"{api}: optim_state_dict has {len(osd['param_groups'])} param groups but optim "
            f"has {len(params)}; pass optim's own state_dict()"
        )
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for saved_group, group_params in zip(osd["param_groups"], params, strict=True):
        ids = list(saved_group["params"])
        if len(ids) != len(group_params):
            raise ValueError(
                f"{api}: a param group of optim_state_dict has {len(ids)} parameters but "
                f"optim's has {len(group_params)}; pass optim's own state_dict()"
            )
        fqns = []
        for pid, p in zip(ids, group_params, strict=True):
            fqn = _name_of(p, names, api)
            fqns.append(fqn)
            if pid in osd["state"]:
                # every rank walks the same parameters and keys: FULL's gathers line up
                state[fqn] = {k: _export(v, kind, offload) for k, v in osd["state"][pid].items()}
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": fqns})
    if rank0_only and dist.get_rank() != 0:
        return {}
    return {"state": state, "param_groups": groups}


def _name_of(p: torch.Tensor, names: Mapping[int, list[str]], api: str) -> str:
    fqns = names.get(id(p))
    if not fqns:
        raise ValueError(
            f"{api}: optim holds a parameter of shape {tuple(p.shape)} that is not a parameter "
            "of model; pass the root module whose parameters the optimizer was built from"
        )
    return fqns[0]


def _export(value: object, kind: StateDictType, offload: bool) -> object:
    if isinstance(value, DTensor):
        if kind is StateDictType.FULL_STATE_DICT:
            return _full(value, offload)
        if kind is StateDictType.LOCAL_STATE_DICT:
            local = value.to_local()
            return local.cpu() if offload else local
        return value
    if isinstance(value, torch.Tensor):
        if kind is StateDictType.FULL_STATE_DICT:
            return _full(value, offload)
        return value.cpu() if offload else value
    return value


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: Mapping[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    state_dict_type: StateDictType | None = None,
    config: OptimStateDictConfig | None = None,
) -> dict[str, Any]:
    """Turn an FQN-keyed optimizer state dict (``optim_state_dict``'s or torch's FSDP1's
    format) into one ``optim.load_state_dict`` takes (FSDP1's ``FSDP.optim_state_dict_to_load``);
    see [Note: FSDP1 state dicts].

    Parameter-shaped tensors become DTensors of the parameter's layout without communication:
    full tensors (FULL) are cut locally, local shards (LOCAL) wrapped, DTensors (SHARDED)
    redistributed if their layout differs. FSDP1 wrapper prefixes are stripped from the names
    and a tied parameter may appear under any of its names. The checkpoint's parameter order
    within a group does not matter; its groups are matched to ``optim``'s by their parameters.
    Parameters without state in the checkpoint get none. Collective with ``rank0_only`` (FULL):
    rank 0 broadcasts its ``optim_state_dict``; the other ranks' is ignored (may be ``{}``).

    Args:
        model: the module whose parameters ``optim`` holds (the root passed to ``shard_model``).
        optim: the optimizer to load into.
        optim_state_dict: the FQN-keyed optimizer state dict.
        is_named_optimizer: must be ``False`` (TorchRec's keyed optimizers are not supported).
        load_directly: also call ``optim.load_state_dict`` with the result.
        group: accepted for FSDP1 compatibility and unused (each DTensor carries its mesh).
        state_dict_type: a ``StateDictType``; ``None``: the type set on ``model``, else
            SHARDED.
        config: an ``OptimStateDictConfig`` of the type; only ``rank0_only`` (FULL) matters.

    Returns:
        The state dict for ``optim.load_state_dict``: integer ids in ``optim``'s own order.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: a name that is not a parameter of ``model``, param groups that do not
            match ``optim``'s, a tensor of the wrong shape, a ``ShardedTensor`` (load it with
            DCP instead), or ``is_named_optimizer``.
    """
    api = "optim_state_dict_to_load"
    kind, _, rank0_only = _optim_settings(model, state_dict_type, config, api)
    _check_optim(optim, api)
    _check_group(group, api)
    if is_named_optimizer:
        raise ValueError(f"{api}: is_named_optimizer=True is not supported; pass False")
    if rank0_only:
        osd = _broadcast_tree(lambda: _check_osd(optim_state_dict, api))
    else:
        osd = _check_osd(optim_state_dict, api)
    names = _param_names(model)
    by_name: dict[str, torch.Tensor] = {}
    for p in _all_params(model, names):
        for fqn in names[id(p)]:
            by_name[fqn] = p

    def canonical(fqn: object, where: str) -> str:
        if not isinstance(fqn, str):
            raise ValueError(f"{api}: {where} must be parameter names (str), got {fqn!r}")
        stripped = next(iter(strip_fsdp1_prefixes({fqn: None})))
        p = by_name.get(stripped)
        if p is None:
            raise ValueError(f"{api}: {where} names {fqn!r}, which is not a parameter of model")
        return names[id(p)][0]

    saved_groups: list[tuple[dict[str, Any], list[str]]] = []
    for i, g in enumerate(osd["param_groups"]):
        if not isinstance(g, Mapping) or "params" not in g:
            raise ValueError(f"{api}: param_groups[{i}] must be a dict with 'params'")
        fqns = [canonical(f, f"param_groups[{i}]['params']") for f in g["params"]]
        saved_groups.append(({k: v for k, v in g.items() if k != "params"}, fqns))
    saved_state = {canonical(f, "state keys"): v for f, v in osd["state"].items()}
    grouped = {f for _, fqns in saved_groups for f in fqns}
    if not saved_state.keys() <= grouped:
        raise ValueError(
            f"{api}: state for {sorted(saved_state.keys() - grouped)}, which no param group lists"
        )

    params = _optim_params(optim)
    if len(saved_groups) != len(params):
        raise ValueError(
            f"{api}: optim_state_dict has {len(saved_groups)} param groups but optim has "
            f"{len(params)}"
        )
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    used: set[int] = set()
    next_id = 0
    for gi, group_params in enumerate(params):
        fqns = [_name_of(p, names, api) for p in group_params]
        match = [
            j
            for j, (_, saved) in enumerate(saved_groups)
            if j not in used and set(saved) == set(fqns)
        ]
        if not match:
            raise ValueError(
                f"{api}: optim's param group {gi} holds {_some(fqns)}, which no param group "
                "of optim_state_dict holds exactly (same parameters, any order)"
            )
        used.add(match[0])
        ids = list(range(next_id, next_id + len(group_params)))
        next_id += len(group_params)
        for pid, p, fqn in zip(ids, group_params, fqns, strict=True):
            if fqn in saved_state:
                values = saved_state[fqn]
                if not isinstance(values, Mapping):
                    raise ValueError(f"{api}: state[{fqn!r}] must be a dict, got {values!r}")
                state[pid] = {
                    k: _import(v, p, kind, f"state[{fqn!r}][{k!r}]", api) for k, v in values.items()
                }
        groups.append({**saved_groups[match[0]][0], "params": ids})
    out = {"state": state, "param_groups": groups}
    if load_directly:
        optim.load_state_dict(out)
    return out


def _some(names: list[str], n: int = 6) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return f"[{shown}{', ...' if len(names) > n else ''}] ({len(names)} parameters)"


def _all_params(model: nn.Module, names: Mapping[int, list[str]]) -> list[torch.Tensor]:
    """The parameters ``names`` knows, registered or sharded-but-unregistered."""
    out: dict[int, torch.Tensor] = {
        id(p): p for _, p in model.named_parameters(remove_duplicate=False)
    }
    for m in model.modules():
        if isinstance(m, FSDPModule) and m._fsdp_state().group is not None:
            for fp in m._fsdp_state().group.params:  # type: ignore[union-attr]
                out.setdefault(id(fp.sharded), fp.sharded)
    return [p for pid, p in out.items() if pid in names]


def _import(value: object, param: torch.Tensor, kind: StateDictType, what: str, api: str) -> object:
    """``value`` in ``param``'s layout if it is parameter-shaped (see [Note: FSDP1 state
    dicts]); other values as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "local_shards"):
        raise ValueError(
            f"{api}: {what} is a ShardedTensor (torch's FSDP1 SHARDED format); save it with "
            "torch.distributed.checkpoint and dcp.load it into "
            "optim_state_dict(model, optim, state_dict_type=SHARDED_STATE_DICT)"
        )
    if not isinstance(param, DTensor):  # an ignored or unsharded parameter
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if value.dim() > 0 and value.shape != param.shape:
            raise ValueError(
                f"{api}: {what} has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}"
            )
        return value
    mesh, placements = param.device_mesh, param.placements
    if isinstance(value, DTensor):
        if value.shape != param.shape:
            raise ValueError(
                f"{api}: {what} has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}"
            )
        if value.device_mesh == mesh:
            return value if value.placements == placements else value.redistribute(mesh, placements)
        value = value.full_tensor()
    if value.dim() == 0:
        return value  # scalars (AdamW's step)
    value = value.detach()
    local_shape = param.to_local().shape
    if kind is StateDictType.LOCAL_STATE_DICT and value.shape == local_shape:
        return DTensor.from_local(
            value.to(param.device),
            mesh,
            placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    if value.shape == param.shape:
        # no communication: every rank holds the full value and keeps its piece
        return distribute_tensor(value.to(param.device), mesh, placements, src_data_rank=None)
    want = "local shard" if kind is StateDictType.LOCAL_STATE_DICT else "full"
    shape = local_shape if kind is StateDictType.LOCAL_STATE_DICT else param.shape
    raise ValueError(
        f"{api}: {what} has shape {tuple(value.shape)}, but the parameter's {want} shape is "
        f"{tuple(shape)}; a {kind.name} optimizer state dict of another model?"
    )


@dataclass(frozen=True)
class _TensorSlot:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool


@dataclass(frozen=True)
class _RaiseOnAllRanks:
    cls: type[Exception]
    message: str


def _broadcast_tree(make_tree: Callable[[], object]) -> Any:
    """Every rank gets rank 0's ``make_tree()`` (dicts, lists, tuples and plain tensors;
    tensors are broadcast over the default group, the rest pickled). An error on rank 0 is
    raised on every rank (rather than leaving the others waiting)."""
    rank = dist.get_rank()
    tensors: list[torch.Tensor] = []

    def strip(obj: object) -> object:
        if isinstance(obj, torch.Tensor):
            if isinstance(obj, DTensor):  # full_tensor() here would wait for the other ranks
                raise ValueError(
                    "optim_state_dict_to_load: a FULL_STATE_DICT with rank0_only holds full "
                    "plain tensors, got a DTensor; pass SHARDED_STATE_DICT for DTensors"
                )
            tensors.append(obj.detach())
            return _TensorSlot(
                len(tensors) - 1, tuple(obj.shape), obj.dtype, obj.device.type == "cpu"
            )
        if isinstance(obj, Mapping):
            return {k: strip(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(strip(v) for v in obj)
        return obj

    box: list[object] = [None]
    if rank == 0:
        try:
            box[0] = strip(make_tree())
        except (ValueError, TypeError) as e:
            box[0] = _RaiseOnAllRanks(type(e), str(e))
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], _RaiseOnAllRanks):
        raise box[0].cls(box[0].message)
    device = torch.device(_device_type())

    def fill(obj: object) -> object:
        if isinstance(obj, _TensorSlot):
            if rank == 0:
                t = tensors[obj.index].to(device).contiguous()
            else:
                t = torch.empty(obj.shape, dtype=obj.dtype, device=device)
            dist.broadcast(t, src=0)
            return t.cpu() if obj.on_cpu else t
        if isinstance(obj, Mapping):
            return {k: fill(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(fill(v) for v in obj)
        return obj

    return fill(box[0])


def init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Create ``optim``'s state for the parameters that have none, without changing any
    parameter or existing state: one ``optim.step()`` with zero gradients and learning rate 0
    over just those parameters. A DCP load needs the state to exist as its target (FSDP1 users
    take a training step first).

    Works for optimizers whose update is zero at ``lr=0`` (SGD, Adam, AdamW, ...). Gradients
    and learning rates are restored afterwards. No communication for fsdp2 parameters.

    Args:
        optim: the optimizer.

    Raises:
        TypeError: ``optim`` is not a ``torch.optim.Optimizer``.
    """
    _check_optim(optim, "init_optim_state")
    params = [p for g in optim.param_groups for p in g["params"]]
    todo = [p for p in params if p.requires_grad and not optim.state.get(p)]
    if not todo:
        return
    grads = {id(p): p.grad for p in params}
    lrs = [g["lr"] for g in optim.param_groups]
    try:
        for p in params:
            p.grad = None  # parameters with state are skipped by step()
        for p in todo:
            p.grad = torch.zeros_like(p)
        for g in optim.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        optim.step()
    finally:
        for g, lr in zip(optim.param_groups, lrs, strict=True):
            g["lr"] = lr
        for p in params:
            p.grad = grads[id(p)]
