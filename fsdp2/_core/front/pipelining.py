"""fsdp2 stages under ``torch.distributed.pipelining``'s schedules: :func:`enable`.

torch's schedules drive the data parallelism of each stage themselves: for a stage whose
module is torch's ``FSDPModule`` they turn gradient sync and resharding off before every
micro-batch's backward, reduce once after the stage's last backward (``perform_reduce_grad``:
the single-stage schedules at the end of ``step``, the runtime's ``REDUCE_GRAD`` action) and,
in ``_PipelineScheduleRuntime``, all-gather and free a stage's parameters at its ``UNSHARD``
and ``RESHARD`` actions. They recognise torch's modules by class, so without help an fsdp2
stage trains right but gathers and reduces once per micro-batch. :func:`enable` teaches them
fsdp2's modules (see [Note: pipelining]). fsdp2 calls it itself once
``torch.distributed.pipelining`` is imported (at ``fully_shard`` and at every root forward:
[Note: stages under torch's schedules] in fsdp2/_core/support/pipeline.py), and so does
``fsdp2.integrations.use_fsdp2()``.

# [Note: pipelining]
# Patched in torch's pipelining modules, for fsdp2's modules only (torch's FSDP2, DDP and
# plain stages keep torch's code):
# * ``_PipelineStageBase.backward_maybe_with_nosync``: before a micro-batch's backward, an
#   fsdp2 stage syncs and reshards only on the last micro-batch's full backward (its
#   reduce-scatters then overlap that backward, group by group); every other backward, and
#   the split input / weight backwards of zero-bubble schedules, accumulate unsharded with
#   the parameters kept unsharded. The computation itself is torch's ("regular backward").
# * ``_PipelineStageBase.perform_reduce_grad``: sync and resharding back on, then
#   ``finalize_backward()`` (reduces what the backwards accumulated, waits, reshards; a no-op
#   after a synced last backward), then torch's gradient scaling. With
#   ``set_manual_backward_finalization(True)`` on the stage it does not finalize: the
#   gradients keep accumulating over schedule steps until the caller's
#   ``finalize_backward()``, and the schedule's scaling divides this step's share only
#   (``seam.divide_unreduced_grads``; torch's ``scale_grads`` divides the running sum, so
#   the earlier steps' share shrinks again at every step: torchtitan issue 1733).
# * ``_post_metadata_inference_cleanup``: reshard an fsdp2 stage and drop the gradients of
#   the metadata inference, as torch's does for its own.
# * ``schedules.FSDPModule``: the runtime's ``UNSHARD`` / ``RESHARD`` actions and its
#   "computing on a sharded stage" check accept fsdp2's modules too, so the runtime
#   prefetches their all-gathers (``unshard(async_op=True)``) as it does torch's;
#   ``_PipelineScheduleRuntime._assert_unsharded`` lets an fsdp2 stage whose ``UNSHARD``
#   ran before the integration was enabled (inside the first step) compute: fsdp2 gathers
#   on demand.
# ``disable()`` puts torch's code back.

# [Note: split backward]
# Zero-bubble schedules split a micro-batch's backward into an input step (``I``: gradients of
# the stage's inputs, keeping the graph) and a weight step (``W``, later, maybe after other
# micro-batches' forwards): both find the weights among ``submod.parameters()``, i.e. the
# registered parameters, by their gradient accumulators. After a forward with
# ``reshard_after_forward=True`` the registered ones are the sharded parameters, whose
# accumulators are not in the graph, so torch's FSDP2 stages lose those weight gradients
# silently (InterleavedZeroBubble, ZBVZeroBubble and DualPipeV train away from the unsharded
# model; with ``reshard_after_forward=False``, torchtitan's setting under PP, they are right).
# fsdp2 unshards the stage's modules before each ``I`` and ``W`` step (the same unsharded
# parameter objects the forward used, gathered again if a later forward resharded them), so
# they are registered and their accumulators found: right with either setting, at one more
# all-gather per ``W`` whose parameters a forward resharded in between.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.nn as nn

from fsdp2._core.front.module import FSDPModule
from fsdp2._core.front.seam import divide_unreduced_grads
from fsdp2._core.support.compat import TORCH_RELEASE
from fsdp2._core.support.pipeline import mark_enabled, opt_out, set_enabler

__all__ = ["disable", "enable", "is_enabled"]

_LOCK = threading.Lock()
_SAVED: dict[str, Any] = {}


class _EitherFSDPModule(type):
    """A class whose ``isinstance`` accepts torch's ``FSDPModule`` and fsdp2's."""

    engines: tuple[type, ...] = ()

    def __instancecheck__(cls, obj: object) -> bool:
        return any(isinstance(obj, c) for c in cls.engines)

    def __subclasscheck__(cls, sub: type) -> bool:
        return any(issubclass(sub, c) for c in cls.engines)


def _fsdp2_stage(stage: Any) -> FSDPModule | None:
    submod = getattr(stage, "submod", None)
    return submod if isinstance(submod, FSDPModule) else None


def _backward_maybe_with_nosync(
    self: Any, backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool = False
) -> Any:
    m = _fsdp2_stage(self)
    if m is not None:
        manual = m._fsdp_state().manual_finalization
        final = last_backward and backward_type == "full" and not manual
        m.set_requires_gradient_sync(final)
        m.set_reshard_after_backward(final)
        if backward_type != "full":
            # zero-bubble split backward: torch's code takes the parameters to compute weight
            # gradients for from submod.parameters(), which must be the unsharded ones the
            # graph used; see [Note: split backward]
            for sub in self.submod.modules():
                if isinstance(sub, FSDPModule):
                    sub.unshard()
    # torch's FSDP branch never sees fsdp2's modules: this runs its plain backward
    return _SAVED["backward_maybe_with_nosync"](self, backward_type, bwd_kwargs, last_backward)


def _perform_reduce_grad(self: Any, grad_scale_factor: int) -> None:
    m = _fsdp2_stage(self)
    if m is not None:
        m.set_requires_gradient_sync(True)
        m.set_reshard_after_backward(True)
        if m._fsdp_state().manual_finalization:
            # accumulating over schedule steps until the caller's finalize_backward(): scale
            # this step's share only (torch's scaling of the running sum would shrink the
            # earlier steps' again at every step)
            if grad_scale_factor != 1:
                divide_unreduced_grads(self.submod, grad_scale_factor)
            return
        m.finalize_backward()
    _SAVED["perform_reduce_grad"](self, grad_scale_factor)


def _post_metadata_inference_cleanup(self: Any) -> None:
    _SAVED["_post_metadata_inference_cleanup"](self)
    submod = getattr(self, "submod", None)
    if not isinstance(submod, nn.Module):
        return
    for module in submod.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
            for p in module.parameters():
                p.grad = None


def _assert_unsharded(self: Any, stage: Any) -> None:
    if _fsdp2_stage(stage) is not None:
        idx = stage.stage_index
        if idx not in self.unshard_ops and idx not in self.unsharded_stages:
            # its UNSHARD action ran before fsdp2 enabled this integration (in the schedule's
            # first step): fsdp2 gathers on demand, so the stage may compute
            self.unsharded_stages.add(idx)
    _SAVED["_assert_unsharded"](self, stage)


# (module, class name, method) -> fsdp2's; the class's own method is saved and called for
# stages that are not fsdp2's
_METHODS = {
    ("stage", "_PipelineStageBase", "backward_maybe_with_nosync"): _backward_maybe_with_nosync,
    ("stage", "_PipelineStageBase", "perform_reduce_grad"): _perform_reduce_grad,
    ("stage", "PipelineStage", "_post_metadata_inference_cleanup"): (
        _post_metadata_inference_cleanup
    ),
    ("schedules", "_PipelineScheduleRuntime", "_assert_unsharded"): _assert_unsharded,
}
# torch 2.11 and 2.12 infer stage shapes without a real forward and backward: no cleanup
_OPTIONAL = {"_post_metadata_inference_cleanup"}


def enable() -> None:
    """Make ``torch.distributed.pipelining``'s schedules run stages sharded by fsdp2 as they
    run torch's FSDP2 stages: parameters gathered once per step (per micro-batch with
    ``reshard_after_forward=True``), gradients accumulated unsharded and reduce-scattered
    once per step, overlapping the last micro-batch's backward; ``UNSHARD`` / ``RESHARD``
    actions of ``_PipelineScheduleRuntime`` schedules (loaded from CSV) prefetch and free
    fsdp2 stages. torch's FSDP2, DDP and plain stages are unaffected.

    fsdp2 calls it itself once ``torch.distributed.pipelining`` is imported (at
    ``fully_shard`` and at a root's forward), and so does ``fsdp2.integrations.use_fsdp2()``:
    call it yourself only to have it on before that. Idempotent, thread-safe; :func:`disable`
    undoes it (and keeps fsdp2 from enabling it again until the next ``enable()``). See
    docs/pipelining.md and [Note: pipelining].
    """
    with _LOCK:
        opt_out(False)
        if _SAVED:
            return
        from torch.distributed.pipelining import schedules, stage

        modules = {"stage": stage, "schedules": schedules}
        for mod, cls_name, name in _METHODS:
            if name in _OPTIONAL:
                continue
            if name not in getattr(modules[mod], cls_name, object).__dict__:
                raise RuntimeError(
                    f"fsdp2.integrations.pipelining: torch {TORCH_RELEASE}'s "
                    f"{cls_name} has no {name}(); fsdp2 runs the schedules of torch 2.11 to "
                    "2.14"
                )
        torch_cls = schedules.__dict__["FSDPModule"]
        either = _EitherFSDPModule("FSDPModule", (), {"__module__": __name__})
        either.engines = (torch_cls, FSDPModule)
        _SAVED["schedules.FSDPModule"] = torch_cls
        for (mod, cls_name, name), ours in _METHODS.items():
            cls = getattr(modules[mod], cls_name)
            if name not in cls.__dict__:  # an optional one this torch lacks
                continue
            _SAVED[name] = cls.__dict__[name]
            setattr(cls, name, ours)
        setattr(schedules, "FSDPModule", either)  # noqa: B010  (not exported: no attribute)
        mark_enabled(True)


def disable() -> None:
    """Undo :func:`enable`, and keep fsdp2 from enabling it again by itself until the next
    :func:`enable` (then torch's schedules run fsdp2's stages as plain modules: gathering and
    reducing once per micro-batch)."""
    with _LOCK:
        opt_out(True)
        if not _SAVED:
            return
        from torch.distributed.pipelining import schedules, stage

        modules = {"stage": stage, "schedules": schedules}
        for mod, cls_name, name in _METHODS:
            if name in _SAVED:
                setattr(getattr(modules[mod], cls_name), name, _SAVED[name])
        setattr(schedules, "FSDPModule", _SAVED["schedules.FSDPModule"])  # noqa: B010
        _SAVED.clear()
        mark_enabled(False)


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return bool(_SAVED)


set_enabler(enable)  # fsdp2 enables it itself once torch's pipelining is imported
