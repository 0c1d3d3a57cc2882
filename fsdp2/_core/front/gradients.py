"""``FSDPModule``'s view of the gradients no reduction has finished: torch main's
``get_pending_gradients`` and ``synchronize_gradients`` (``runtime/pending.py`` does the work).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdp2._core.runtime.pending import Pending, pending_gradients, synchronize

if TYPE_CHECKING:
    from fsdp2._core.runtime.slot import Slot
    from fsdp2._core.runtime.state import FSDPState


class PendingGradients:
    """The pending-gradient methods ``FSDPModule`` gains."""

    def _pending_slots(self, recurse: bool) -> tuple[FSDPState, list[Slot]]:
        states: list[FSDPState] = self._fsdp_modules(recurse)  # type: ignore[attr-defined]
        return states[0], [st.slot for st in states]

    def get_pending_gradients(self, *, recurse: bool = True) -> Pending:
        """The gradients no reduction has finished, keyed by their sharded parameters, without
        communicating: each value is ``(unreduced, partial)``. ``unreduced`` is the sum of the
        backwards run without gradient sync (``set_requires_gradient_sync(False)``): the
        unsharded gradient, in ``reduce_dtype`` if the policy sets one (a TP parameter's is
        a DTensor on the TP mesh); ``partial`` is HSDP's shard-reduced sum still to be
        all-reduced over the replicas (``set_requires_all_reduce(False)``): this rank's
        shard, a plain tensor. Only parameters with a pending contribution are included;
        reduced gradients stay on ``param.grad``. The tensors are the buffers the next
        reduction reads, the same objects across later backwards: an in-place change
        changes what is reduced; assigning into the dict changes nothing. ``recurse=False``:
        only this module's groups. torch main's API.

        Raises:
            RuntimeError: during a forward or backward; under the deterministic reduction
                (each micro-batch's gradient is kept apart: no one pending tensor).
        """
        state, slots = self._pending_slots(recurse)
        return pending_gradients(state.ctx, slots)

    def synchronize_gradients(self, *, recurse: bool = True) -> None:
        """Reduce every pending gradient (see :meth:`get_pending_gradients`) now, without
        another backward: the no-sync sums are reduce-scattered (and, for HSDP, all-reduced
        with the partial sums), divided and added to the sharded ``param.grad`` as a synced
        backward would; communication hooks and divide factors apply. The sync settings for
        later backwards are unchanged. Call it on every rank, before clipping or an
        optimizer step, when gradients are pending; a call with nothing pending does
        nothing. ``recurse=False``: only this module's groups. torch main's API.

        Raises:
            RuntimeError: during a forward or backward, or while a
                ``finalize_backward(async_op=True)`` handle is outstanding.
        """
        state, slots = self._pending_slots(recurse)
        synchronize(state.ctx, slots)
