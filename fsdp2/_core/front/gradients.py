"""``FSDPModule``'s view of the gradients no reduction has finished: torch main's
``get_pending_gradients`` and ``synchronize_gradients`` (``runtime/pending.py`` does the work);
and the checks gradients impose on a conversion (``.to()``, ``_apply``) and an ``unshard()``
([Note: gradient dtypes] in ``params/dtypes.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from fsdp2._core.params.dtypes import check as check_grad_dtypes
from fsdp2._core.runtime.pending import Pending, pending_gradients, synchronize

if TYPE_CHECKING:
    from fsdp2._core.params.param import FSDPParam
    from fsdp2._core.runtime.reduce import GradState
    from fsdp2._core.runtime.slot import Slot
    from fsdp2._core.runtime.state import FSDPState

EXISTING = (
    "FSDP module conversion is incompatible with an existing gradient. Call "
    "model.zero_grad(set_to_none=True) before converting the module."
)
PENDING = (
    "FSDP module conversion is incompatible with a pending gradient. Call "
    "model.zero_grad(set_to_none=True) before converting the module."
)


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

    def _check_grad_dtypes(self, state: FSDPState) -> None:
        """``unshard()``: refuse a ``grad_dtype`` changed since ``fully_shard``."""
        for g in state.groups:
            check_grad_dtypes(g.params)

    def _check_conversion(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Before ``_apply(fn)`` converts anything, on every group at or below this module (so
        that nothing is converted when one refuses): refuse a ``grad_dtype`` changed since
        ``fully_shard``, a gradient that would end in another dtype than its parameter's
        policy, and a pending gradient whose parameter changes dtype or device (torch
        main's rules and texts; [Note: gradient dtypes] in ``params/dtypes.py``).

        Raises:
            RuntimeError: naming the parameter; clear gradients with
                ``model.zero_grad(set_to_none=True)``.
        """
        probe = _Probe(fn)
        for st in self._fsdp_modules(recurse=True):  # type: ignore[attr-defined]
            for g, state in zip(st.slot.groups, st.slot.grads, strict=True):
                check_grad_dtypes(g.params, thorough=True)
                for p in g.params:
                    _check_converted_grads(p, state, probe)


class _Probe:
    """Where a conversion puts a tensor: ``fn`` applied to an empty one of its dtype and
    device (each kind once); unchanged when ``fn`` cannot say."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fn = fn
        self.seen: dict[tuple[torch.dtype, torch.device], tuple[torch.dtype, torch.device]] = {}

    def __call__(self, t: torch.Tensor) -> tuple[torch.dtype, torch.device]:
        key = (t.dtype, t.device)
        out = self.seen.get(key)
        if out is None:
            try:
                with torch.no_grad():
                    new = self.fn(torch.empty(0, dtype=t.dtype, device=t.device))
                out = (new.dtype, new.device)
            except Exception:  # noqa: BLE001 - the conversion itself will say what is wrong
                out = key
            self.seen[key] = out
        return out


def _check_converted_grads(p: FSDPParam, state: GradState, probe: _Probe) -> None:
    sharded = p.sharded
    dtype, device = probe(sharded)
    grad = sharded.grad
    if grad is not None:
        policy = p.grad_policy
        grad_dtype = probe(grad)[0]
        target = policy.dtype if policy.explicit else dtype
        if grad_dtype != dtype or (target is not None and grad_dtype != target):
            raise RuntimeError(
                f"{EXISTING} (parameter {p.fqn}: its {grad.dtype} gradient would become "
                f"{grad_dtype}, beside a {dtype} parameter whose grad_dtype is {target})"
            )
    if (dtype, device) == (sharded.dtype, sharded.device):
        return
    u = p.unsharded
    if (
        (u is not None and u.grad is not None)
        or id(p) in state.acc
        or id(p) in state.trees
        or (state.partial is not None and p in state.partial_params)
    ):
        raise RuntimeError(
            f"{PENDING} (parameter {p.fqn}: a gradient not reduced yet, while the parameter "
            f"would change from {sharded.dtype} on {sharded.device} to {dtype} on {device})"
        )
