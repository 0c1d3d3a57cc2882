"""How a collective's bytes are held: ``Pending`` (a collective in flight and what it keeps
alive), ``SharedWork`` (one collective serving several groups), and the copies around a
collective (packing gradients rank-major, scattering an all-gather's output). Stateless;
collectives.py issues, gloo.py adds the gloo exchanges."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from fsdp2._core.support import compat
from fsdp2.api import AllGather, Comm, ReduceScatter

__all__ = [
    "BackendAlloc",
    "Pending",
    "SharedWork",
    "Waitable",
    "copy_out",
    "empty_buffer",
    "pack_for_reduce_scatter",
]


class Waitable(Protocol):
    """Anything with a ``Work``'s ``wait`` (an exchange that sums at the wait: exact.py)."""

    def wait(self, timeout: Any = ...) -> Any: ...


class SharedWork:
    """One collective's work shared by several ``Pending`` (the groups of a bucket):
    the first ``wait`` waits, the others return at once."""

    __slots__ = ("work",)

    def __init__(self, work: dist.Work | SharedWork | Waitable | None) -> None:
        self.work = work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


class Pending(NamedTuple):
    """A collective in flight: ``output`` is valid once ``work`` is waited.

    ``input`` is held until then so its memory is not reused while the
    collective may still read it (on CUDA the collective runs on another stream).
    """

    output: torch.Tensor
    work: dist.Work | SharedWork | Waitable | None
    input: torch.Tensor | None = None
    copy: bool = False  # ``output`` is a view into ``input``: return a copy of it
    own_row: int = -1  # an all-gather's row of ``output`` still only in ``input``

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        if self.own_row >= 0:
            assert self.input is not None
            self.output[self.own_row].copy_(self.input)
        return self.output.clone() if self.copy else self.output

    def wait_rows(self) -> list[torch.Tensor]:
        """An all-gather's rows once done, this rank's own straight from its input: the
        caller copies them out without the copy into ``output`` first."""
        if self.work is not None:
            self.work.wait()
        rows = list(self.output.unbind(0))
        if self.own_row >= 0:
            assert self.input is not None
            rows[self.own_row] = self.input
        return rows


def empty_buffer(
    numel: int, like: torch.Tensor, dtype: torch.dtype, comm: Comm | None
) -> torch.Tensor:
    """A collective's buffer: from the custom comm's ``allocate`` when there is one."""
    if comm is None:
        return torch.empty(numel, dtype=dtype, device=like.device)
    return comm.allocate((numel,), dtype=dtype, device=like.device)


def copy_out(output: torch.Tensor, split_sizes: list[int], dsts: list[torch.Tensor]) -> None:
    """Scatter a rank-major all-gather output into per-parameter ``(world, padded)`` views
    (or one row of it into the parameters' ``(padded,)`` rows)."""
    torch.split_with_sizes_copy(output, split_sizes, dim=-1, out=dsts)


def pack_for_reduce_scatter(
    grads: list[torch.Tensor],
    world_size: int,
    dtype: torch.dtype,
    comm: ReduceScatter | None = None,
) -> torch.Tensor:
    """Pack unsharded gradients rank-major, each padded to ``ceil(dim0 / world)`` rows:
    row ``r`` of the result is what rank ``r`` receives after the reduce-scatter."""
    numel = sum(-(-g.size(0) // world_size) * (g.numel() // max(g.size(0), 1)) for g in grads)
    out = empty_buffer(world_size * numel, grads[0], dtype, comm).view(world_size, numel)
    # _chunk_cat casts into ``out``: no cast copy of the gradients (bf16 gradients reduced
    # in fp32 would otherwise hold an fp32 copy next to the packed buffer)
    grads = [g for g in grads if g.numel()]
    # empty parameters take no room (and _chunk_cat rejects them). fsdp2.estimate_memory's
    # fake tensors hold no values, and _chunk_cat's fake kernel costs a few ops per rank
    # (seconds at 512 ranks): the packed buffer's memory is all the simulation needs
    if not grads or isinstance(out, FakeTensor):
        return out
    if all(g.dtype == grads[0].dtype for g in grads):
        torch._chunk_cat(grads, dim=0, num_chunks=world_size, out=out)
        return out
    # gradients of several dtypes (a TP gradient all-reduced in reduce_dtype beside compute-
    # dtype ones): _chunk_cat takes one input dtype, so pack each run of one dtype apart
    col, i = 0, 0
    while i < len(grads):
        j = i
        while j < len(grads) and grads[j].dtype == grads[i].dtype:
            j += 1
        run = grads[i:j]
        n = sum(-(-g.size(0) // world_size) * (g.numel() // max(g.size(0), 1)) for g in run)
        tmp = torch.empty(world_size, n, dtype=dtype, device=out.device)
        torch._chunk_cat(run, dim=0, num_chunks=world_size, out=tmp)
        out[:, col : col + n].copy_(tmp)
        col, i = col + n, j
    return out


class BackendAlloc(AllGather, ReduceScatter):
    """Collectives (all-gather and reduce-scatter) whose buffers come from the process
    group's memory allocator."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    @classmethod
    def for_group(cls, group: dist.ProcessGroup, device: torch.device) -> BackendAlloc | None:
        if device.type != "cuda":
            return None  # gloo and CPU tensors: the default allocator is the only one
        try:  # NCCL built without ncclMemAlloc raises rather than returning None
            allocator = getattr(group._get_backend(device), "mem_allocator", None)
        except RuntimeError:
            allocator = None
        if allocator is None:
            return None
        return cls(torch.cuda.MemPool(allocator))

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        with torch.cuda.use_mem_pool(self.pool):
            return torch.empty(*size, dtype=dtype, device=device)

    def __call__(  # one call for both bases: all-gather (no op) and reduce-scatter (op)
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        *args: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        work: dist.Work | None
        if args:  # reduce-scatter: (..., op)
            work = compat.reduce_scatter_single(
                output_tensor, input_tensor, args[0], group, async_op=async_op
            )
        else:
            work = compat.all_gather_single(output_tensor, input_tensor, group, async_op=async_op)
        return work
