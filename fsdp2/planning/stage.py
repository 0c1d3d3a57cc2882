"""A pipeline stage's step for ``fsdp2.estimate_memory(..., microbatches=n)``.

[Note: pipeline stages]
With ``microbatches=n`` the model is one pipeline stage and its step is a schedule's: ``n``
forwards of the given micro-batch and their backwards in one-forward-one-backward order
with ``in_flight`` micro-batches' activations alive at the most (GPipe keeps all ``n``;
1F1B keeps ``pp - s`` on stage ``s``, the most on the first), each backward without
gradient sync and resharding but the last (the parameters of groups that do not reshard
after forward stay gathered across micro-batches, their gradients accumulate unsharded),
then ``finalize_backward``: what the schedules do to fsdp2 stages. The activations that
cross to the neighbouring stages (torch's send and receive buffers) are not simulated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from fsdp2._core.front.sharding import FSDPModule
from fsdp2.planning.tracker import Tracker

__all__ = ["stage_step"]


def _schedule(microbatches: int, in_flight: int) -> list[tuple[str, int]]:
    """A pipeline stage's forwards and backwards, one-forward-one-backward: ``in_flight``
    forwards first (GPipe: all of them), then a backward for every further forward."""
    order = [("F", i) for i in range(min(in_flight, microbatches))]
    b = 0
    for i in range(len(order), microbatches):
        order += [("F", i), ("B", b)]
        b += 1
    return order + [("B", i) for i in range(b, microbatches)]


def stage_step(
    model: nn.Module,
    batch: Callable[[], Any],
    step_fn: Callable[[nn.Module, Any], torch.Tensor],
    microbatches: int,
    in_flight: int,
    tracker: Tracker,
) -> None:
    """One pipeline schedule step of a stage, as ``fsdp2.integrations.pipelining`` drives
    it: every micro-batch's backward without gradient sync or resharding but the last's,
    then ``finalize_backward``. See [Note: pipeline stages]."""
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    losses: dict[int, torch.Tensor] = {}
    for kind, i in _schedule(microbatches, in_flight):
        if kind == "F":
            tracker.phase = "forward"
            loss = step_fn(model, batch())
            if not isinstance(loss, torch.Tensor):
                raise TypeError(
                    f"estimate_memory: step_fn returned a {type(loss).__name__}, not the "
                    "loss tensor to call backward() on"
                )
            losses[i] = loss
            continue
        last = i == microbatches - 1
        for m in fsdp:
            m.set_requires_gradient_sync(last, recurse=False)
            m.set_reshard_after_backward(last, recurse=False)
        tracker.phase = tracker.where = "backward"
        losses.pop(i).backward()
    for m in fsdp:
        m.set_requires_gradient_sync(True, recurse=False)
        m.set_reshard_after_backward(True, recurse=False)
    if isinstance(model, FSDPModule):
        model.finalize_backward()
