"""The FSDP1 layer's collectives outside the core's: gathering a full tensor and broadcasting
rank 0's state dicts (``rank0_only`` loading). The core never imports it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp2._core.front.seam import comm_device_type

_T = TypeVar("_T")


def gather_full(t: torch.Tensor, offload_to_cpu: bool) -> torch.Tensor:
    """``t`` as a full plain tensor of its own (a DTensor is all-gathered: collective)."""
    full = t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()
    return full.cpu() if offload_to_cpu else full


def broadcast_from_rank0(sd: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """Every rank gets rank 0's ``sd`` (tensors broadcast over the default group)."""
    rank = dist.get_rank()
    meta = [
        [(k, tuple(v.shape), v.dtype) for k, v in sd.items() if isinstance(v, torch.Tensor)]
        if rank == 0
        else None
    ]
    dist.broadcast_object_list(meta, src=0)
    received = meta[0]
    assert received is not None, "broadcast_object_list filled it from rank 0"
    device = torch.device(comm_device_type())
    out: dict[str, torch.Tensor] = {}
    for key, shape, dtype in received:
        if rank == 0:
            value = sd[key]
            assert isinstance(value, torch.Tensor), f"{key}: expected a tensor"
            t = value.detach().to(device).contiguous()
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=0)
        out[key] = t
    return out


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


def broadcast_tree(make_tree: Callable[[], _T]) -> _T:
    """Every rank gets rank 0's ``make_tree()`` (dicts, lists, tuples and plain tensors;
    tensors are broadcast over the default group, the rest pickled; mappings come back as
    dicts). An error on rank 0 is raised on every rank (rather than leaving the others
    waiting)."""
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
    device = torch.device(comm_device_type())

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

    return cast(_T, fill(box[0]))  # rank 0's tree, rebuilt
