"""A group's gradients: from the unsharded parameters' ``.grad`` to the sharded ones'.

``take_grads(group)`` takes a group's unsharded gradients as a ``Part``; ``reduce(parts)``
packs one or several groups' parts rank-major (see [Note: flat storage] in param.py),
issues ONE reduce-scatter and returns a ``Reduction``: the state layer queues it and
advances it stage by stage (reduce-scatter, then for HSDP the all-reduce, then landing),
so a group never waits on its own reduction and never calls up into the state layer.
Several parts share a reduce-scatter when their groups are bucketed
(``FSDPModule.set_bucket_bytes``, see [Note: buckets] in step.py).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from fsdp2._core import collectives as C
from fsdp2._core import debug as D
from fsdp2._core.labels import label
from fsdp2._core.param import FSDPParam

if TYPE_CHECKING:
    from fsdp2._core.group import ParamGroup


class ReduceStage(enum.Enum):
    """Where a ``Reduction`` is: waiting for its reduce-scatter or its all-reduce."""

    REDUCE_SCATTER = "reduce-scatter"
    ALL_REDUCE = "all-reduce"
    DONE = "done"


class Part(NamedTuple):
    """One group's share of a reduction: its parameters with gradients, those gradients
    (unsharded, not packed yet) and where its rank's slice starts in the reduced output."""

    group: ParamGroup
    params: list[FSDPParam]
    grads: list[torch.Tensor]
    numel: int  # elements per rank
    nbytes: int  # of the packed reduce-scatter input (every rank's rows)


class Reduction:
    """One reduce-scatter in flight (of one group's gradients, or of a bucket of groups'),
    then (HSDP) its all-reduce, then the gradients land on the sharded parameters."""

    __slots__ = ("group", "parts", "starts", "pending", "plan", "stage", "host_copy")

    def __init__(self, parts: list[Part], pending: C.Pending, plan: C.DividePlan) -> None:
        self.group = parts[0].group  # settings common to the bucket (see bucket_key)
        self.parts = parts
        self.starts = list(itertools.accumulate((p.numel for p in parts[:-1]), initial=0))
        self.pending = pending
        self.plan = plan
        self.stage = ReduceStage.REDUCE_SCATTER
        self.host_copy = False  # gradients copied to pinned host memory asynchronously

    def _slices(self, output: torch.Tensor) -> Iterator[tuple[Part, torch.Tensor]]:
        for part, start in zip(self.parts, self.starts, strict=True):
            yield part, output.narrow(0, start, part.numel)

    def advance(self) -> bool:
        """Wait for the current stage and start the next; True once finished."""
        assert self.stage is not ReduceStage.DONE, "advancing a finished reduction"
        g = self.group
        scatter = self.stage is ReduceStage.REDUCE_SCATTER
        kind = "reduce_scatter wait" if scatter else "all_reduce wait"
        with label(kind, lambda: _paths(self.parts)):
            output = self.pending.wait()
        replicate = g.info.replicate_group
        if self.stage is ReduceStage.REDUCE_SCATTER and replicate is not None:
            if not g.reduce.all_reduce:  # never bucketed (see bucket_key)
                # HSDP accumulation: keep the shard-reduced sum, all-reduce it later.
                g.partial_reduce = (
                    output if g.partial_reduce is None else g.partial_reduce.add_(output)
                )
                self.stage = ReduceStage.DONE
                return True
            for part, out in self._slices(output):
                if part.group.partial_reduce is not None:
                    out.add_(part.group.partial_reduce)
                    part.group.partial_reduce = None
            self.stage = ReduceStage.ALL_REDUCE
            if D.is_debug():
                D.check("all-reduce", _paths(self.parts), output.numel(), output.dtype, replicate)
            with label("all_reduce issue", lambda: _paths(self.parts)):
                self.pending = C.all_reduce(output, replicate, self.plan.ar_op)
            return False
        for part, out in self._slices(output):
            if part.group.reduce.hook is not None:
                part.group.reduce.hook(out)
            if self.plan.post is not None:
                out.div_(self.plan.post)
            self.host_copy |= land_grads(part.group, part.params, out)
        self.stage = ReduceStage.DONE
        return True


def has_unreduced_grads(group: ParamGroup) -> bool:
    return bool(group.acc_grads) or any(
        p.unsharded is not None and p.unsharded.grad is not None for p in group.grad_params
    )


def accumulate_in_reduce_dtype(group: ParamGroup) -> None:
    """Without gradient sync, keep the running sum in ``reduce_dtype`` (so
    low-precision compute does not accumulate in low precision)."""
    acc = group.acc_grads
    for p in group.grad_params:
        u = p.unsharded
        g = None if u is None else u.grad
        if u is None or g is None:
            continue
        u.grad = None
        prev = acc.get(id(p))
        acc[id(p)] = g.to(group.reduce_dtype) if prev is None else prev.add_(g)


def _take_grads(group: ParamGroup) -> tuple[list[FSDPParam], list[torch.Tensor]]:
    params, grads = [], []
    acc = group.acc_grads
    for p in group.grad_params:
        u = p.unsharded
        g = None if u is None else u.grad
        if acc:
            prev = acc.pop(id(p), None)
            if prev is not None:
                g = prev if g is None else prev.add_(g)
        if g is None:
            if not group.reduce.reduce_unused:
                continue
            g = torch.zeros(p.shape, dtype=group.param_dtype, device=group.device)
        elif u is not None:
            u.grad = None
        params.append(p)
        if p.tp is not None:
            g = p.tp.to_local_grad(g)
        if p.is_scalar:
            g = g.expand(group.world)
        elif p.shard_dim != 0:
            g = p.split_view(g).reshape(group.world, -1)
        grads.append(g)
    return params, grads


def take_grads(group: ParamGroup) -> Part | None:
    """Take the gradients computed so far off the unsharded parameters (``None`` if there
    are none), ready for ``reduce`` alone or in a bucket with other groups'."""
    params, grads = _take_grads(group)
    if not params:
        return None
    w = group.world
    numel = sum(-(-g.size(0) // w) * (g.numel() // max(g.size(0), 1)) for g in grads)
    dtype = group.reduce_dtype or group.param_dtype
    return Part(group, params, grads, numel, w * numel * dtype.itemsize)


def bucket_key(group: ParamGroup) -> tuple[Any, ...] | None:
    """Groups with equal keys may share one reduce-scatter (``None``: never bucketed)."""
    r = group.reduce
    if r.bucket_bytes is None or r.comm is not None:
        return None
    if group.info.replicate_group is not None and not r.all_reduce:
        return None  # HSDP partial sums are kept per group
    pg = r.group or group.info.shard_group
    dtype = group.reduce_dtype or group.param_dtype
    return (pg, group.info.replicate_group, group.world, dtype, group.device, group.divide_plan)


def _paths(parts: list[Part]) -> str:
    return ", ".join(part.group.path for part in parts)


def reduce(parts: list[Part]) -> Reduction:
    """Issue ONE reduce-scatter of the parts' gradients (groups of equal ``bucket_key``
    when more than one): packed rank-major, each rank's row is its slice of every part
    in turn (on 2 gloo ranks, large gradients are sent straight instead: [Note: gloo
    straight in and out] in collectives.py)."""
    group = parts[0].group
    dtype = group.reduce_dtype or group.param_dtype
    comm = group.reduce.comm
    plan = group.divide_plan
    pg = group.reduce.group or group.info.shard_group
    if D.is_debug():
        numel = group.world * sum(part.numel for part in parts)
        D.check("reduce-scatter", _paths(parts), numel, dtype, pg)
    grads = [g for part in parts for g in part.grads]
    parts = [part._replace(grads=[]) for part in parts]  # packed or sent: free them as we go
    pending = None
    if (
        comm is None
        and plan.pre is None
        and C.sends_grads_straight(pg, group.world, group.device, plan.rs_op)
        and C.sends_any_straight(grads, dtype)
    ):
        with label("reduce_scatter issue", lambda: _paths(parts)):
            pending = C.reduce_scatter_grads(grads, dtype, plan.rs_op, pg)
    if pending is None:
        with label("reduce_scatter pack", lambda: _paths(parts)):
            packed = C.pack_for_reduce_scatter(grads, group.world, dtype, comm)
            del grads
            if plan.pre is not None:
                packed.div_(plan.pre)
        with label("reduce_scatter issue", lambda: _paths(parts)):
            pending = C.reduce_scatter(packed, pg, plan.rs_op, comm)
    return Reduction(parts, pending, plan)


def land_grads(group: ParamGroup, params: list[FSDPParam], output: torch.Tensor) -> bool:
    """Turn a rank's reduce-scatter output into the sharded params' ``.grad``
    (views of ``output``), accumulating into existing gradients. Returns whether the
    gradients were copied to pinned host memory asynchronously (CPU offload): the
    caller synchronizes before anyone reads them."""
    flat = group.sharded_flat
    host_copy = False
    if output.device != flat.device:  # CPU offload: device-to-host
        # Asynchronous only when nothing reads the copy here: accumulating into existing
        # gradients adds on the host at once, so it waits for the copy first.
        accumulate = any(p.sharded.grad is not None for p in params)
        host_copy = flat.is_pinned() and not accumulate
        host = torch.empty(output.shape, dtype=group.orig_dtype, pin_memory=flat.is_pinned())
        host.copy_(output, non_blocking=host_copy)
        output = host
    elif output.dtype != group.orig_dtype:
        output = output.to(group.orig_dtype)
    offset = output.storage_offset()
    acc_dst, acc_src = [], []
    for p in params:
        local = output.as_strided(p.local_shape, p.local_stride, offset)
        offset += p.padded_numel
        sp = p.sharded
        g = sp.grad
        if g is None:
            sp.grad = p.grad_dtensor(local)
        else:
            assert isinstance(g, DTensor)
            acc_dst.append(g._local_tensor)
            acc_src.append(local)
    if acc_dst:
        torch._foreach_add_(acc_dst, acc_src)
    return host_copy
