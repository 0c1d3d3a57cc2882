"""The state layer: per-``fully_shard`` hooks (``FSDPState``) and lazy init. Each state
owns a ``Slot`` (step.py), its place in the step: the one thing the step layer below sees
of it. What one root shares with every state under it (``StepContext``: the step's phase
and order, all-gathers and reductions, the final callback) is in step.py; see [Note: one
step] there. Groups below do storage and collectives when told.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.nn as nn
from torch._compile import _disable_dynamo
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fsdp2._core.params.dtypes import check as check_grad_dtypes
from fsdp2._core.params.group import ParamGroup
from fsdp2._core.runtime import relayout
from fsdp2._core.runtime.slot import Slot, TrainingState
from fsdp2._core.runtime.step import StepContext, StepPhase
from fsdp2._core.runtime.tree_checks import check_materialized, validate_tree
from fsdp2._core.support.labels import hook
from fsdp2._core.support.pipeline import maybe_enable
from fsdp2.api import MixedPrecisionPolicy

# torch.compile runs the engine's hooks eagerly (a graph break around each): they
# move storages and issue collectives, which must not be traced. See docs/compile.md.
# torch._disable_dynamo (torch's FSDP2 uses it too) imports torch._dynamo at the first
# call, not at decoration: torch.compiler.disable would import it with fsdp2 (~0.5 s).
_F = TypeVar("_F", bound=Callable[..., Any])


def _eager(fn: _F) -> _F:
    return cast(_F, _disable_dynamo(fn))


STATE_ATTR = "_fsdp2_state"


def state_of(module: nn.Module) -> FSDPState | None:
    return module.__dict__.get(STATE_ATTR)


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs after the module's."""

    @staticmethod
    def forward(ctx, state: FSDPState, *inputs: torch.Tensor):  # type: ignore[no-untyped-def]
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[no-untyped-def]
        ctx.state._post_backward_node_done()
        return (None, *grads)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


class FSDPState:
    """The hooks of one ``fully_shard`` call (one or several modules; one group per
    process group its parameters shard over) and its place in the step."""

    def __init__(
        self,
        modules: list[nn.Module],
        groups: list[ParamGroup],
        mp_policy: MixedPrecisionPolicy,
        device: torch.device,
        auto_reshard: bool,
    ) -> None:
        self.modules = modules
        self.groups = groups
        self.mp_policy = mp_policy
        self.device = device
        self.auto_reshard = auto_reshard  # reshard_after_forward=None: the root keeps
        self.ctx: StepContext | None = None
        self.is_root = False
        # set_manual_backward_finalization before the first forward (the context it sets
        # is made at lazy init)
        self.manual_finalization = False
        self.post_optim_event: torch.Event | None = None
        # its place in the step (what the step layer sees: step.py's Slot)
        name = groups[0].name.removesuffix(groups[0].mesh_tag) if groups else ""
        self.slot = Slot(groups, name or type(modules[0]).__name__)
        # explicit prefetch lists (setters); the implicit ones are the slot's
        self.fwd_prefetch: list[FSDPState] | None = None
        self.bwd_prefetch: list[FSDPState] | None = None
        self._fwd_left: set[int] = set()  # fully_shard([a, b]): modules yet to run
        for m in modules:
            m.__dict__[STATE_ATTR] = self
            m.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            m.register_forward_hook(self._post_forward)

    @property
    def path(self) -> str:
        """Its (first) group's module path (or its module's class), for labels and
        messages."""
        return self.groups[0].path if self.groups else type(self.modules[0]).__name__

    # ---- lazy init ---------------------------------------------------------------

    def _lazy_init(self) -> None:
        """Become the root of every state below: share one context, validate."""
        states: list[FSDPState] = []
        seen: set[int] = set()
        for top in self.modules:
            for m in top.modules():
                st = state_of(m)
                if st is not None and id(st) not in seen:
                    seen.add(id(st))
                    states.append(st)
        groups = [g for st in states for g in st.groups]
        validate_tree(groups)
        for g in groups:  # grad_dtype changed, parameters replaced since fully_shard
            check_grad_dtypes(g.params, thorough=True)  # see [Note: gradient dtypes]
            relayout.adopt_registered(g)  # (e.g. after to_empty)
        check_materialized(groups, self.modules)
        ctx = StepContext([st.slot for st in states])
        ctx.manual = any(st.manual_finalization for st in states)
        for st in states:
            st.ctx = ctx
            st.is_root = st is self
        for top in self.modules:  # module paths for messages (fsdp2 debug mode)
            for path, m in top.named_modules():
                st = state_of(m)
                if st is None:
                    continue
                for g in st.groups:
                    if g.path == g.name:
                        g.path = (path or f"the root ({st.slot.name})") + g.mesh_tag
        if self.auto_reshard:
            # Its backward comes first: keep the root's params through it.
            for g in self.groups:
                g.update(gather={"post_forward": False})

    # ---- forward -------------------------------------------------------------------

    @_eager
    @hook("pre_forward")
    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ctx = self.ctx
        if ctx is None:
            self._lazy_init()
            ctx = self.ctx
            assert ctx is not None
        recompute = ctx.phase is StepPhase.BACKWARD
        if recompute:
            ctx.check_recompute(type(module).__name__)
        elif self.is_root:
            maybe_enable()  # see [Note: stages under torch's schedules]
            ctx.begin_forward()
            if self.post_optim_event is not None:
                if self.device.type != "cpu":  # CPU work is in program order: nothing to wait
                    # The device module's stream (torch.cuda.Stream) takes both a
                    # torch.cuda.Event and a torch.Event; torch.Stream takes only the latter.
                    device_module: Any = torch.get_device_module(self.device)
                    stream = device_module.current_stream(self.device)
                    stream.wait_event(self.post_optim_event)
                self.post_optim_event = None
            if self.device.type != "cpu":
                args, kwargs = tree_map(self._to_device, (args, kwargs))
        elif ctx.phase is StepPhase.IDLE:  # called outside its root's forward
            ctx.awaiting_refusal(f"the forward of {type(module).__name__}")
            for g in self.groups:
                relayout.before_forward(g)
        if self.groups:
            if recompute:  # activation-checkpoint recompute
                for g in self.groups:
                    g.wait_for_unshard()
            else:
                self.slot.to(TrainingState.FORWARD, "forward")
                ctx.fwd_order.append(self.slot)
                ctx.unshard(self.slot, backward=False)
                explicit = self.fwd_prefetch
                targets = self.slot.fwd_next if explicit is None else [s.slot for s in explicit]
                for nxt in targets:
                    ctx.unshard(nxt, backward=False)
                for g in self.groups:
                    g.wait_for_unshard()
                if torch.is_grad_enabled():
                    args, kwargs = self._register_post_backward(args, kwargs)
        mp = self.mp_policy
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), mp.param_dtype)
        return args, kwargs

    def _to_device(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.device != self.device:
            return x.to(self.device, non_blocking=True)
        return x

    def _register_post_backward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args and not kwargs and all(type(a) is torch.Tensor and a.requires_grad for a in args):
            self.slot.post_backward_pending += 1  # the common case: (x,) needing grad
            return _PostBackward.apply(self, *args), kwargs
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not idx:
            # This call's backward (if any) cannot be seen finishing: leave the
            # group's reduction to the final callback (see _post_backward_node_done).
            self.slot.untracked_calls += 1
            return args, kwargs
        outs = _PostBackward.apply(self, *(flat[i] for i in idx))
        for i, t in zip(idx, outs, strict=True):
            flat[i] = t
        self.slot.post_backward_pending += 1
        return tree_unflatten(flat, spec)  # type: ignore[no-any-return]

    @_eager
    @hook("post_forward")
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        ctx = self.ctx
        assert ctx is not None
        if ctx.phase is StepPhase.BACKWARD:  # recompute: same output as the forward
            return self._cast_output(output)
        training = torch.is_grad_enabled()
        if self.groups:
            if len(self.modules) > 1:
                left = self._fwd_left or {id(m) for m in self.modules}
                left.discard(id(module))
                self._fwd_left = left
                done = not left
            else:
                done = True
            if done:
                self.slot.to(TrainingState.IDLE, "end of forward")
                for g in self.groups:  # as torch's FSDP2, with or without grad
                    g.after_forward()
            if training:
                ctx.post_fwd_order.append(self.slot)
        if training:
            self._register_pre_backward(output)
        if self.is_root:
            ctx.end_forward()
        return self._cast_output(output)

    def _cast_output(self, output: Any) -> Any:
        if self.mp_policy.output_dtype is not None:
            return _cast_floats(output, self.mp_policy.output_dtype)
        return output

    # ---- backward ------------------------------------------------------------------

    def _register_pre_backward(self, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            if output.requires_grad:
                output.register_hook(self._pre_backward)
            return
        tensors = [
            t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if len(tensors) == 1:
            tensors[0].register_hook(self._pre_backward)
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward, mode="any")

    @hook("pre_backward")
    def _pre_backward(self, *unused: Any) -> None:
        ctx = self.ctx
        assert ctx is not None
        if ctx.phase is not StepPhase.BACKWARD:
            ctx.begin_backward()
        elif not self.is_root:
            ctx.cancel_deferred_prefetch()  # another group's backward began: gather as usual
        groups = self.groups
        if len(groups) != 1 or not groups[0].gather.unshard_in_backward:
            groups = [g for g in groups if g.gather.unshard_in_backward]
            if not groups:
                return
        self.slot.to(TrainingState.PRE_BACKWARD, "backward")
        # Even after this group's post-backward (e.g. an earlier call whose
        # inputs needed no grad registered no post-backward node): gather again;
        # the final callback reduces what arrives afterwards.
        ctx.unshard(self.slot, backward=True)
        if self.bwd_prefetch is not None:
            ctx.prefetch_for_backward([s.slot for s in self.bwd_prefetch])
        elif self.is_root:
            params = groups[0].grad_params
            if len(groups) > 1:
                params = [p for g in groups for p in g.grad_params]
            ctx.defer_prefetch(self.slot.bwd_next, params)
        else:
            ctx.prefetch_for_backward(self.slot.bwd_next)
        for g in groups:
            g.wait_for_unshard()

    def _post_backward_node_done(self) -> None:
        slot = self.slot
        slot.post_backward_pending -= 1
        # A call whose inputs needed no grad registered no node, yet its
        # backward may still be to come (fully_shard([a, b]) with ``a`` on the
        # data, or a module reused on the data): reduce once, at the end.
        if (
            slot.post_backward_pending <= 0
            and slot.training_state is not TrainingState.POST_BACKWARD
            and not slot.untracked_calls
        ):
            self.post_backward()

    @hook("post_backward")
    def post_backward(self) -> None:
        """Hand the groups' gradients to reduction (queued on the step) and reshard."""
        assert self.ctx is not None
        self.ctx.post_backward(self.slot)
