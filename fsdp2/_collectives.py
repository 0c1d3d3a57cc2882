"""Flat collectives: stateless functions over tensors and a process group.

No module knowledge here; the param group decides when to call them. Every
collective is issued with ``async_op=True`` and returns the ``Work`` to wait
on; on CUDA, c10d runs it on the process group's own stream and ``wait()``
orders the current stream after it, so the host never blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat collectives; older builds only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup):
    # Looked up at call time so tests can count calls by patching torch.distributed.
    fn = getattr(dist, _all_gather_flat.__name__)
    return fn(output, input, group=group, async_op=True)


def _reduce_scatter(output, input, op, group):
    fn = getattr(dist, _reduce_scatter_flat.__name__)
    return fn(output, input, op=op, group=group, async_op=True)


class Pending(NamedTuple):
    """A collective in flight: ``output`` is valid once ``work`` is waited.

    ``input`` is held until then so its memory is not reused while the
    collective may still read it (on CUDA the collective runs on another stream).
    """

    output: torch.Tensor
    work: dist.Work | None
    input: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.output


def all_gather(input: torch.Tensor, group: dist.ProcessGroup, world_size: int) -> Pending:
    """All-gather a flat 1D ``input`` into a ``(world_size, numel)`` rank-major output."""
    if world_size == 1:
        return Pending(input.view(1, -1), None)
    output = torch.empty(world_size * input.numel(), dtype=input.dtype, device=input.device)
    work = _all_gather(output, input, group)
    return Pending(output.view(world_size, -1), work, input)


def copy_out(
    output: torch.Tensor, split_sizes: list[int], dsts: list[torch.Tensor]
) -> None:
    """Scatter a rank-major all-gather output into per-parameter ``(world, padded)`` views."""
    torch.split_with_sizes_copy(output, split_sizes, dim=1, out=dsts)


def pack_for_reduce_scatter(
    grads: list[torch.Tensor], world_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Pack unsharded gradients rank-major, each padded to ``ceil(dim0 / world)`` rows:
    row ``r`` of the result is what rank ``r`` receives after the reduce-scatter."""
    numel = sum(-(-g.size(0) // world_size) * (g.numel() // max(g.size(0), 1)) for g in grads)
    out = torch.empty((world_size, numel), dtype=dtype, device=grads[0].device)
    if any(g.dtype != dtype for g in grads):
        grads = [g.to(dtype) for g in grads]
    torch._chunk_cat(grads, dim=0, num_chunks=world_size, out=out)
    return out


def reduce_scatter(
    input: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType
) -> Pending:
    """Reduce-scatter a ``(world, numel)`` input; each rank gets ``numel`` elements."""
    world_size = input.size(0)
    if world_size == 1:
        return Pending(input.view(-1), None)
    output = torch.empty(input.size(1), dtype=input.dtype, device=input.device)
    return Pending(output, _reduce_scatter(output, input.view(-1), op, group), input)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, op) -> Pending:
    """All-reduce ``tensor`` in place."""
    return Pending(tensor, dist.all_reduce(tensor, op=op, group=group, async_op=True))
