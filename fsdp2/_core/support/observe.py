"""The one way to watch the engine: observers subscribed to ``HUB`` are told what it does.

# [Note: observation]
# Tools that follow the engine (``fsdp2.estimate_memory``'s tracker, ``fsdp2.timeline``,
# the debug mode's cross-rank checks, the tests' communication counter) subscribe an
# ``Observer`` instead of reaching into the engine's objects or patching its functions:
#
# - ``enter(kind, what)`` / ``exit(kind)``: the engine's regions, the same ones the profiler
#   labels show (``labels.py``): "copy_in", "all_gather issue", "all_gather wait",
#   "copy_out", "reshard", "reduce_scatter pack/issue/wait", "all_reduce issue/wait", and
#   the hooks ("hook pre_forward", "hook post_forward", "hook pre_backward", "hook
#   post_backward", "hook final_callback"); ``what`` names the group (its module path).
# - ``collective(c)``: a collective is about to be issued (``Collective``: its kind, the
#   groups it serves, elements, dtype, process group and how it is carried). An observer
#   may raise to stop it (the debug mode does when ranks disagree), before any rank
#   blocks.
#   Its wait is the region "<kind> wait" (entered and exited).
# - ``resized(t, owner)``: the engine gave ``t``'s storage its bytes back or freed it
#   (unsharded parameters; resizing is not an operator a dispatch mode sees).
# - ``gradients_taken(grads)``: a group's unsharded gradients were taken for reduction.
# - ``step_phase(name, new_step)``: a step boundary ("forward", "backward", "final callback of
#   the backward", "time between steps").
#
# With nobody subscribed each call site costs one attribute read (``HUB.observers`` is an
# empty tuple). Observers run on the training thread, in subscription order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["HUB", "Collective", "Hub", "Observer"]


@dataclass(frozen=True)
class Collective:
    """A collective the engine is about to issue."""

    kind: str  # "all-gather", "reduce-scatter" or "all-reduce"
    what: str  # the groups it serves (module paths), or what the copy is for
    numel: int  # elements of the whole: an all-gather's output, a reduce-scatter's input
    input_numel: int  # elements this rank sends in (all ranks send as many)
    dtype: torch.dtype
    group: dist.ProcessGroup
    group_size: int
    transport: str  # "all_gather_single", "exchange" (gloo sends/receives), "custom", ...
    op: Any = None  # the reduction's ``ReduceOp`` (reduce-scatter, all-reduce)


class Observer:
    """Base class of observers: every method does nothing; override what you need."""

    def enter(self, kind: str, what: str) -> None:
        pass

    def exit(self, kind: str) -> None:
        pass

    def collective(self, c: Collective) -> None:
        pass

    def resized(self, t: torch.Tensor, owner: str) -> None:
        pass

    def gradients_taken(self, grads: list[torch.Tensor]) -> None:
        pass

    def step_phase(self, name: str, new_step: bool) -> None:
        pass


class Hub:
    """The subscribed observers; the engine calls ``HUB``'s methods only when
    ``HUB.observers`` is not empty."""

    def __init__(self) -> None:
        self.observers: tuple[Observer, ...] = ()

    def subscribe(self, observer: Observer) -> Callable[[], None]:
        """Subscribe ``observer``; returns the function that unsubscribes it."""
        self.observers = (*self.observers, observer)

        def unsubscribe() -> None:
            self.observers = tuple(o for o in self.observers if o is not observer)

        return unsubscribe

    @contextmanager
    def observing(self, observer: Observer) -> Iterator[Observer]:
        """Subscribe ``observer`` for the ``with`` block."""
        unsubscribe = self.subscribe(observer)
        try:
            yield observer
        finally:
            unsubscribe()

    def enter(self, kind: str, what: str) -> None:
        for o in self.observers:
            o.enter(kind, what)

    def exit(self, kind: str) -> None:
        for o in reversed(self.observers):
            o.exit(kind)

    def collective(self, c: Collective) -> None:
        for o in self.observers:
            o.collective(c)

    def resized(self, t: torch.Tensor, owner: str) -> None:
        for o in self.observers:
            o.resized(t, owner)

    def gradients_taken(self, grads: list[torch.Tensor]) -> None:
        for o in self.observers:
            o.gradients_taken(grads)

    def step_phase(self, name: str, new_step: bool = False) -> None:
        for o in self.observers:
            o.step_phase(name, new_step)


HUB = Hub()
