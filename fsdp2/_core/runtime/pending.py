"""Gradients that no reduction has finished yet, seen and reduced on request (torch main's
``get_pending_gradients`` / ``synchronize_gradients``).

A group's pending gradients are the no-sync sums (``set_requires_gradient_sync(False)``:
the unsharded gradients of the backwards so far) and, for HSDP with
``set_requires_all_reduce(False)``, the shard-reduced sums still to be all-reduced over the
replicas (``GradState.partial``). ``pending_gradients`` shows them without communicating;
``synchronize`` reduces them as the next synced backward would, without one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from fsdp2._core.runtime.reduce import (
    bank_grads,
    has_unreduced_grads,
    reduce,
    slices_by_param,
    take_grads,
)
from fsdp2._core.runtime.step import StepContext, StepPhase

if TYPE_CHECKING:
    from fsdp2._core.params.group import ParamGroup
    from fsdp2._core.runtime.reduce import GradState
    from fsdp2._core.runtime.slot import Slot

Pending = dict[torch.nn.Parameter, tuple[torch.Tensor | None, torch.Tensor | None]]


def _pairs(slots: list[Slot]) -> list[tuple[ParamGroup, GradState]]:
    return [(g, st.grads[i]) for st in slots for i, g in enumerate(st.groups)]


def _check_idle(ctx: StepContext | None, call: str) -> None:
    if ctx is None:
        return
    if ctx.phase is not StepPhase.IDLE:
        raise RuntimeError(
            f"fsdp2: {call} called during a forward or backward; call it after the backward"
        )
    ctx.awaiting_refusal(call)


def pending_gradients(ctx: StepContext | None, slots: list[Slot]) -> Pending:
    """``{sharded parameter: (unreduced, partial)}`` of the parameters with a pending
    contribution; the tensors are the buffers the next reduction reads (see
    ``FSDPModule.get_pending_gradients``). No collective."""
    _check_idle(ctx, "get_pending_gradients()")
    out: Pending = {}
    for g, state in _pairs(slots):
        if state.trees:
            raise RuntimeError(
                f"fsdp2: get_pending_gradients() on {g.path}: under the deterministic "
                "reduction (fsdp2.reduction.set_deterministic) each micro-batch's gradient is "
                "kept apart until the reduction sums them in a fixed tree, so there is no one "
                "pending tensor; call synchronize_gradients() to reduce them"
            )
        # the gradients of the backwards since the last bank join the no-sync sum, so one
        # tensor per parameter holds its whole pending sum (the same object from now on)
        bank_grads(g, state, None)
        unreduced = {id(p): state.acc[id(p)] for p in g.grad_params if id(p) in state.acc}
        partial = {}
        if state.partial is not None:
            partial = {id(p): t for p, t in slices_by_param(state.partial, state.partial_params)}
        for p in g.grad_params:
            u, s = unreduced.get(id(p)), partial.get(id(p))
            if u is not None or s is not None:
                out[cast(torch.nn.Parameter, p.sharded)] = (u, s)  # a DTensor Parameter
    return out


def synchronize(ctx: StepContext | None, slots: list[Slot]) -> None:
    """Reduce every pending gradient of ``slots``' groups into the sharded ``.grad`` now, with
    gradient sync and (HSDP) the all-reduce on for these reductions only. Collective."""
    _check_idle(ctx, "synchronize_gradients()")
    if ctx is None:
        return  # no forward yet: nothing pending
    forced = []
    for g, state in _pairs(slots):
        if not (has_unreduced_grads(g, state) or state.partial is not None):
            continue
        forced.append((g, g.reduce))
        g.update(reduce={"sync": True, "all_reduce": True})
        part = take_grads(g, state)
        if part is not None:
            ctx.add_reduction(reduce([part]))
    try:
        ctx.drain_reductions()
        if ctx.pending_d2h:  # offloaded gradients copied asynchronously into pinned memory
            torch.accelerator.synchronize()
            ctx.pending_d2h = False
    finally:
        for g, settings in forced:
            g.update(reduce={"sync": settings.sync, "all_reduce": settings.all_reduce})
    for g, _ in forced:
        g.drained()
