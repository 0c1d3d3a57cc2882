"""A group's gradients: from the unsharded parameters' ``.grad`` to the sharded ones'.

``reduce_grads(group)`` packs the unsharded gradients rank-major (see [Note: flat
storage] in _param.py), issues ONE reduce-scatter and returns a ``Reduction``: the state
layer queues it and advances it stage by stage (reduce-scatter, then for HSDP the
all-reduce, then landing), so the group never waits on its own reduction and never
calls up into the state layer.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from . import _collectives as C
from ._param import FSDPParam

if TYPE_CHECKING:
    from ._param_group import ParamGroup


class ReduceStage(enum.Enum):
    """Where a ``Reduction`` is: waiting for its reduce-scatter or its all-reduce."""

    REDUCE_SCATTER = "reduce-scatter"
    ALL_REDUCE = "all-reduce"
    DONE = "done"


class Reduction:
    """One group's gradient reduction in flight: reduce-scatter, then (HSDP)
    all-reduce, then the gradients land on the sharded parameters."""

    __slots__ = ("group", "params", "pending", "plan", "stage", "host_copy")

    def __init__(
        self, group: ParamGroup, params: list[FSDPParam], pending: C.Pending, plan: C.DividePlan
    ) -> None:
        self.group = group
        self.params = params
        self.pending = pending
        self.plan = plan
        self.stage = ReduceStage.REDUCE_SCATTER
        self.host_copy = False  # gradients copied to pinned host memory asynchronously

    def advance(self) -> bool:
        """Wait for the current stage and start the next; True once finished."""
        assert self.stage is not ReduceStage.DONE, "advancing a finished reduction"
        g = self.group
        output = self.pending.wait()
        replicate = g.info.replicate_group
        if self.stage is ReduceStage.REDUCE_SCATTER and replicate is not None:
            if not g.reduce.all_reduce:
                # HSDP accumulation: keep the shard-reduced sum, all-reduce it later.
                g.partial_reduce = (
                    output if g.partial_reduce is None else g.partial_reduce.add_(output)
                )
                self.stage = ReduceStage.DONE
                return True
            if g.partial_reduce is not None:
                output.add_(g.partial_reduce)
                g.partial_reduce = None
            self.stage = ReduceStage.ALL_REDUCE
            self.pending = C.all_reduce(output, replicate, self.plan.ar_op)
            return False
        if g.reduce.hook is not None:
            g.reduce.hook(output)
        if self.plan.post is not None:
            output.div_(self.plan.post)
        self.host_copy = land_grads(g, self.params, output)
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


def reduce_grads(group: ParamGroup) -> Reduction | None:
    """Issue the reduce-scatter of the gradients computed so far (``None`` if there are
    none); the caller advances the returned reduction."""
    params, grads = _take_grads(group)
    if not params:
        return None
    dtype = group.reduce_dtype or group.param_dtype
    comm = group.reduce.comm
    packed = C.pack_for_reduce_scatter(grads, group.world, dtype, comm)
    del grads
    plan = group.divide_plan
    if plan.pre is not None:
        packed.div_(plan.pre)
    pg = group.reduce.group or group.info.shard_group
    pending = C.reduce_scatter(packed, pg, plan.rs_op, comm)
    return Reduction(group, params, pending, plan)


def land_grads(group: ParamGroup, params: list[FSDPParam], output: torch.Tensor) -> bool:
    """Turn a rank's reduce-scatter output into the sharded params' ``.grad``
    (views of ``output``), accumulating into existing gradients. Returns whether the
    gradients were copied to pinned host memory asynchronously (CPU offload): the
    caller synchronizes before anyone reads them."""
    flat = group.sharded_flat
    host_copy = False
    if output.device != flat.device:  # CPU offload: device-to-host
        host = torch.empty(output.shape, dtype=group.orig_dtype, pin_memory=flat.is_pinned())
        host.copy_(output, non_blocking=flat.is_pinned())
        output = host
        host_copy = flat.is_pinned()
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
