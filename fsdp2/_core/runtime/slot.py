"""One ``fully_shard`` call's place in its root's step (``Slot``) and where that call is
in the step (``TrainingState``, with the legal moves between states). The state layer
(state.py) owns one slot per call; the step layer (step.py) moves it through the step.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

from fsdp2._core.runtime.reduce import GradState

if TYPE_CHECKING:
    from fsdp2._core.params.group import ParamGroup

__all__ = ["LEGAL_MOVES", "Slot", "TrainingState"]


class TrainingState(enum.Enum):
    """Where one ``fully_shard`` state is in the step."""

    IDLE = "idle"
    FORWARD = "forward"  # between its pre- and post-forward
    PRE_BACKWARD = "pre-backward"  # its gradients are being computed (gathered for it)
    POST_BACKWARD = "post-backward"  # its gradients were handed to reduction this step


_T = TrainingState
LEGAL_MOVES: dict[TrainingState, frozenset[TrainingState]] = {
    _T.IDLE: frozenset({_T.FORWARD, _T.PRE_BACKWARD, _T.POST_BACKWARD}),
    # a call whose backward starts before the root's forward ends: fully_shard([a, b])
    # with only ``a`` run, or outputs used inside the forward
    _T.FORWARD: frozenset({_T.IDLE, _T.FORWARD, _T.PRE_BACKWARD, _T.POST_BACKWARD}),
    # a module used several times: gathered again after an earlier call's reduction
    _T.PRE_BACKWARD: frozenset({_T.PRE_BACKWARD, _T.POST_BACKWARD, _T.IDLE}),
    _T.POST_BACKWARD: frozenset({_T.PRE_BACKWARD, _T.POST_BACKWARD, _T.IDLE}),
}


class Slot:
    """One ``fully_shard`` call's place in its root's step: all the step layer reads or
    writes of it. The state layer (``FSDPState``) owns one and moves it through the step
    with ``StepContext``'s methods."""

    __slots__ = (
        "groups",
        "name",
        "training_state",
        "fwd_next",
        "bwd_next",
        "post_backward_pending",
        "untracked_calls",
        "on_backward_end",
        "grads",
    )

    def __init__(self, groups: list[ParamGroup], name: str) -> None:
        # one group per process group of its fully_shard call (several with per-parameter
        # meshes, see [Note: several groups]); none for a call that manages no parameter
        self.groups = groups
        self.name = name  # for messages
        self.training_state = TrainingState.IDLE
        # implicit prefetch: the slot that ran next in the last forward / comes next in
        # backward (from the last post-forward order)
        self.fwd_next: list[Slot] = []
        self.bwd_next: list[Slot] = []
        self.post_backward_pending = 0  # registered post-backward nodes still to fire
        self.untracked_calls = 0  # forward calls whose inputs needed no grad (no node)
        self.on_backward_end: list[Callable[[], None]] = []  # see seam.on_backward_end
        self.grads = [GradState() for _ in groups]  # one per group

    def to(self, new: TrainingState, event: str) -> None:
        old = self.training_state
        if new not in LEGAL_MOVES[old]:
            raise RuntimeError(
                f"fsdp2: {event} of fully_shard({self.name}) while it is in {old.value}; "
                "this order of hooks is not supported (please report it, with how the "
                "model is called)"
            )
        self.training_state = new

    def end_step(self) -> None:
        self.training_state = TrainingState.IDLE
        self.post_backward_pending = 0
        self.untracked_calls = 0
