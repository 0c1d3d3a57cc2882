"""The gathers of fsdp2's traced mode: all-gather forward, reduce-scatter backward.

[Note: traced gathers]
Each module that owns a managed parameter gets a class of its own (cached per base class and
parameter names) with a property per parameter name: reading ``module.weight`` inside the
forward of the ``fully_shard_traced`` call that manages it (``_Plan.active``; uncompiled,
also inside a backward, where activation checkpointing recomputes) returns the gathered
(unsharded) parameter, and elsewhere the sharded DTensor, as eager ``fully_shard`` has it
between steps. ``module._parameters["weight"]`` (what ``named_parameters()``,
``state_dict()``, ``load_state_dict()`` and the optimizer see) is always the sharded
DTensor. The gather is ``_Unshard``: forward casts the local shard to ``param_dtype`` and
all-gathers it over the mesh's shard dim (padded to torch.chunk's equal rows, then narrowed);
backward casts the gradient to ``reduce_dtype``, reduce-scatters it over the shard dim and,
on a 2D (HSDP) mesh, all-reduces it over the replicate dim (a sum divided by the
data-parallel size: eager fsdp2's average on gloo) and casts it to the parameter's dtype:
the gradient of the local shard, which becomes the parameter's gradient DTensor ([Note:
traced leaves]).
A parameter ``shard_placement_fn`` placed ``Shard(d)`` is gathered and reduced along dim
``d`` (moved to the front around the collectives: ``_Layout.dim``); one placed
``Replicate()`` is whole on every rank: no gather, its gradient all-reduced over the shard
dim (and the replicate dim) and averaged, as eager fsdp2's replicated groups.
``reshard_after_forward=True`` runs the gather under ``torch.utils.checkpoint`` with a policy
that recomputes the collectives when compiled, so backward all-gathers again instead of
saving the unsharded parameter (SimpleFSDP's way, arXiv 2411.00284).

A tied parameter (registered on several modules of one call, as a tied embedding and head)
is gathered once per forward of the call root: the root's forward gathers it at entry into
``_Plan.cache`` (dropped at exit) and every read returns that one tensor, so autograd sums
the reads' gradients before the one reduce-scatter, as eager fsdp2 does. Under
``torch.compile`` the dict is Python state of the traced frame (dynamo folds it away: the
graph uses one value twice). It is filled at entry, not at the first read, because a read
may lie inside an activation-checkpointed region, which dynamo traces as a higher-order op
that may not mutate state from outside it; reads only look it up. The cost: a tied
parameter is gathered even in a forward that does not read it.

[Note: traced tensor parallel]
A parameter that is a DTensor already (``parallelize_module`` on a TP mesh that is another
dimension of the data-parallel mesh's root) is sharded as eager ``fully_shard`` shards it:
its TP-local tensor is split over the data-parallel shard dim (torch.chunk's rows), and the
sharded parameter is a DTensor on the concatenated (dp..., tp...) mesh, with
``_StridedShard(0, split_factor=tp)`` where TP shards dim 0 too (so ``full_tensor()`` and
the state dict are eager's). The gather all-gathers the TP-local tensor over the
data-parallel dim only and wraps it with ``DTensor.from_local`` on the TP mesh, so the
module computes on the DTensor that TP expects; ``from_local``'s backward turns the
gradient back to the TP placements (a ``Partial`` one all-reduced over the TP mesh, in the
compute dtype) and ``_Unshard`` reduces that TP-local gradient over the data-parallel dims.

[Note: traced accumulation]
``set_requires_gradient_sync(False)`` sets ``_Plan.sync`` false. A read then gathers through
``_UnshardNoSync`` instead: its forward all-gathers the local shard detached from the
parameter, and its backward hands the whole unsharded gradient (cast to the accumulation
dtype: ``reduce_dtype``, else ``param_dtype``, else the parameter's) to a sink: a leaf tensor
of the unsharded shape per parameter (``_Plan.accs``, made at the first
``set_requires_gradient_sync(False)``: zero stride, no memory), so autograd's own
``AccumulateGrad`` sums the micro-batches in ``sink.grad``, outside the graph and with no
collective. A synced read passes ``sink.grad`` (when set) into ``_Unshard``, whose backward
adds it to the gradient before reducing. The leaf's post-accumulate-grad hook (``_Landed``,
[Note: traced leaves]) drops ``sink.grad`` once the synced gradient landed; so does
``TracedModule.zero_grad``. A mode changed between a forward and its backward is refused
(``_Plan.forward_sync``) by the first hook that runs: a leaf's (a synced graph) or a sink's
(``_Summed``, a no-sync graph). Under
``torch.compile`` the mode and whether a sum is pending are read in the forward, so dynamo
guards on them: a no-sync graph, a synced graph adding the sums and a plain synced graph,
each compiled once, at its first use.

[Note: traced leaves]
The graphs' inputs are the parameters' local shards, plain tensors, not the sharded
DTensors: ``_Plan.locals[slot]`` is the DTensor parameter's ``_local_tensor`` itself (its
storage: the optimizer's in-place updates and ``load_state_dict``'s copies are what the graph
reads), made a leaf that requires grad; the read (``_unshard``) never touches the DTensor.
A DTensor input costs per step, compiled: dynamo's guard on its spec (a Python check per
parameter) and AOTAutograd's unwrapping of it and wrapping of its gradient
(``__tensor_unflatten__``): at 128 parameters, 4 of the 7 ms of the overhead benchmark's
step (benchmarks/overhead.py --traced). It also kept the ``DeviceMesh`` among the values
saved for backward, which torch 2.13's RNG functionalization misplaces when a checkpointed
region recomputes a random op (docs/compile.md). The leaf's gradient (the reduce-scatter's
output) lands by ``AccumulateGrad`` on ``local.grad``; the leaf's post-accumulate-grad hook
(``_Landed``) moves it to the parameter: a DTensor of the parameter's spec, or added to the
gradient there; then it runs the parameter's own post-accumulate-grad hooks (as torch's
FSDP2 runs them when a gradient lands) and drops a spent no-sync sum.

Keeping the leaves right (``arm``): a parameter replaced through its module (``setattr``,
``load_state_dict(assign=True)``: the owner class's ``register_parameter``) or whose local
tensor was replaced (``to``, ``to_empty``, ``float``: ``_apply`` swaps the DTensor's
contents) is re-armed; a tied parameter replaced through one of its modules is replaced in
all of them (it stays tied); a DTensor of other placements is refused. A replacement the
module does not see (``module._parameters[name] = ...``) cannot reach the compiled graph,
which guards on the leaves' metadata, not on the parameters: the hook finds that the
parameter it would give the gradient to is no longer its module's, and raises. Frozen
parameters: the graph reads ``requires_grad`` from the leaf, so a parameter frozen after a
graph was made still gets a gradient computed in it, once: the hook drops it (no ``.grad``,
as eager) and sets ``_Plan.watch[slot]``; from then on the read looks at the DTensor's
``requires_grad`` (dynamo guards on it: unfreezing recompiles; while frozen the leaf is read
detached). Parameters frozen at sharding are watched from the start. A watched parameter
costs its DTensor's guard; the others cost none.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from fsdp2.api import MixedPrecisionPolicy

_FUNCTIONAL = torch.ops._c10d_functional


class _Plan:
    """One ``fully_shard_traced`` call: how it gathers and reduces (fixed at sharding), its
    parameters by slot, and the little state a step reads (the sync flag, the no-sync
    sums' sinks, the per-forward gather cache). See [Note: traced gathers]."""

    def __init__(
        self, name: str, mesh: DeviceMesh, reshard: bool, mp: MixedPrecisionPolicy
    ) -> None:
        self.name = name  # the call root's class, for messages
        shard = mesh.ndim - 1  # HSDP: dim 0 replicates, dim 1 shards (as fully_shard)
        self.group_name: str = mesh.get_group(shard).group_name
        self.world: int = mesh.size(shard)
        self.rank: int = mesh.get_local_rank(shard)
        self.replicate_name: str | None = None
        self.replicas = 1
        if mesh.ndim == 2 and mesh.size(0) > 1:
            self.replicate_name = mesh.get_group(0).group_name
            self.replicas = mesh.size(0)
        self.reshard = reshard
        self.param_dtype = mp.param_dtype
        self.reduce_dtype = mp.reduce_dtype
        self.output_dtype = mp.output_dtype
        self.cast_inputs = mp.cast_forward_inputs and mp.param_dtype is not None
        self.active = 0  # > 0 inside the call root's forward: reads gather
        self.cache: dict[int, torch.Tensor] | None = None  # slot -> gathered, in that forward
        self.sync = True  # set_requires_gradient_sync; see [Note: traced accumulation]
        self.forward_sync = True  # ``sync`` when the call root's last forward began
        self.params: list[DTensor] = []  # the sharded parameters (DTensor Parameters), by slot
        self.locals: list[torch.Tensor] = []  # their local shards, the leaves the graph reads
        self.watch: list[bool] = []  # read the parameter's requires_grad (frozen once), by slot
        self.layouts: list[_Layout] = []  # what each one gathers into, by slot
        self.tied: list[int] = []  # slots of parameters registered on several modules
        self.homes: list[list[tuple[nn.Module, str]]] = []  # (module, name) of each, by slot
        self.fqns: list[str] = []  # each parameter's name in the call root, for messages
        self.accs: list[torch.Tensor | None] = []  # the no-sync sums' sinks, by slot


class _Layout:
    """One parameter's unsharded form: ``shape``, the dim its shards split (``dim``,
    ``shard_placement_fn``'s ``Shard(dim)``; 0 by default) or none (``replicated``:
    ``Replicate()``, whole on every rank), and for a tensor-parallel parameter the TP mesh,
    placements, global shape and stride that wrap it back into the DTensor the module
    computes with. See [Note: traced tensor parallel]."""

    def __init__(
        self,
        shape: torch.Size,
        tp: tuple[DeviceMesh, tuple[Placement, ...], torch.Size, tuple[int, ...]] | None = None,
        dim: int = 0,
        replicated: bool = False,
    ) -> None:
        self.shape, self.tp, self.dim, self.replicated = shape, tp, dim, replicated


def _rows(plan: _Plan, size: int) -> tuple[int, int]:
    """torch.chunk's rows per rank, and this rank's (fewer on trailing ranks)."""
    per_rank = -(-size // plan.world)
    return per_rank, max(0, min(per_rank, size - plan.rank * per_rank))


def _all_gather(local: torch.Tensor, plan: _Plan, layout: _Layout) -> torch.Tensor:
    x = local if plan.param_dtype is None else local.to(plan.param_dtype)
    if plan.world == 1 or layout.replicated:  # the local tensor is the whole parameter
        return x.view_as(x) if x is local else x
    d, size = layout.dim, layout.shape[layout.dim]
    per_rank, held = _rows(plan, size)
    if d:  # Shard(d): gather the shards' dim d as rows (even: no padding, as fully_shard)
        x = x.movedim(d, 0)
    if held != per_rank:
        x = torch.cat([x, x.new_zeros((per_rank - held, *x.shape[1:]))])
    full: torch.Tensor = _FUNCTIONAL.all_gather_into_tensor(
        x.contiguous(), plan.world, plan.group_name
    )
    full = _FUNCTIONAL.wait_tensor(full)
    if full.shape[0] != size:
        full = full[:size]
    return full.movedim(0, d).contiguous() if d else full


def _reduce(g: torch.Tensor, plan: _Plan, layout: _Layout) -> torch.Tensor:
    """Reduce-scatter ``g`` over the shard dim (all-reduce it, for a replicated parameter),
    all-reduce over the replicate dim (HSDP), averaged over both; this rank's shard."""
    pre, post = _divide(plan.world * plan.replicas, g.dtype)
    if pre != 1:
        g = g / pre
    d, size = layout.dim, layout.shape[layout.dim]
    per_rank, held = _rows(plan, size)
    if layout.replicated:
        out = g
        if plan.world > 1:
            out = _FUNCTIONAL.wait_tensor(_FUNCTIONAL.all_reduce(g, "sum", plan.group_name))
    else:
        if d:
            g = g.movedim(d, 0)
        pad = per_rank * plan.world - size
        if pad:
            g = torch.cat([g, g.new_zeros((pad, *g.shape[1:]))])
        out = g
        if plan.world > 1:  # (one shard rank: nothing to scatter)
            out = _FUNCTIONAL.reduce_scatter_tensor(
                g.contiguous(), "sum", plan.world, plan.group_name
            )
            out = _FUNCTIONAL.wait_tensor(out)
    if plan.replicate_name is not None:
        out = _FUNCTIONAL.wait_tensor(_FUNCTIONAL.all_reduce(out, "sum", plan.replicate_name))
    if post != 1:
        out = out / post
    if not layout.replicated and held != per_rank:
        out = out[:held]
    return out.movedim(0, d).contiguous() if d and not layout.replicated else out


class _Unshard(torch.autograd.Function):
    """All-gather a local ``Shard(0)`` piece; backward: add the no-sync sum (if any) to its
    gradient and reduce it. See [Note: traced gathers]."""

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, pending: torch.Tensor | None, plan: _Plan, layout: _Layout
    ) -> torch.Tensor:
        ctx.plan, ctx.layout, ctx.orig_dtype = plan, layout, local.dtype
        ctx.pending = pending is not None
        if pending is not None:
            ctx.save_for_backward(pending)
        return _all_gather(local, plan, layout)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        plan = ctx.plan
        g = grad if plan.reduce_dtype is None else grad.to(plan.reduce_dtype)
        if ctx.pending:
            (pending,) = ctx.saved_tensors
            g = g + pending.to(g.dtype)
        return _reduce(g, plan, ctx.layout).to(ctx.orig_dtype), None, None, None


class _UnshardNoSync(torch.autograd.Function):
    """All-gather a local piece (detached); backward: the unsharded gradient goes to the
    sink ``acc``, no collective. See [Note: traced accumulation]."""

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, acc: torch.Tensor, plan: _Plan, layout: _Layout
    ) -> torch.Tensor:
        ctx.acc_dtype = acc.dtype
        return _all_gather(local, plan, layout)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:
        return None, grad.to(ctx.acc_dtype), None, None


def _divide(world: int, dtype: torch.dtype) -> tuple[float, float]:
    """Divide before and after the sum: all after for fp32/bf16/fp64 (eager fsdp2's
    average), split around it for fp16 so neither overflows nor underflows."""
    if dtype != torch.float16:
        return 1, world
    pre = 1
    while world % pre == 0 and world / pre > pre:
        pre *= 2
    return pre, world / pre


def _recompute_collectives() -> Any:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = {_FUNCTIONAL.all_gather_into_tensor.default, _FUNCTIONAL.wait_tensor.default}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_RECOMPUTE if op in ops else CheckpointPolicy.PREFER_SAVE

    return create_selective_checkpoint_contexts(policy)


def _unshard(plan: _Plan, slot: int) -> torch.Tensor:
    local = plan.locals[slot]  # compiled: a plain tensor input, see [Note: traced leaves]
    if plan.watch[slot] and not plan.params[slot].requires_grad:
        local = local.detach()
    layout = plan.layouts[slot]
    acc = plan.accs[slot]
    fn: Any
    if plan.sync:
        fn, extra = _Unshard.apply, (None if acc is None else acc.grad)
    else:
        assert acc is not None, "set_requires_gradient_sync(False) makes the sinks"
        fn, extra, local = _UnshardNoSync.apply, acc, local.detach()
    out: torch.Tensor
    if plan.reshard and torch.compiler.is_compiling():
        from torch.utils.checkpoint import checkpoint

        out = checkpoint(
            fn, local, extra, plan, layout, use_reentrant=False, context_fn=_recompute_collectives
        )
    else:
        out = fn(local, extra, plan, layout)
    if layout.tp is None:
        return out
    mesh, placements, shape, stride = layout.tp
    return DTensor.from_local(out, mesh, placements, run_check=False, shape=shape, stride=stride)


def gather(plan: _Plan, slot: int) -> torch.Tensor:
    """The unsharded value of ``plan``'s parameter ``slot`` for this read: a tied parameter's
    gather of this forward of the call root, else a gather of its own."""
    cache = plan.cache
    if cache is not None and slot in cache:
        return cache[slot]
    return _unshard(plan, slot)


def gather_tied(plan: _Plan) -> dict[int, torch.Tensor]:
    """The call root's forward begins: gather each tied parameter once for all its reads.
    See [Note: traced gathers]."""
    return {slot: _unshard(plan, slot) for slot in plan.tied}


def arm(plan: _Plan, slot: int, param: torch.Tensor) -> None:
    """Make ``param`` (a sharded DTensor) slot ``slot``'s parameter and its local shard the
    leaf the graph reads, with the hook that hands the leaf's gradient to ``param``. At
    sharding, and again wherever the parameter or its local tensor is replaced
    (``load_state_dict(assign=True)``, ``to_empty``, ``module.to``). See [Note: traced leaves]."""
    if slot < len(plan.params):
        old = plan.params[slot]
        if not isinstance(param, DTensor) or (param.device_mesh, param.placements) != (
            old.device_mesh,
            old.placements,
        ):
            what = type(param).__name__
            if isinstance(param, DTensor):
                what = f"DTensor {param.placements} on {param.device_mesh}"
            raise ValueError(
                f"fully_shard_traced({plan.name}): parameter {plan.fqns[slot]!r} was replaced "
                f"by a {what}; assign a DTensor of its mesh and placements ({old.placements} "
                f"on {old.device_mesh}), as state_dict() gives"
            )
    assert isinstance(param, DTensor)
    if slot == len(plan.params):
        plan.params.append(param)
        plan.locals.append(param._local_tensor)
        plan.watch.append(True)
    local = param._local_tensor
    plan.params[slot] = param
    for module, name in plan.homes[slot]:  # a tied parameter stays tied: all its modules
        module._parameters[name] = param  # type: ignore[assignment]
    plan.watch[slot] = not param.requires_grad
    if _grads(local) and not (local is plan.locals[slot] and local.requires_grad):
        local.requires_grad_(True)  # (a frozen parameter's is read detached: _unshard)
        local.register_post_accumulate_grad_hook(_Landed(plan, slot))
    plan.locals[slot] = local


def _grads(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def set_sync(plan: _Plan, sync: bool) -> None:
    """``set_requires_gradient_sync`` for one call: the flag, and the sinks the first time
    it turns off. See [Note: traced accumulation]."""
    plan.sync = sync
    if sync:
        return
    for slot, p in enumerate(plan.params):
        if plan.accs[slot] is not None:
            continue
        local = plan.locals[slot]
        dtype = plan.reduce_dtype or plan.param_dtype or p.dtype
        shape = plan.layouts[slot].shape
        strides = (0,) * len(shape)  # one element of storage: the sink only collects .grad
        sink = local.new_empty_strided(shape, strides, dtype=dtype).zero_().requires_grad_()
        sink.register_post_accumulate_grad_hook(_Summed(plan))
        plan.accs[slot] = sink


def drop_sums(plan: _Plan) -> None:
    """Forget the no-sync sums (``zero_grad``)."""
    for sink in plan.accs:
        if sink is not None:
            sink.grad = None


class _Landed:
    """A local leaf's post-accumulate-grad hook: its synced gradient becomes the parameter's
    (a DTensor of its spec, added to a gradient already there; dropped if the parameter was
    frozen since), the parameter's own post-accumulate-grad hooks run, and the no-sync sum
    it carried is spent. See [Note: traced leaves]."""

    __slots__ = ("plan", "slot")

    def __init__(self, plan: _Plan, slot: int) -> None:
        self.plan, self.slot = plan, slot

    def __call__(self, local: torch.Tensor) -> None:
        plan, slot = self.plan, self.slot
        if plan.sync != plan.forward_sync:
            _mode_changed(plan)
        grad, local.grad = local.grad, None
        if grad is None:  # compiled, autograd runs it for every input: a no-sync one's too
            return
        param = plan.params[slot]
        module, name = plan.homes[slot][0]
        current: object = module._parameters.get(name)
        if local is not param._local_tensor or current is not param:
            raise RuntimeError(
                f"fully_shard_traced({plan.name}): parameter {plan.fqns[slot]!r} was replaced "
                "behind its module's back (not by setattr, load_state_dict, to or to_empty): "
                "the graph read the old one, whose gradient has nowhere to go. Replace "
                "parameters through the module"
            )
        if not param.requires_grad:  # frozen after the graph was made: read it from now on
            plan.watch[slot] = True
            return
        if param.grad is None:
            param.grad = _dtensor(DTensor, grad, param._spec, requires_grad=False)
        else:
            param.grad._local_tensor.add_(grad)  # type: ignore[attr-defined]
        hooks = param._post_accumulate_grad_hooks
        if hooks:
            for hook in list(hooks.values()):
                hook(param)
        sink = plan.accs[slot]
        if sink is not None:
            sink.grad = None


# ``DTensor(local, spec, requires_grad=)`` without its ``__init__`` (a no-op behind a
# dynamo-disable wrapper): a third of the cost, per parameter per step.
_dtensor = torch.Tensor._dtensor__new__


class _Summed:
    """A sink's post-accumulate-grad hook: a no-sync backward ran the mode its forward chose."""

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan

    def __call__(self, sink: torch.Tensor) -> None:
        if self.plan.sync != self.plan.forward_sync:
            _mode_changed(self.plan)


def _mode_changed(plan: _Plan) -> NoReturn:
    """Backward runs the mode its forward chose; refuse a mode changed in between."""
    raise RuntimeError(
        f"fully_shard_traced({plan.name}): set_requires_gradient_sync({plan.sync}) was "
        "called between a forward and its backward; the traced mode reads it in the "
        "forward (its graph reduces or not): call it before the micro-batch's forward"
    )
