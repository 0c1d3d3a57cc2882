"""A group's gradients: from the unsharded parameters' ``.grad`` to the sharded ones'.

Above the group: ``take_grads(group, grads)`` takes a group's unsharded gradients as a
``Part``; ``reduce(parts)`` issues ONE reduce-scatter of one or several groups' parts
(``collectives.reduce_scatter`` packs them rank-major, see [Note: flat storage] in
param.py) and returns a ``Reduction``: the step layer queues it and advances it stage by
stage (reduce-scatter, then for HSDP the all-reduce, then landing). Several parts share a
reduce-scatter when their groups are bucketed (``FSDPModule.set_bucket_bytes``, see [Note:
buckets] in step.py). What outlives a backward (no-sync sums, HSDP partial sums) is a
``GradState``, changed here only; the step layer keeps one per group.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from fsdp2._core.comm.collectives import DividePlan, all_reduce, reduce_scatter
from fsdp2._core.comm.exact import TreeSum, is_power_of_two
from fsdp2._core.comm.transport import Pending, pack_for_reduce_scatter
from fsdp2._core.params.dtypes import landing_dtypes, unsharded_grad_dtype
from fsdp2._core.params.param import FSDPParam, land_local_grads
from fsdp2._core.replicas.piece_grad import land_pieces
from fsdp2._core.replicas.pieces import piece_views
from fsdp2._core.support.labels import label

if TYPE_CHECKING:
    from fsdp2._core.params.group import ParamGroup

__all__ = [
    "GradState",
    "Part",
    "ReduceStage",
    "Reduction",
    "bucket_key",
    "push_exact",
    "reduce",
    "reduce_dtype_of",
    "take_grads",
]


class GradState:
    """A group's gradients that outlive a backward."""

    __slots__ = ("acc", "partial", "partial_params", "trees", "leaves")

    def __init__(self) -> None:
        self.acc: dict[int, torch.Tensor] = {}  # no-sync sums in reduce_dtype, by id(param)
        self.partial: torch.Tensor | None = None  # HSDP without all-reduce: the shard-reduced sum
        self.partial_params: list[FSDPParam] = []  # whose slices ``partial`` holds, in order
        # exact reduction: each parameter's micro-batch gradients as a canonical tree, and
        # how many micro-batches (backwards that gave the group gradients) it holds
        self.trees: dict[int, TreeSum] = {}
        self.leaves = 0

    def zero(self, set_to_none: bool) -> None:
        """``zero_grad``: drop the pending sums, or zero them in place."""
        if set_to_none or self.trees:
            self.clear()
            return
        for t in self.acc.values():
            t.zero_()
        if self.partial is not None:
            self.partial.zero_()

    def clear(self) -> None:
        self.acc.clear()
        self.partial = None
        self.partial_params = []
        self.trees.clear()
        self.leaves = 0


class ReduceStage(enum.Enum):
    """Where a ``Reduction`` is: waiting for its reduce-scatter or its all-reduce."""

    REDUCE_SCATTER = "reduce-scatter"
    ALL_REDUCE = "all-reduce"
    REPLICA_SCATTER = "replica reduce-scatter"  # [Note: pieces] in pieces.py
    DONE = "done"


class Part(NamedTuple):
    """One group's share of a reduction: its parameters with gradients, those gradients
    (unsharded, not packed yet) and where its rank's slice starts in the reduced output."""

    group: ParamGroup
    state: GradState
    params: list[FSDPParam]
    grads: list[torch.Tensor]
    numel: int  # elements per rank
    nbytes: int  # of the packed reduce-scatter input (every rank's rows)


class Reduction:
    """One reduce-scatter in flight (of one group's gradients, or of a bucket of groups'),
    then (HSDP) its all-reduce, then the gradients land on the sharded parameters."""

    __slots__ = ("group", "parts", "starts", "pending", "plan", "stage", "host_copy")

    def __init__(self, parts: list[Part], pending: Pending, plan: DividePlan) -> None:
        self.group = parts[0].group  # settings common to the bucket (see bucket_key)
        self.parts = parts
        self.starts = list(itertools.accumulate((p.numel for p in parts[:-1]), initial=0))
        self.pending = pending
        self.plan = plan
        self.stage = ReduceStage.REDUCE_SCATTER
        self.host_copy = False  # gradients copied to pinned host memory asynchronously

    def _what(self) -> str:
        return _paths(self.parts)

    def _replicas_what(self) -> str:
        return "replicas: " + self._what()

    def _slices(self, output: torch.Tensor) -> Iterator[tuple[Part, torch.Tensor]]:
        for part, start in zip(self.parts, self.starts, strict=True):
            yield part, output.narrow(0, start, part.numel)

    def advance(self) -> bool:
        """Wait for the current stage and start the next; True once finished."""
        assert self.stage is not ReduceStage.DONE, "advancing a finished reduction"
        g = self.group
        scatter = self.stage is ReduceStage.REDUCE_SCATTER
        kind = "all_reduce wait" if self.stage is ReduceStage.ALL_REDUCE else "reduce_scatter wait"
        # one shard rank: the "reduce-scatter" ran no collective, so no wait to label
        what = self._what
        if self.stage is ReduceStage.REPLICA_SCATTER:
            what = self._replicas_what
        waiting = nullcontext() if scatter and g.world == 1 else label(kind, what)
        with waiting:
            output = self.pending.wait()
        replicate = g.info.replicate_group
        if self.stage is ReduceStage.REDUCE_SCATTER and replicate is not None:
            if not g.reduce.all_reduce:  # never bucketed (see bucket_key)
                # HSDP accumulation: keep the shard-reduced sum, all-reduce it later.
                part = self.parts[0]
                state = part.state
                if state.partial is not None:  # part.params include its (see _take_grads)
                    add_by_param(output, part.params, state.partial, state.partial_params)
                state.partial, state.partial_params = output, part.params
                self.stage = ReduceStage.DONE
                return True
            for part, out in self._slices(output):
                if part.state.partial is not None:
                    add_by_param(out, part.params, part.state.partial, part.state.partial_params)
                    part.state.partial, part.state.partial_params = None, []
            if g.reduce.replica_shard:
                self._scatter_over_replicas(output, replicate)
                return False
            self.stage = ReduceStage.ALL_REDUCE
            self.pending = all_reduce(
                output, replicate, self._what, op=self.plan.ar_op, comm=g.reduce.comm
            )
            return False
        if self.stage is ReduceStage.REPLICA_SCATTER:
            self._land_pieces(output)
            return True
        for part, out in self._slices(output):
            if part.group.has_scalars:
                _agree_on_scalars(part, out)
            if part.group.reduce.hook is not None:
                part.group.reduce.hook(out)
            if self.plan.post is not None:
                out.div_(self.plan.post)
            elif part.group.reduce.exact:
                out.div_(_exact_divisor(part))
            self.host_copy |= land_grads(part.group, part.params, out)
        self.stage = ReduceStage.DONE
        return True

    def _scatter_over_replicas(self, output: torch.Tensor, replicate: dist.ProcessGroup) -> None:
        """[Note: pieces]: reduce-scatter each parameter's reduced local gradient over the
        replicas (instead of all-reducing the shard); each rank keeps its piece."""
        g = self.group
        views = []
        for part, out in self._slices(output):
            if part.group.has_scalars:
                _agree_on_scalars(part, out)
            views += piece_views(part.params, out)
        self.stage = ReduceStage.REPLICA_SCATTER
        replicas = g.info.replicate_size
        with label("reduce_scatter pack", self._replicas_what):
            packed = pack_for_reduce_scatter(views, replicas, output.dtype, g.reduce.comm)
        del views
        self.pending = reduce_scatter(
            [packed],
            g.info.replicate_size,
            output.dtype,
            replicate,
            self._replicas_what,
            op=self.plan.ar_op,
            comm=g.reduce.comm,
        )

    def _land_pieces(self, output: torch.Tensor) -> None:
        offset = 0
        for part in self.parts:
            n = sum(-(-p.local_numel // part.group.info.replicate_size) for p in part.params)
            out = output.narrow(0, offset, n)
            offset += n
            if part.group.reduce.hook is not None:
                part.group.reduce.hook(out)
            if self.plan.post is not None:
                out.div_(self.plan.post)
            land_pieces(part.group, part.params, out)
        self.stage = ReduceStage.DONE


def add_by_param(
    dst: torch.Tensor, dst_params: list[FSDPParam], src: torch.Tensor, src_params: list[FSDPParam]
) -> None:
    """Add ``src`` (a rank's reduced slices of ``src_params``, one after another) into
    ``dst`` (of ``dst_params``, which include them): at once when the layouts agree."""
    if dst_params == src_params:
        dst.add_(src)
        return
    where: dict[int, int] = {}
    offset = 0
    for p in dst_params:
        where[id(p)] = offset
        offset += p.padded_numel
    offset = 0
    for p in src_params:
        n = p.padded_numel
        dst.narrow(0, where[id(p)], n).add_(src.narrow(0, offset, n))
        offset += n


def slices_by_param(
    flat: torch.Tensor, params: list[FSDPParam]
) -> Iterator[tuple[FSDPParam, torch.Tensor]]:
    """Each parameter's local shard in a rank's reduced output of ``params`` (views)."""
    offset = flat.storage_offset()
    for p in params:
        yield p, flat.as_strided(p.local_shape, p.local_stride, offset)
        offset += p.padded_numel


def _exact_divisor(part: Part) -> float:
    """Exact reduction divides the sum once: by the divide factor if set, else by the
    data-parallel ranks, as the default reduction averages (so the usual loop, each
    micro-batch's loss divided by the accumulation steps, gives the default's gradient). The
    ranks are a power of two, so the division is exact (docs/reproducibility.md)."""
    g = part.group
    if g.reduce.divide_factor is not None:
        return g.reduce.divide_factor
    return float(g.world * g.info.replicate_size)


def push_exact(group: ParamGroup, state: GradState) -> None:
    """Exact reduction: move this backward's unsharded gradients (fp32) into the trees of
    ``state`` as one micro-batch's leaves; nothing if the backward gave the group none."""
    grads = [None if p.unsharded is None else p.unsharded.grad for p in group.grad_params]
    if all(g is None for g in grads):
        return
    for p, g in zip(group.grad_params, grads, strict=True):
        if g is not None:
            assert p.unsharded is not None
            p.unsharded.grad = None
            g = g if g.dtype == torch.float32 else g.float()
        state.trees.setdefault(id(p), TreeSum()).push(g)
    state.leaves += 1


def has_unreduced_grads(group: ParamGroup, state: GradState) -> bool:
    return (
        bool(state.acc)
        or bool(state.trees)
        or any(p.unsharded is not None and p.unsharded.grad is not None for p in group.grad_params)
    )


def bank_grads(group: ParamGroup, state: GradState, divide_by: float | None) -> None:
    """Move the unsharded gradients computed since the last bank, divided by
    ``divide_by`` (if given), into the no-sync sums of ``state`` (in ``reduce_dtype`` if
    set): a later backward adds to fresh ``.grad``, so only this share is divided."""
    acc = state.acc
    dtype = group.reduce_dtype
    for p in group.grad_params:
        u = p.unsharded
        g = None if u is None else u.grad
        if u is None or g is None:
            continue
        u.grad = None
        prev = acc.get(id(p))
        if prev is not None and divide_by is None:
            prev.add_(g)  # in the sum's dtype (an exact widening), no copy
            continue
        g = g if dtype is None else g.to(dtype)
        if divide_by is not None:
            g.div_(divide_by)
        acc[id(p)] = g if prev is None else prev.add_(g)


def accumulate_in_reduce_dtype(group: ParamGroup, state: GradState) -> None:
    """Without gradient sync, keep the running sum in ``reduce_dtype`` (so
    low-precision compute does not accumulate in low precision)."""
    bank_grads(group, state, None)


def _take_grads(group: ParamGroup, state: GradState) -> tuple[list[FSDPParam], list[torch.Tensor]]:
    params, grads = [], []
    acc = state.acc
    held = state.partial_params
    exact = group.reduce.exact
    if exact:
        push_exact(group, state)  # a gradient still on a parameter: the last micro-batch
        _check_leaves(group, state.leaves)
    for p in group.grad_params:
        u = p.unsharded
        g = None if u is None else u.grad
        if exact:
            tree = state.trees.pop(id(p), None)
            g = None if tree is None else tree.fold()
        elif acc:
            prev = acc.pop(id(p), None)
            if prev is not None:
                g = prev if g is None else prev.add_(g)
        if g is None:
            # an HSDP partial sum's parameter keeps its slice: zeros, like an unused one
            if (not group.reduce.reduce_unused or not p.requires_grad) and p not in held:
                continue
            dtype = unsharded_grad_dtype(p, group.mp_policy) or reduce_dtype_of(group)
            g = torch.zeros(p.shape, dtype=dtype, device=group.device)
        elif u is not None:
            u.grad = None
        params.append(p)
        if p.tp is not None:
            g = p.tp.to_local_grad(g, group.reduce_dtype)
        if p.is_scalar:
            g = g.expand(group.world)
        elif p.shard_dim != 0:
            g = p.split_view(g).reshape(group.world, -1)
        grads.append(g)
    return params, grads


def take_grads(group: ParamGroup, state: GradState) -> Part | None:
    """Take the gradients computed so far off the unsharded parameters, adding the no-sync
    sums of ``state`` (``None`` if there are none), ready for ``reduce`` alone or in a
    bucket with other groups'."""
    params, grads = _take_grads(group, state)
    state.leaves = 0  # exact reduction: the micro-batches summed, checked by _take_grads
    if not params:
        return None
    w = group.world
    numel = sum(-(-g.size(0) // w) * (g.numel() // max(g.size(0), 1)) for g in grads)
    dtype = reduce_dtype_of(group)
    return Part(group, state, params, grads, numel, w * numel * dtype.itemsize)


def reduce_dtype_of(group: ParamGroup) -> torch.dtype:
    """The dtype gradients are reduced in: fp32 for exact reduction (its sums are fp32's
    from the first micro-batch to the last rank), else ``reduce_dtype`` or the gradients'."""
    if group.reduce.exact:
        return torch.float32
    return group.mp_policy.reduce_dtype or group.grads_dtype or group.param_dtype


def _check_leaves(group: ParamGroup, leaves: int) -> None:
    replicate = group.info.replicate_size  # 1 without a replicate group
    if group.world * replicate > 1 and leaves and not is_power_of_two(leaves):
        raise RuntimeError(
            f"deterministic reduction of {group.path}: {leaves} micro-batches were summed on "
            "this rank since its last reduction; summing in the world-size-invariant order "
            "needs a power of two per rank (1, 2, 4, ...) when there is more than one "
            "data-parallel rank: give each rank 2**j consecutive micro-batches of the global "
            "batch (docs/reproducibility.md)"
        )
    if replicate > 1 and leaves and not is_power_of_two(group.world):
        raise RuntimeError(
            f"deterministic reduction of {group.path}: HSDP with a shard size of "
            f"{group.world}: summing across replicas in the world-size-invariant order needs "
            "a power-of-two shard size (docs/reproducibility.md)"
        )
    ranks = group.world * replicate
    if leaves and group.reduce.divide_factor is None and not is_power_of_two(ranks):
        raise RuntimeError(
            f"deterministic reduction of {group.path}: the summed gradient is divided by the "
            f"{ranks} data-parallel ranks, exact (the same bits at every world size) only for "
            "a power of two: train on 1, 2, 4, ... data-parallel ranks, or divide the loss "
            "yourself and call set_gradient_divide_factor(1.0) (docs/reproducibility.md)"
        )


def bucket_key(group: ParamGroup) -> tuple[Any, ...] | None:
    """Groups with equal keys may share one reduce-scatter (``None``: never bucketed)."""
    r = group.reduce
    if r.bucket_bytes is None or r.comm is not None:
        return None
    if group.info.replicate_group is not None and not r.all_reduce:
        return None  # HSDP partial sums are kept per group
    pg = r.group or group.info.shard_group
    dtype = group.mp_policy.reduce_dtype or group.grads_dtype or group.param_dtype
    # param_dtype too: the packing copy takes gradients of one dtype (bf16 and fp32 gradients
    # both reduced in fp32 go in separate buckets)
    return (
        pg,
        group.info.replicate_group,
        group.world,
        dtype,
        group.param_dtype,
        group.device,
        group.divide_plan,
    )


def _paths(parts: list[Part]) -> str:
    return ", ".join(part.group.path for part in parts)


def reduce(parts: list[Part]) -> Reduction:
    """Issue ONE reduce-scatter of the parts' gradients (groups of equal ``bucket_key``
    when more than one): each rank's row is its slice of every part in turn."""
    group = parts[0].group
    plan = group.divide_plan
    grads = [g for part in parts for g in part.grads]
    for part in parts:
        part.grads.clear()  # packed or sent: reduce_scatter lets them go as it can
    pending = reduce_scatter(
        grads,
        group.world,
        reduce_dtype_of(group),
        group.reduce.group or group.info.shard_group,
        lambda: _paths(parts),
        op=plan.rs_op,
        pre=plan.pre,
        comm=group.reduce.comm,
    )
    return Reduction(parts, pending, plan)


def _agree_on_scalars(part: Part, out: torch.Tensor) -> None:
    """Give every rank shard rank 0's sum of each 0-dim parameter's gradient ([Note:
    scalars] in group.py): each rank's slot summed the copies in its own order, so the
    replicas' gradients could differ by a rounding. An all-reduce in which only rank 0
    contributes (the others add zeros, which is exact) copies its values to every rank."""
    g = part.group
    if g.world == 1:
        return
    pg = g.reduce.group or g.info.shard_group
    index, offset = [], 0
    for p in part.params:
        if p.is_scalar:
            index.append(offset)
        offset += p.padded_numel
    if not index:
        return
    at = torch.tensor(index, device=out.device)
    values = out.index_select(0, at)
    if pg.rank() != 0:
        values.zero_()
    all_reduce(values, pg, lambda: f"0-dim gradients of {g.path}", op=dist.ReduceOp.SUM).wait()
    out.index_copy_(0, at, values)


def land_grads(group: ParamGroup, params: list[FSDPParam], output: torch.Tensor) -> bool:
    """Turn a rank's reduce-scatter output into the sharded params' ``.grad`` (views of
    ``output``, or of one cast of it to their gradient dtype; a cast per parameter when
    their dtypes differ: [Note: gradient dtypes] in dtypes.py), accumulating into existing
    gradients; each parameter's post-accumulate-grad hooks run once its gradient landed
    ([Note: post-accumulate-grad hooks] in param.py). Returns whether the gradients were
    copied to pinned host memory asynchronously (CPU offload): the caller synchronizes
    before anyone reads them."""
    flat, host_copy = group.sharded_flat, False
    dtypes = landing_dtypes(params, output.dtype)
    dtype = dtypes[0] if len(set(dtypes)) == 1 else None  # None: several
    if dtype is not None and output.device != flat.device:  # CPU offload: device-to-host
        # Asynchronous only when nothing reads the copy here: an add into existing gradients
        # or a post-accumulate-grad hook reads it on the host at once, so it waits for it.
        read = any(p.sharded.grad is not None or p.has_grad_hooks for p in params)
        host_copy = flat.is_pinned() and not read
        host = torch.empty(output.shape, dtype=dtype, pin_memory=flat.is_pinned())
        host.copy_(output, non_blocking=host_copy)
        output = host
    elif dtype is not None and output.dtype != dtype:
        output = output.to(dtype)
    locals_ = [t for _, t in slices_by_param(output, params)]
    if dtype is None:  # several gradient dtypes: a cast (and a move) per parameter
        locals_ = [t.to(flat.device, d) for t, d in zip(locals_, dtypes, strict=True)]
    land_local_grads(params, locals_)  # and the hooks: [Note: post-accumulate-grad hooks]
    return host_copy
