"""Per-``fully_shard`` state (the hooks) and the context one root shares with
every state under it (step order, reductions in flight, final callback).

# [Note: one step]
# pre-forward:   unshard this group (issue all-gather), prefetch the group that
#                ran next last step (issue only), then wait for ours; register
#                a post-backward node on the inputs that require grad.
# post-forward:  reshard per reshard_after_forward; hook the outputs so the
#                group unshards again when their gradient arrives.
# pre-backward:  unshard (if resharded), prefetch the group that comes next in
#                reverse post-forward order, wait.
# post-backward: fires when every post-backward node registered this step has
#                run, i.e. all of the group's backward is done: reduce-scatter
#                the grads (async; the previous group's reduction is waited
#                here, so one is in flight), reshard.
# final callback (queued on the autograd engine by the first pre-backward):
#                reduce what no post-backward reduced (unused inputs, params
#                whose grads came late), wait all reductions, reshard, reset.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ._param_group import ParamGroup, Sharded, _Reduction
from .api import MixedPrecisionPolicy

# torch.compile runs the engine's hooks eagerly (a graph break around each): they
# move storages and issue collectives, which must not be traced. See docs/compile.md.
_eager = torch.compiler.disable

STATE_ATTR = "_fsdp2_state"


def state_of(module: nn.Module) -> FSDPState | None:
    return module.__dict__.get(STATE_ATTR)


class StepContext:
    """What all states under one root share."""

    def __init__(self, states: list[FSDPState]) -> None:
        self.states = states
        self.groups = [s.group for s in states if s.group is not None]
        self.in_backward = False
        self.fwd_order: list[ParamGroup] = []
        self.post_fwd_order: list[ParamGroup] = []
        self.reductions: deque[_Reduction] = deque()
        self.pending_d2h = False

    # ---- reductions ------------------------------------------------------------

    def add_reduction(self, reduction: _Reduction) -> None:
        """Queue a reduction and push every older one but the newest
        ``max_inflight`` a stage on (wait its reduce-scatter, start its HSDP
        all-reduce, or land its gradients): gradients land as early as they
        can while few groups' gradient buffers are alive."""
        q = self.reductions
        q.append(reduction)
        for old in list(q)[: -reduction.group.max_inflight]:
            if old.advance():
                q.remove(old)

    def drain_reductions(self) -> None:
        q = self.reductions
        while q:
            if q[0].advance():
                q.popleft()

    # ---- step boundaries -------------------------------------------------------

    def begin_forward(self) -> None:
        self.fwd_order = []
        self.post_fwd_order = []
        for g in self.groups:
            if g.sharded_state is Sharded.SMALL:  # its backward never came: may be stale
                g.reshard()
            if g.sharded_state is Sharded.SHARDED and g.hooks_patched():
                g.adopt_patched_hooks()  # all-gather hooks given to local tensors since

    def end_forward(self) -> None:
        """Link each group to the one that ran after it (next step's implicit
        forward prefetch) and cancel all-gathers prefetched for groups that did
        not run."""
        order = self.fwd_order
        seen: set[int] = set()
        for i, g in enumerate(order):
            if id(g) in seen:
                continue
            seen.add(id(g))
            g.fwd_next = [order[i + 1]] if i + 1 < len(order) else []
        for g in self.groups:
            if g._pending_ag is not None:
                g.reshard()

    def begin_backward(self) -> None:
        self.in_backward = True
        order = self.post_fwd_order
        for i, g in enumerate(order):  # later occurrences win: backward runs them first
            g.bwd_next = [order[i - 1]] if i > 0 else []
        Variable._execution_engine.queue_callback(self.finish_backward)

    def reset(self) -> None:
        """Recover from an exception mid-step (``reset_iter_state``)."""
        for r in self.reductions:
            r.pending.wait()
        self.reductions.clear()
        for g in self.groups:
            g.reshard()
            g.discard_grads()
            g.reset_step()
        self.in_backward = False
        self.fwd_order = []
        self.post_fwd_order = []

    def finish_backward(self) -> None:
        """The root's final callback: see [Note: one step]."""
        for g in self.groups:
            if g.has_unreduced_grads():  # reduce, or (no sync) accumulate in reduce_dtype
                g.post_backward()
        self.drain_reductions()
        if self.pending_d2h:  # offloaded grads copied asynchronously into pinned memory
            torch.accelerator.synchronize()
            self.pending_d2h = False
        for g in self.groups:
            if g.reshard_after_backward:
                g.reshard()
            g.reset_step()
        self.in_backward = False
        for st in self.states:
            for callback in st.backward_end_callbacks:
                callback()


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs after the module's."""

    @staticmethod
    def forward(ctx, state: FSDPState, *inputs: torch.Tensor):  # type: ignore[override]
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.state._post_backward_node_done()
        return (None, *grads)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


class FSDPState:
    """The hooks of one ``fully_shard`` call (one or several modules, one group)."""

    def __init__(
        self,
        modules: list[nn.Module],
        group: ParamGroup | None,
        mp_policy: MixedPrecisionPolicy,
        device: torch.device,
        auto_reshard: bool,
    ) -> None:
        self.modules = modules
        self.group = group
        self.mp_policy = mp_policy
        self.device = device
        self.auto_reshard = auto_reshard
        self.ctx: StepContext | None = None
        self.is_root = False
        self.post_optim_event: torch.Event | None = None
        self.backward_end_callbacks: list[Callable[[], None]] = []  # see _seam.on_backward_end
        self._fwd_left: set[int] = set()
        self.handles = []
        for m in modules:
            m.__dict__[STATE_ATTR] = self
            self.handles.append(
                m.register_forward_pre_hook(
                    _eager(self._pre_forward), prepend=True, with_kwargs=True
                )
            )
            self.handles.append(m.register_forward_hook(_eager(self._post_forward)))

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
        _validate_tree(states)
        for st in states:  # parameters replaced since fully_shard (e.g. after to_empty)
            if st.group is not None:
                st.group.adopt_registered()
        _check_materialized(states, self.modules)
        ctx = StepContext(states)
        for st in states:
            st.ctx = ctx
            st.is_root = st is self
            if st.group is not None:
                st.group.ctx = ctx
                st.group.adopt_patched_hooks()
        if self.auto_reshard and self.group is not None:
            # Its backward comes first: keep the root's params through it.
            self.group.set_post_forward(False)

    # ---- forward -------------------------------------------------------------------

    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ctx = self.ctx
        if ctx is None:
            self._lazy_init()
            ctx = self.ctx
            assert ctx is not None
        if self.is_root and not ctx.in_backward:
            ctx.begin_forward()
            if self.post_optim_event is not None:
                torch.accelerator.current_stream(self.device).wait_event(self.post_optim_event)
                self.post_optim_event = None
            if self.device.type != "cpu":
                args, kwargs = tree_map(self._to_device, (args, kwargs))
        g = self.group
        if g is not None:
            if ctx.in_backward:  # activation-checkpoint recompute
                g.wait_for_unshard()
            else:
                ctx.fwd_order.append(g)
                g.unshard()
                for nxt in g.fwd_prefetch if g.fwd_prefetch is not None else g.fwd_next:
                    nxt.unshard()
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
        assert self.group is not None
        if args and not kwargs and all(type(a) is torch.Tensor and a.requires_grad for a in args):
            self.group.post_backward_pending += 1  # the common case: (x,) needing grad
            return _PostBackward.apply(self, *args), kwargs
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not idx:
            # This call's backward (if any) cannot be seen finishing: leave the
            # group's reduction to the final callback (see _post_backward_node_done).
            self.group.untracked_calls += 1
            return args, kwargs
        outs = _PostBackward.apply(self, *(flat[i] for i in idx))
        for i, t in zip(idx, outs, strict=True):
            flat[i] = t
        self.group.post_backward_pending += 1
        return tree_unflatten(flat, spec)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        ctx = self.ctx
        assert ctx is not None
        if ctx.in_backward:  # activation-checkpoint recompute: same output as the forward
            return self._cast_output(output)
        g = self.group
        training = torch.is_grad_enabled()
        if g is not None:
            if len(self.modules) > 1:
                left = self._fwd_left or {id(m) for m in self.modules}
                left.discard(id(module))
                self._fwd_left = left
                done = not left
            else:
                done = True
            if done:
                if training:
                    g.after_forward()
                else:
                    g.reshard()
            if training:
                ctx.post_fwd_order.append(g)
        if training:
            self._register_pre_backward(output)
        if self.is_root:
            ctx.end_forward()
            if not training:
                for other in ctx.groups:
                    other.reshard()
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

    def _pre_backward(self, *unused: Any) -> None:
        ctx = self.ctx
        assert ctx is not None
        if not ctx.in_backward:
            ctx.begin_backward()
        g = self.group
        if g is None or not g.unshard_in_backward:
            return
        # Even after this group's post-backward (e.g. an earlier call whose
        # inputs needed no grad registered no post-backward node): gather again;
        # the final callback reduces what arrives afterwards.
        g.unshard()
        for nxt in g.bwd_prefetch if g.bwd_prefetch is not None else g.bwd_next:
            # A group with no trainable params whose inputs needed no grad has
            # no backward at all: do not gather it.
            if (
                not nxt.backward_done
                and nxt.unshard_in_backward
                and (nxt._grad_params or nxt.post_backward_pending)
            ):
                nxt.unshard()
        g.wait_for_unshard()

    def _post_backward_node_done(self) -> None:
        g = self.group
        assert g is not None
        g.post_backward_pending -= 1
        # A call whose inputs needed no grad registered no node, yet its
        # backward may still be to come (fully_shard([a, b]) with ``a`` on the
        # data, or a module reused on the data): reduce once, at the end.
        if g.post_backward_pending <= 0 and not g.backward_done and not g.untracked_calls:
            g.post_backward()


def _check_materialized(states: list[FSDPState], roots: list[nn.Module]) -> None:
    """Parameters left on the meta device cannot be gathered: say which (full names),
    before any collective (torch's FSDP2 raises RuntimeError here too)."""
    meta = [p.sharded for st in states if st.group for p in st.group.params if p.sharded.is_meta]
    if meta:
        names = {id(t): n for root in roots for n, t in root.named_parameters()}
        on_meta = [names.get(id(t), "?") for t in meta]
        listing = ", ".join(on_meta[:20]) + (
            f" and {len(on_meta) - 20} more" if len(on_meta) > 20 else ""
        )
        raise RuntimeError(
            f"fully_shard parameters must be materialized before the first forward, but these "
            f"are still on the meta device: {listing}. Call model.to_empty(device=...) and then "
            "initialize them (e.g. reset_parameters() on each module, or your init_weights())"
        )


def _validate_tree(states: list[FSDPState]) -> None:
    owner: dict[int, str] = {}
    devices: dict[torch.device, str] = {}
    for st in states:
        if st.group is None:
            continue
        g = st.group
        devices.setdefault(g.device, g.name)
        for p in g.params:
            key = id(p.sharded)
            if key in owner and owner[key] != g.name:
                raise ValueError(
                    f"parameter {p.fqn} is managed by both fully_shard({owner[key]}) and "
                    f"fully_shard({g.name}); group the modules that share it in one call: "
                    "fully_shard([a, b])"
                )
            owner[key] = g.name
    if len(devices) > 1:
        listing = ", ".join(f"{name} on {dev}" for dev, name in devices.items())
        raise ValueError(
            f"all fully_shard groups under one root must use one device, got {listing}; "
            "pass the same mesh (or meshes on the same device type) to every fully_shard call"
        )
