"""FSDP1's ``summon_full_params`` for fsdp2 models; re-exported by ``fsdp2.fsdp1``. The core
never imports it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp2 import FSDPModule
from fsdp2._core.front.seam import managed_params
from fsdp2.fsdp1._collectives import gather_full


def _managed_params(module: nn.Module, recurse: bool) -> list[_FullParam]:
    """The managed parameters of ``module``'s ``fully_shard`` group (and of every group under
    it if ``recurse``), in a rank-independent order, after resharding each group (the sharded
    DTensors become the registered parameters)."""
    if not recurse and not isinstance(module, FSDPModule):
        raise ValueError(
            f"summon_full_params: {type(module).__name__} is not an FSDPModule; with "
            "recurse=False pass a module that fully_shard (or shard_model) was applied to"
        )
    out = []
    for p in managed_params(module, recurse=recurse, reshard=True):
        assert isinstance(p.sharded, nn.Parameter), "the registered sharded DTensor"
        out.append(_FullParam(p.sharded, p.owners))
    return out


@dataclass
class _FullParam:
    sharded: nn.Parameter  # a DTensor
    owners: tuple[tuple[nn.Module, str], ...]
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
            full = gather_full(fp.sharded.data, offload_to_cpu)
            grad = fp.sharded.grad
            full_grad = (
                gather_full(grad, offload_to_cpu) if with_grads and grad is not None else None
            )
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
