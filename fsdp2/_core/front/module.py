"""The ``FSDPModule`` mixin (the methods every sharded module gains),
``register_fsdp_forward_method`` and ``share_comm_ctx``; the handles of its asynchronous
calls are ``handles.py``'s."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from fsdp2._core.comm.transport import BackendAlloc
from fsdp2._core.front.gradients import PendingGradients
from fsdp2._core.front.handles import GradientReductionHandle, UnshardHandle
from fsdp2._core.params.group import ParamGroup, Sharded
from fsdp2._core.runtime import relayout
from fsdp2._core.runtime.state import FSDPState, state_of
from fsdp2._core.runtime.step import StepPhase
from fsdp2._core.support.mesh import separate_shard_group
from fsdp2.api import AllGather, ReduceScatter

__all__ = ["FSDPModule", "GradientReductionHandle", "UnshardHandle"]


def _no_deepcopy(self: Any, memo: Any) -> NoReturn:
    raise TypeError(
        f"{type(self).__name__} is sharded by fully_shard and cannot be deep-copied; "
        "save and load a state dict instead (model.state_dict() / "
        "torch.distributed.checkpoint)"
    )


_FSDP_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    """``FSDP<cls>``: FSDPModule first in the MRO, one class per original class."""
    fsdp_cls = _FSDP_CLASSES.get(cls)
    if fsdp_cls is None:
        fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": _no_deepcopy})
        _FSDP_CLASSES[cls] = fsdp_cls
    return fsdp_cls


class FSDPModule(PendingGradients):
    """Mixin added to every module passed to :func:`fully_shard`."""

    _fsdp2_api = "fully_shard"  # the call that manages it (``ReplicateModule``: replicate)

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Constructing an FSDP class (e.g. nn.Sequential slicing builds
        # ``type(self)(...)``) builds the plain original class instead.
        orig: Any = next(
            c for c in cls.__mro__[1:] if not issubclass(c, (FSDPModule, PendingGradients))
        )
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def _fsdp_state(self) -> FSDPState:
        state = state_of(self)  # type: ignore[arg-type]
        assert state is not None, "FSDPModule without fully_shard state"
        return state

    def _fsdp_modules(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fsdp_state()]
        out: list[FSDPState] = []
        for m in self.modules():  # type: ignore[attr-defined]
            st = state_of(m)
            if st is not None and st not in out:
                out.append(st)
        return out

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters and register the unsharded ones.
        Not recursive. With ``async_op=True`` return an :class:`UnshardHandle`
        at once; the next forward of this module waits for it automatically.
        Follows the mixed-precision policy (gathers in ``param_dtype``)."""
        state = self._fsdp_state()
        if state.ctx is not None:
            state.ctx.awaiting_refusal("unshard()")
        self._check_grad_dtypes(state)  # changed since fully_shard: RuntimeError
        for g in state.groups:
            if g.stale():  # values loaded or stepped since it was gathered
                g.reshard()
            g.unshard()
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters (if allocated) and register the sharded
        ones. Not recursive."""
        for g in self._fsdp_state().groups:
            g.reshard()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward reduces gradients. ``False`` accumulates unsharded
        gradients locally (no communication) until a backward with ``True``
        reduces their sum: gradient accumulation without communication (FSDP1's
        ``no_sync``). For HSDP it covers both the reduce-scatter and the all-reduce."""
        sync = bool(requires_gradient_sync)
        self._update(recurse, reduce={"sync": sync, "all_reduce": sync})

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether backward all-reduces over the replicate dim (``False``:
        reduce-scatter only)."""
        self._update(recurse, reduce={"all_reduce": bool(requires_all_reduce)})

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` at run time (e.g. ``True`` on the root,
        or ``False`` for evaluation)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                "reshard_after_forward should be a bool, got "
                f"{type(reshard_after_forward).__name__}"
            )
        for st in self._fsdp_modules(recurse):
            st.auto_reshard = False
        self._update(recurse, gather={"post_forward": reshard_after_forward})

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward frees the unsharded parameters; ``False`` keeps them
        for the next forward (more memory, no all-gather), e.g. between
        gradient-accumulation microbatches."""
        self._update(recurse, gather={"reshard_after_backward": bool(reshard_after_backward)})

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """``True``: resharding (after forward, after backward, ``reshard()``) keeps the
        unsharded parameters' storage allocated, so each unsharded parameter has the same data
        pointer from one all-gather to the next (CUDA graphs, inference engines reading the
        weights in place); the sharded parameters are registered as usual, and every
        all-gather still writes fresh values. Costs the unsharded bytes for as long as it is
        on. ``False`` frees at the next reshard. Tensor-subclass parameters with all-gather
        hooks rebuild their outputs each time. torch main's API."""
        self._update(recurse, gather={"keep_storage": bool(keep)})

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether this module's parameters are all-gathered for backward; set
        ``False`` only when backward does not need them (e.g. an embedding)."""
        self._update(False, gather={"unshard_in_backward": bool(unshard_in_backward)})

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """``True``: every backward of this module's root leaves its finishing work (the
        reduction of no-sync sums and late gradients, waiting for the reductions in flight,
        resharding) to :meth:`finalize_backward`, which the caller calls after the last
        backward, e.g. of gradient accumulation over several pipeline schedule steps.
        Until then not every gradient is on the sharded parameters: do not step the
        optimizer. Stays on until set ``False``. Gradient sync and resharding follow their
        settings at the time ``finalize_backward`` runs. torch main's API (pytorch PR
        197620).

        Raises:
            RuntimeError: called during a forward or backward of this module's root.
        """
        state = self._fsdp_state()
        ctx = state.ctx
        if ctx is not None and ctx.phase is not StepPhase.IDLE:
            raise RuntimeError(
                "fsdp2: set_manual_backward_finalization() called during a forward or "
                "backward; call it between steps"
            )
        state.manual_finalization = bool(enabled)
        if ctx is not None:
            ctx.manual = bool(enabled)

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """Finish the backwards run so far, on every FSDP module under this module's root:
        reduce (per the current :meth:`set_requires_gradient_sync`) the gradients no
        backward reduced, wait for every reduction, land the gradients on the sharded
        parameters and reshard per :meth:`set_reshard_after_backward`. Needed after the
        last backward with :meth:`set_manual_backward_finalization`; otherwise it finishes
        what no-sync backwards left (a no-op after an ordinary backward). Collective:
        every rank calls it at the same point.

        With ``async_op=True`` it issues the reductions and returns a
        :class:`GradientReductionHandle` at once, whose ``wait()`` does the rest (other work,
        a pipeline stage's next action, overlaps the reductions); until then the step is
        open (see ``GradientReductionHandle.wait``). torch main's API (pytorch PR 196724).

        Raises:
            RuntimeError: called during a forward or backward, or while the handle of an
                earlier ``finalize_backward(async_op=True)`` has not been waited.
        """
        ctx = self._fsdp_state().ctx
        if ctx is None:  # no forward yet: nothing to finish
            return GradientReductionHandle() if async_op else None
        if ctx.phase is not StepPhase.IDLE:
            raise RuntimeError(
                "fsdp2: finalize_backward() called during a forward or backward; call it "
                "after the backward (after the last micro-batch's)"
            )
        ctx.awaiting_refusal("finalize_backward()")
        complete = ctx.finalize(async_op=async_op)
        return GradientReductionHandle(complete) if async_op else None

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for compatibility: every backward already waits for its
        reductions in the final callback."""

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters right after this module's own
        all-gather is issued in forward, instead of the implicit next module."""
        self._fsdp_state().fwd_prefetch = _prefetch_states(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters right after this module's own
        all-gather in backward, instead of the implicit previous module."""
        self._fsdp_state().bwd_prefetch = _prefetch_states(modules)

    def _groups(self, recurse: bool = False) -> list[ParamGroup]:
        return [g for st in self._fsdp_modules(recurse) for g in st.groups]

    def _one_group(self, method: str, what: str) -> None:
        """Refuse ``method`` on a module whose ``fully_shard`` call made several groups
        (per-parameter meshes), as torch's FSDP2 does: one ``what`` for several meshes
        would be ambiguous."""
        groups = self._groups()
        if len(groups) > 1:
            meshes = ", ".join(g.path for g in groups)
            raise ValueError(
                f"{method} is not supported on {type(self).__name__}: its fully_shard call "
                f"has {len(groups)} parameter groups on different meshes (per-parameter "
                f"meshes from shard_placement_fn: {meshes}), and the {what} would be "
                "ambiguous across them. Shard the parameters that need it in a "
                "fully_shard call of their own"
            )

    def _update(
        self,
        recurse: bool,
        gather: dict[str, Any] | None = None,
        reduce: dict[str, Any] | None = None,
    ) -> None:
        """The one path every setter takes: change settings of this module's group (and
        with ``recurse`` every group below it)."""
        for g in self._groups(recurse):
            g.update(gather=gather, reduce=reduce)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Reduce zeros for parameters that got no gradient this backward, so that
        ranks using different parameters (mixture of experts, multi-modal
        branches) still issue matching reduce-scatters (DDP's
        ``find_unused_parameters``). Those parameters then get a gradient."""
        self._update(recurse, reduce={"reduce_unused": bool(reduce_scatter_unused_params)})

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel
        world size (e.g. ``1.0`` for a summed loss). Not recursive."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"gradient divide factor must be a positive number, got {factor!r}")
        self._update(False, reduce={"divide_factor": float(factor)})

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated alias of :meth:`set_gradient_divide_factor`."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
            FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with ``ReduceOp.SUM`` only and divide locally afterwards (for
        backends or custom collectives without ``AVG``). Not recursive."""
        self._update(False, reduce={"force_sum": bool(enable)})

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Any = None, mesh: Any = None
    ) -> None:
        """Call ``hook(output)`` on each flat reduced gradient before it lands:
        after the reduce-scatter for FSDP, after the all-reduce for HSDP. Use it
        to reduce across a dimension fsdp2 does not manage (torchft's replica groups:
        ``fsdp2.integrations.torchft``). ``stream`` (CUDA) is the stream to run the hook
        on; not allowed with HSDP. Not recursive.

        A ``fully_shard`` call with several parameter groups (per-parameter meshes,
        expert parallel + FSDP) calls the hook on every group's reduced shard, one call
        per group (torch's FSDP2 refuses such modules). ``mesh``: set the hook of the
        group on that mesh only; call once per mesh for hooks that must tell the groups
        apart. ``ValueError`` if no group of this module is on ``mesh``."""
        if not callable(hook):
            raise TypeError(f"all-reduce hook must be callable, got {type(hook).__name__}")
        groups = self._groups()
        if mesh is not None:
            groups = [g for g in groups if g.info.mesh == mesh]
            if not groups:
                meshes = "; ".join(f"{g.path}: {g.info.mesh}" for g in self._groups())
                raise ValueError(
                    f"set_all_reduce_hook(mesh=...): no parameter group of "
                    f"{type(self).__name__} is on {mesh} (its groups: {meshes or 'none'})"
                )
        for g in groups:
            if stream is not None and g.info.replicate_group is not None:
                raise ValueError("set_all_reduce_hook(stream=...) cannot be used with HSDP")
        wrapped = hook if stream is None else _on_stream(hook, stream)
        for g in groups:
            g.update(reduce={"hook": wrapped})

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Replace this module's all-gather by ``comm`` (which also allocates its
        output buffer). Not recursive."""
        if not isinstance(comm, AllGather):
            raise TypeError(
                f"set_custom_all_gather expects an AllGather, got {type(comm).__name__}"
            )
        self._one_group("set_custom_all_gather", "custom comm")
        self._update(False, gather={"comm": comm})

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Replace this module's reduce-scatter by ``comm`` (which also allocates
        its input and output buffers). Not recursive."""
        if not isinstance(comm, ReduceScatter):
            raise TypeError(
                f"set_custom_reduce_scatter expects a ReduceScatter, got {type(comm).__name__}"
            )
        self._one_group("set_custom_reduce_scatter", "custom comm")
        if any(g.reduce.exact for g in self._groups()):
            raise ValueError(
                f"set_custom_reduce_scatter: {type(self).__name__} reduces deterministically "
                "(fsdp2.reduction.set_deterministic), by an exchange that sums in fp32 in one "
                "fixed order; another reduce-scatter (a low-precision wire) would round each "
                "rank's partial sum and the bits would change with the world size. Call "
                "set_deterministic(model, False) first, or keep the deterministic mode alone"
            )
        self._update(False, reduce={"comm": comm})

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many gradient reductions may be in flight before the oldest is
        waited (default 1). More overlaps slow reductions with backward compute
        at the cost of one group's gradient memory each."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be >= 1, got {max_input_buffers}")
        self._update(recurse, reduce={"max_inflight": max_input_buffers})

    def set_bucket_bytes(self, max_bytes: int | None, *, recurse: bool = True) -> None:
        """Bucket small groups' collectives (fsdp2 only; off by default).

        A group gathered with ``max_bytes`` set takes the groups expected to run right
        after it (last step's order) into the same all-gather, and groups whose backward
        finished one after another share one reduce-scatter, as long as a bucket's
        unsharded parameters (or its reduce-scatter input) stay within ``max_bytes`` and
        the groups agree on mesh, dtypes and collective settings. Fewer, larger
        collectives for many small layers (LoRA adapters, experts); the same numbers.
        Memory: up to two gathered buckets and one bucket of gradients in flight. Groups
        with a custom collective, tensor-subclass parameters or ``reshard_after_forward``
        set to an int gather alone. ``None`` goes back to one collective per group.
        """
        if max_bytes is not None and (
            isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
        ):
            raise TypeError(f"max_bytes must be an int or None, got {type(max_bytes).__name__}")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self._update(
            recurse, gather={"bucket_bytes": max_bytes}, reduce={"bucket_bytes": max_bytes}
        )

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Run gradient reduce-scatters on a process group of their own (over the
        same shard ranks), so they can progress concurrently with all-gathers
        instead of queueing behind them on one communicator. Creating groups is
        collective: call it on every rank alike. ``False`` goes back to the
        shared group."""
        for g in self._groups(recurse):
            g.update(reduce={"group": separate_shard_group(g.info) if enable else None})

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate collective buffers from the process group's own allocator
        (NCCL zero-copy, e.g. SHARP). Backends without one (gloo) ignore it.
        Cannot be combined with custom collectives. Not recursive."""
        for g in self._groups():
            if g.gather.comm is not None and not isinstance(g.gather.comm, BackendAlloc):
                raise ValueError("custom all-gather already set; it allocates its own buffers")
            comm = BackendAlloc.for_group(g.info.shard_group, g.device) if enable else None
            g.update(gather={"comm": comm}, reduce={"comm": comm})

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """torch 2.13's symmetric-memory all-gather buffers (NCCL copy-engine
        collectives). Not implemented by fsdp2: a no-op on CPU meshes.

        Raises:
            NotImplementedError: on an accelerator mesh.
        """
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm supports backend='NCCL', got {backend!r}")
        for g in self._groups():
            if g.device.type != "cpu":
                raise NotImplementedError(
                    "fsdp2 does not implement symmetric-memory collectives yet; "
                    "set_allocate_memory_from_process_group_for_comm(True) is the closest"
                )

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Order the next forward's first all-gathers after ``event`` (recorded
        after the optimizer step). Used once, then dropped; on CPU a no-op."""
        state = self._fsdp_state()
        state.post_optim_event = event

    def reset_iter_state(self) -> None:
        """Recover after an exception in forward or backward: wait for and drop
        in-flight collectives (the failed step's gradient reductions are lost,
        including accumulated no-sync gradients), reshard everything and clear
        the step's bookkeeping. Call it on the root module.

        Raises:
            RuntimeError: called on a module that is not the root.
        """
        state = self._fsdp_state()
        if state.ctx is not None and not state.is_root:
            raise RuntimeError(
                "reset_iter_state must be called on the root FSDP module, not "
                f"{type(self).__name__}"
            )
        if state.ctx is None:
            return
        state.ctx.reset()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, also for the sharded parameters of groups registered
        unsharded (``parameters()`` gives their unsharded ones then: after a forward whose
        backward has not run, ``unshard()``, ``set_reshard_after_backward(False)``), whose
        gradients the optimizer steps with. torch's FSDP2 leaves those, so the next
        backward adds to the last step's gradients there. The pending gradients (no-sync
        sums, HSDP partial sums: :meth:`get_pending_gradients`) are cleared too, as torch
        main does; torch 2.13 leaves them to the next synced backward."""
        ctx = self._fsdp_state().ctx
        if ctx is not None:
            ctx.awaiting_refusal("zero_grad()")
        super().zero_grad(set_to_none)  # type: ignore[misc]
        for st in self._fsdp_modules(recurse=True):  # the pending gradients too
            for g, state in zip(st.slot.groups, st.slot.grads, strict=True):
                state.zero(set_to_none)
                for u in (p.unsharded for p in g.grad_params):
                    if u is not None and u.grad is not None:
                        u.grad = None if set_to_none else u.grad.zero_()
        for g in self._groups(recurse=True):
            if g.sharded_state is Sharded.SHARDED:
                continue
            for p in g.params:
                grad = p.sharded.grad
                if grad is None:
                    continue
                if set_to_none:
                    p.sharded.grad = None
                else:
                    grad.detach_() if grad.grad_fn is not None else grad.requires_grad_(False)
                    grad.zero_()

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # refuse first; convert the sharded params only; back into the groups' flat buffers
        self._check_conversion(args[0] if args else kwargs["fn"])
        self.reshard()
        out = super()._apply(*args, **kwargs)  # type: ignore[misc]
        for g in self._groups(recurse=True):
            relayout.resync_after_apply(g)
        return out


def _prefetch_states(modules: list[FSDPModule]) -> list[FSDPState]:
    states = []
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(
                f"prefetch lists take FSDP modules (passed to fully_shard), got {type(m).__name__}"
            )
        states.append(m._fsdp_state())
    return states


def _on_stream(hook: Callable[[torch.Tensor], None], stream: Any) -> Callable[[torch.Tensor], None]:
    def run(output: torch.Tensor) -> None:
        # The device module's streams take a torch.cuda.Event / Stream and a torch.Event alike.
        device_module: Any = torch.get_device_module(output.device)
        current = device_module.current_stream(output.device)
        stream.wait_stream(current)
        with device_module.stream(stream):
            hook(output)
        current.wait_stream(stream)

    return run
