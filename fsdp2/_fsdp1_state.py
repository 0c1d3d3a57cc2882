"""FSDP1-style ``summon_full_params`` and state dicts (FULL / SHARDED / LOCAL) for
fsdp2 models; re-exported by ``fsdp2.fsdp1``. The core never imports it."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .fully_shard import FSDPModule

_E = TypeVar("_E", bound=enum.Enum)
_V = TypeVar("_V")


def _as_enum(cls: type[_E], value: object, what: str) -> _E:
    if isinstance(value, cls):
        return value
    # torch's FSDP1 enums carry the same names: accept them so imports can move one at a time
    if isinstance(value, enum.Enum) and value.name in cls.__members__:
        return cls[value.name]
    raise TypeError(f"shard_model: {what} must be a {cls.__name__}, got {value!r}")


def _device_type() -> str:
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc.type if acc is not None and dist.get_backend() != "gloo" else "cpu"


# ---------------------------------------------------------------------------------------------
# summon_full_params and FSDP1-style state dicts
#
# [Note: FSDP1 state dicts]
# FSDP1's ``state_dict_type`` context switches what ``model.state_dict()`` returns; here the
# type is an argument of ``get_state_dict`` / ``load_state_dict`` instead (no global mode).
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
    """Move the optimizer state to CPU. Accepted for FSDP1 compatibility: fsdp2 optimizer
    state is already per-parameter DTensors (see ``torch.distributed.checkpoint.state_dict``)."""


@dataclass(frozen=True)
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False
    """Only rank 0 gets the optimizer state."""


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
    kind = _as_enum(StateDictType, state_dict_type, "state_dict_type")
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

    Raises:
        ValueError: ``rank0_only`` with a type other than FULL.
    """
    kind, offload, rank0_only = _state_dict_config(state_dict_type, config, "get_state_dict")
    sd = model.state_dict()
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

    Returns:
        ``model.load_state_dict``'s missing / unexpected keys (LOCAL: ``None``).

    Raises:
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
    return model.load_state_dict(sd, strict=strict)


def _load_local(model: nn.Module, sd: Mapping[str, object], strict: bool) -> None:
    own = model.state_dict(keep_vars=True)
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
