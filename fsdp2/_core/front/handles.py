"""The handles of ``FSDPModule``'s asynchronous calls: ``unshard(async_op=True)``'s
``UnshardHandle`` and ``finalize_backward(async_op=True)``'s ``GradientReductionHandle``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsdp2._core.runtime.state import FSDPState


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``."""

    def __init__(self, state: FSDPState | None = None) -> None:
        self._state = state

    def wait(self) -> None:
        """Wait for the all-gather; afterwards the unsharded parameters are
        registered on the module and usable. Idempotent. A pending unshard is
        also waited by the module's next forward, so calling this is optional."""
        state, self._state = self._state, None
        for g in state.groups if state is not None else ():
            g.wait_if_pending()


class GradientReductionHandle:
    """Returned by ``FSDPModule.finalize_backward(async_op=True)``: the step's last gradient
    reductions are issued, not yet finished. torch main's API (pytorch PR 196724)."""

    def __init__(self, complete: Callable[[], None] | None = None) -> None:
        self._complete = complete

    def wait(self) -> None:
        """Wait for the reductions; afterwards the gradients are on the sharded parameters
        and the modules resharded per ``set_reshard_after_backward``, as after
        ``finalize_backward()``. Idempotent. Until it is called the step is open: the next
        forward, ``unshard()``, ``zero_grad()``, ``reset_iter_state()`` and another
        ``finalize_backward()`` raise, and the optimizer must not step."""
        complete, self._complete = self._complete, None
        if complete is not None:
            complete()
