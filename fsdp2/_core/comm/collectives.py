"""Every collective the engine issues goes through one function per kind: ``all_gather``,
``reduce_scatter`` and ``all_reduce``. Each does, once for every caller (a group, a bucket of
groups, a released parameter gathered again, a ``reshard_after_forward=int`` copy), the
copy-in under its profiler label, the observers' ``collective`` event (the debug mode's
cross-rank check, the tests' counter: [Note: observation] in observe.py), the issue under
its label, and the choice of transport: c10d's collective, a custom comm
(``set_custom_all_gather`` / ``set_custom_reduce_scatter``), or gloo's exchanges (gloo.py).

Stateless: values in, ``Pending`` out. Every collective is issued with ``async_op=True``; on
CUDA, c10d runs it on the process group's own stream and ``wait()`` orders the current
stream after it, so the host never blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fsdp2._core.comm import gloo
from fsdp2._core.comm.transport import Pending, SharedWork, empty_buffer, pack_for_reduce_scatter
from fsdp2._core.support import compat
from fsdp2._core.support.labels import label
from fsdp2._core.support.observe import HUB, Collective
from fsdp2.api import AllGather, ReduceScatter

__all__ = ["DividePlan", "Into", "all_gather", "all_reduce", "divide_plan", "reduce_scatter"]

What = str | Callable[[], str]  # a label's text, or a function building it (called only if shown)


def _text(what: What) -> str:
    return what() if callable(what) else what


class Into(NamedTuple):
    """A plain group's unsharded rows (``rows[r][i]``: rank ``r``'s piece ``i`` of ``sizes``):
    an all-gather by gloo exchange lands straight in them ([Note: gloo straight in and
    out] in gloo.py) after ``prepare()`` gave them their storage."""

    sizes: list[int]
    rows: list[list[torch.Tensor]]
    prepare: Callable[[], None]


def all_gather(
    inputs: list[torch.Tensor] | Callable[[], list[torch.Tensor]],
    group: dist.ProcessGroup,
    world: int,
    what: What,
    *,
    comm: AllGather | None = None,
    into: Into | None = None,
) -> list[Pending | gloo.Received]:
    """All-gather flat 1D inputs in ONE collective (of their concatenation when several: a
    bucket). ``inputs`` may be a function making them (the copy-in, labelled). Returns one
    result per input: a ``Pending`` whose output is its ``(world, numel)`` rank-major
    columns (the whole output stays alive until every one is dropped), or, when ``into``
    is given and the all-gather goes by gloo exchange, a ``gloo.Received`` filling
    ``into``'s rows."""
    if callable(inputs):
        with label("copy_in", what):
            inputs = inputs()
    if world == 1:
        return [Pending(x.view(1, -1), None) for x in inputs]
    numel = inputs[0].numel() if len(inputs) == 1 else sum(x.numel() for x in inputs)
    dtype, device = inputs[0].dtype, inputs[0].device
    exchange = comm is None and gloo.by_exchange(numel * dtype.itemsize, group, device)
    if HUB.observers:
        transport = "custom" if comm is not None else "exchange" if exchange else compat.AG_API
        c = Collective(
            "all-gather", _text(what), world * numel, numel, dtype, group, world, transport
        )
        HUB.collective(c)
    with label("all_gather issue", what):
        if into is not None and exchange and len(inputs) == 1:
            into.prepare()
            return [gloo.all_gather_into(inputs[0], into.sizes, into.rows, group)]
        flat = inputs[0] if len(inputs) == 1 else torch.cat(inputs)
        output = empty_buffer(world * numel, flat, dtype, comm).view(world, numel)
        if exchange:
            whole = gloo.all_gather_by_exchange(output, flat, group)
        else:
            if comm is None:
                work = compat.all_gather_single(output.view(-1), flat, group, async_op=True)
            else:
                work = comm(output.view(-1), flat, group, async_op=True)
            whole = Pending(output, work, flat)
    if len(inputs) == 1:
        return [whole]
    shared = SharedWork(whole.work)
    pendings: list[Pending | gloo.Received] = []
    start = 0
    for x in inputs:
        n = x.numel()
        own = flat.narrow(0, start, n)  # holds ``flat`` too
        out = whole.output.narrow(1, start, n)
        pendings.append(Pending(out, shared, own, own_row=whole.own_row))
        start += n
    return pendings


def reduce_scatter(
    grads: list[torch.Tensor],
    world: int,
    dtype: torch.dtype,
    group: dist.ProcessGroup,
    what: What,
    *,
    op: Any,
    pre: float | None = None,
    comm: ReduceScatter | None = None,
) -> Pending:
    """Reduce-scatter unsharded gradients (each split on dim 0 into ``world`` slices of
    ``ceil(dim0 / world)`` rows) in ONE collective: packed rank-major in ``dtype`` and
    divided by ``pre`` first if given; each rank gets its slice of every gradient, back to
    back. On 2 gloo ranks large gradients are sent straight instead of packed ([Note:
    gloo straight in and out]); on more gloo ranks an all-reduce stands for it ([Note:
    gloo reduce-scatter]). Once packed, ``grads`` is emptied (the caller's list too), so
    the gradients can be freed before the collective's own buffers are allocated."""
    on_gloo = world > 1 and comm is None and gloo.is_gloo(group, grads[0].device)
    pair = on_gloo and gloo.pair_exchange(world, op)  # 2 gloo ranks: sends and receives
    if HUB.observers and world > 1:
        if comm is not None:
            transport = "custom"
        elif on_gloo:
            transport = "exchange" if pair else "all_reduce"
        else:
            transport = compat.RS_API
        numel = world * sum(
            -(-g.size(0) // world) * (g.numel() // max(g.size(0), 1)) for g in grads
        )
        c = Collective(
            "reduce-scatter", _text(what), numel, numel, dtype, group, world, transport, op
        )
        HUB.collective(c)
    if pair and pre is None and gloo.sends_any_straight(grads, dtype):
        with label("reduce_scatter issue", what):
            pending = gloo.reduce_scatter_grads(grads, dtype, op, group)
        if pending is not None:
            return pending
    with label("reduce_scatter pack", what):
        packed = pack_for_reduce_scatter(grads, world, dtype, comm)
        grads.clear()  # the caller's list too: the gradients may go before the issue
        if pre is not None:
            packed.div_(pre)
    if world == 1:  # one shard rank (replicate): the packed gradients are the result
        return Pending(packed.view(-1), None)
    with label("reduce_scatter issue", what):
        return _reduce_scatter_packed(packed, group, op, comm, on_gloo, pair)


def _reduce_scatter_packed(
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: Any,
    comm: ReduceScatter | None,
    on_gloo: bool,
    pair: bool,
) -> Pending:
    """Reduce-scatter a ``(world, numel)`` input; each rank gets ``numel`` elements."""
    if input.size(0) == 1:
        return Pending(input.view(-1), None)
    if pair:
        return gloo.reduce_scatter_by_exchange(input, op, group)
    if on_gloo:
        work = gloo.reduce_scatter_by_all_reduce(input.view(-1), op, group)
        return Pending(input[group.rank()], work, input, copy=True)
    output = empty_buffer(input.size(1), input, input.dtype, comm)
    if comm is None:
        work = compat.reduce_scatter_single(output, input.view(-1), op, group, async_op=True)
    else:
        work = comm(output, input.view(-1), group, op, async_op=True)
    return Pending(output, work, input)


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    what: What,
    *,
    op: Any,
    comm: ReduceScatter | None = None,
) -> Pending:
    """All-reduce ``tensor`` in place; through ``comm.all_reduce(tensor, group, op)`` when the
    group's custom reduce-scatter has one (``fsdp2.reduction.ExchangeReduceScatter``: HSDP's
    all-reduce by exchange, in its wire dtype)."""
    custom = getattr(comm, "all_reduce", None)
    if HUB.observers:
        n, size = tensor.numel(), group.size()
        transport = "custom" if custom is not None else "all_reduce"
        HUB.collective(
            Collective("all-reduce", _text(what), n, n, tensor.dtype, group, size, transport, op)
        )
    with label("all_reduce issue", what):
        if custom is not None:
            return Pending(tensor, custom(tensor, group, op))
        return Pending(tensor, dist.all_reduce(tensor, op=op, group=group, async_op=True))


class DividePlan(NamedTuple):
    """How gradients get averaged: divide the packed input by ``pre``, reduce
    with ``rs_op`` then ``ar_op``, divide the result by ``post`` (``None``: skip)."""

    pre: float | None
    post: float | None
    rs_op: Any
    ar_op: Any


def divide_plan(
    shard_size: int,
    replicate_size: int,
    dtype: torch.dtype,
    factor: float | None,
    force_sum: bool,
) -> DividePlan:
    """Average over ``shard_size * replicate_size`` ranks, or divide by ``factor``.

    fp32/bf16 use the collective's own average (one pass, no extra kernel).
    fp16 (or ``force_sum``) sums; fp16 splits the division around the sum
    (about sqrt(N) before, the rest after) so neither overflows nor underflows.
    """
    SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
    dp = shard_size * replicate_size
    safe = dtype in (torch.float32, torch.bfloat16, torch.float64)
    if safe and not force_sum:
        if factor is None:
            return DividePlan(None, None, AVG, AVG) if dp > 1 else DividePlan(None, None, SUM, SUM)
        if factor == dp:
            return DividePlan(None, None, AVG, AVG)
        return DividePlan(None, factor if factor != 1 else None, SUM, SUM)
    total = float(dp if factor is None else factor)
    if safe:
        return DividePlan(None, total if total != 1 else None, SUM, SUM)
    pre = 1  # the smallest power of two with pre >= total / pre (when it divides)
    while total % pre == 0 and total / pre > pre:
        pre *= 2
    post = total / pre
    return DividePlan(pre if pre != 1 else None, post if post != 1 else None, SUM, SUM)
