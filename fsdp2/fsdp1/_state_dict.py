"""FSDP1-style model state dicts (FULL / SHARDED / LOCAL) for fsdp2 models: the state dict
types and configs, ``get_state_dict`` and ``load_state_dict``; re-exported by ``fsdp2.fsdp1``.
The core never imports it."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2.fsdp1._collectives import broadcast_from_rank0, gather_full

_E = TypeVar("_E", bound=enum.Enum)
_V = TypeVar("_V")


def as_enum(cls: type[_E], value: object, what: str, api: str = "shard_model") -> _E:
    if isinstance(value, cls):
        return value
    # torch's FSDP1 enums carry the same names: accept them so imports can move one at a time
    if isinstance(value, enum.Enum) and value.name in cls.__members__:
        return cls[value.name]
    raise TypeError(f"{api}: {what} must be a {cls.__name__}, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Model state dicts
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
# torch's FSDP1 saves SHARDED model and optimizer state as ``ShardedTensor``s; DCP reshards
# them into our DTensors by key, so a DCP checkpoint of either loads into the other.
# Optimizer state dicts: see [Note: FSDP1 optimizer state dicts] in _optim.py;
# ``state_dict_type`` / ``set_state_dict_type`` live in _state_dict_type.py.

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


def config_settings(
    state_dict_type: object, config: object, what: str
) -> tuple[StateDictType, bool, bool]:
    kind = as_enum(StateDictType, state_dict_type, "state_dict_type", what)
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
    kind, offload, rank0_only = config_settings(state_dict_type, config, "get_state_dict")
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
    out = {k: gather_full(v, offload) for k, v in sd.items()}  # collective: every rank gathers
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
    kind, _, rank0_only = config_settings(state_dict_type, config, "load_state_dict")
    sd = strip_fsdp1_prefixes(state_dict)
    if kind is StateDictType.LOCAL_STATE_DICT:
        _load_local(model, sd, strict)
        return None
    if kind is StateDictType.FULL_STATE_DICT and rank0_only:
        sd = broadcast_from_rank0(sd)
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
