"""fsdp2's traced mode (first slice): the all-gathers and reduce-scatters as graph ops.

``fully_shard_traced(module, mesh=...)`` shards ``module``'s parameters as eager
``fully_shard`` does (``Shard(0)`` DTensors on the same mesh, the same ``state_dict``), but
gathers each parameter where the module reads it (``module.weight``), through torch's
functional collectives (``torch.ops._c10d_functional``) inside a small autograd function
whose backward reduce-scatters the gradient. There is no hook, no storage move and no
Python-side state per step, so ``torch.compile(model, fullgraph=True)`` captures the
collectives in the forward and backward graphs. docs/compile.md, "Traced mode".

[Note: traced gathers]
Each module that owns a managed parameter gets a class of its own (cached per base class and
parameter names) with a property per parameter name: reading ``module.weight`` inside the
forward of the ``fully_shard_traced`` call that manages it (``_Plan.active``; uncompiled,
also inside a backward, where activation checkpointing recomputes) returns the gathered
(unsharded) parameter, and elsewhere the sharded DTensor, as eager ``fully_shard`` has it
between steps. ``module._parameters["weight"]`` (what ``named_parameters()``,
``state_dict()``, ``load_state_dict()`` and the optimizer see) is always the sharded
DTensor. The gather is ``_Unshard``: forward casts the local shard to
``param_dtype`` and all-gathers it (padded to torch.chunk's equal rows, then narrowed),
backward casts the gradient to ``reduce_dtype``, reduce-scatters it (a sum divided by the
mesh size: eager fsdp2's average on gloo) and casts it to the parameter's dtype; the
DTensor's ``to_local`` turns that into a ``Shard(0)`` DTensor gradient.
``reshard_after_forward=True`` runs the gather under ``torch.utils.checkpoint`` with a policy
that recomputes the collectives when compiled, so backward all-gathers again instead of
saving the unsharded parameter (SimpleFSDP's way, arXiv 2411.00284).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils._pytree import tree_map

from fsdp2._core.front.sharding import FSDPModule
from fsdp2._core.support.mesh import default_mesh
from fsdp2.api import MixedPrecisionPolicy, OffloadPolicy

__all__ = ["TracedModule", "fully_shard_traced"]

_PLAN = "_fsdp2_traced_plan"  # the instance attribute holding a module's _Plan


class _Plan:
    """How one ``fully_shard_traced`` call gathers and reduces its parameters (constant)."""

    def __init__(self, mesh: DeviceMesh, reshard: bool, mp: MixedPrecisionPolicy) -> None:
        group = mesh.get_group()
        self.group_name: str = group.group_name
        self.world: int = mesh.size()
        self.rank: int = mesh.get_local_rank()
        self.reshard = reshard
        self.param_dtype = mp.param_dtype
        self.reduce_dtype = mp.reduce_dtype
        self.output_dtype = mp.output_dtype
        self.cast_inputs = mp.cast_forward_inputs and mp.param_dtype is not None
        self.active = 0  # > 0 inside the call root's forward: reads gather


def _rows(plan: _Plan, dim0: int) -> tuple[int, int]:
    """torch.chunk's rows per rank, and this rank's (fewer on trailing ranks)."""
    per_rank = -(-dim0 // plan.world)
    return per_rank, max(0, min(per_rank, dim0 - plan.rank * per_rank))


class _Unshard(torch.autograd.Function):
    """All-gather a local ``Shard(0)`` piece; backward: reduce-scatter its gradient.
    See [Note: traced gathers]."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, plan: _Plan, dim0: int) -> torch.Tensor:
        per_rank, held = _rows(plan, dim0)
        ctx.plan, ctx.dim0, ctx.orig_dtype = plan, dim0, local.dtype
        x = local if plan.param_dtype is None else local.to(plan.param_dtype)
        if held != per_rank:
            x = torch.cat([x, x.new_zeros((per_rank - held, *x.shape[1:]))])
        full: torch.Tensor = torch.ops._c10d_functional.all_gather_into_tensor(
            x.contiguous(), plan.world, plan.group_name
        )
        full = torch.ops._c10d_functional.wait_tensor(full)
        return full if full.shape[0] == dim0 else full[:dim0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        plan, dim0 = ctx.plan, ctx.dim0
        per_rank, held = _rows(plan, dim0)
        g = grad if plan.reduce_dtype is None else grad.to(plan.reduce_dtype)
        pad = per_rank * plan.world - dim0
        if pad:
            g = torch.cat([g, g.new_zeros((pad, *g.shape[1:]))])
        pre, post = _divide(plan.world, g.dtype)
        if pre != 1:
            g = g / pre
        out = torch.ops._c10d_functional.reduce_scatter_tensor(
            g.contiguous(), "sum", plan.world, plan.group_name
        )
        out = torch.ops._c10d_functional.wait_tensor(out)
        if post != 1:
            out = out / post
        if held != per_rank:
            out = out[:held]
        return out.to(ctx.orig_dtype), None, None


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

    ops = {
        torch.ops._c10d_functional.all_gather_into_tensor.default,
        torch.ops._c10d_functional.wait_tensor.default,
    }

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_RECOMPUTE if op in ops else CheckpointPolicy.PREFER_SAVE

    return create_selective_checkpoint_contexts(policy)


def _unshard(param: torch.Tensor, plan: _Plan) -> torch.Tensor:
    local = param.to_local() if isinstance(param, DTensor) else param
    dim0 = param.shape[0]
    if plan.reshard and torch.compiler.is_compiling():
        from torch.utils.checkpoint import checkpoint

        out: torch.Tensor = checkpoint(
            _Unshard.apply,
            local,
            plan,
            dim0,
            use_reentrant=False,
            context_fn=_recompute_collectives,
        )
        return out
    return _Unshard.apply(local, plan, dim0)  # type: ignore[no-any-return]


def _gathers(plan: _Plan) -> bool:
    """Whether a read of a managed parameter gathers it: inside its call root's forward,
    or, uncompiled, inside a backward (an activation-checkpointed region's recompute runs
    the region's forward again there, outside the root's forward)."""
    if plan.active:
        return True
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _gathered(name: str) -> property:
    def get(self: nn.Module) -> torch.Tensor:
        plan: _Plan = getattr(self, _PLAN)
        param = self._parameters[name]
        assert param is not None
        return _unshard(param, plan) if _gathers(plan) else param

    return property(get)


def _cast(dtype: torch.dtype | None, tree: Any) -> Any:
    if dtype is None:
        return tree
    return tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        tree,
    )


class TracedModule(nn.Module):
    """The class a ``fully_shard_traced`` module gets (mixed in before its own).

    Its forward casts floating-point inputs to ``param_dtype`` and outputs to
    ``output_dtype`` (``MixedPrecisionPolicy``), in the graph. Eager ``FSDPModule``'s
    step controls have no traced counterpart yet: each raises ``NotImplementedError``
    rather than being ignored.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        plan: _Plan = getattr(self, _PLAN)
        if plan.cast_inputs:
            args, kwargs = _cast(plan.param_dtype, (args, kwargs))
        plan.active += 1
        try:
            out = super().forward(*args, **kwargs)
        finally:
            plan.active -= 1
        return _cast(plan.output_dtype, out)

    def _refuse(self, what: str) -> NoReturn:
        raise NotImplementedError(
            f"{type(self).__name__}.{what}: a fully_shard_traced module has no eager step "
            "state to control (its all-gathers and reduce-scatters run in the graph); use "
            "fsdp2.fully_shard for this (docs/compile.md, 'Traced mode')"
        )

    def unshard(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("unshard")

    def reshard(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("reshard")

    def set_requires_gradient_sync(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("set_requires_gradient_sync (gradient accumulation without sync)")

    def set_modules_to_forward_prefetch(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("set_modules_to_forward_prefetch (the compiler schedules the gathers)")

    def set_modules_to_backward_prefetch(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("set_modules_to_backward_prefetch (the compiler schedules the gathers)")

    def set_reshard_after_forward(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("set_reshard_after_forward (pass reshard_after_forward= at sharding)")

    def set_reshard_after_backward(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("set_reshard_after_backward")

    def set_is_last_backward(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("set_is_last_backward")

    def set_requires_all_reduce(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("set_requires_all_reduce")


# One class per (base class, managed parameter names, call root or not), as eager fsdp2 has
# one FSDP class per base: the gather plan is per instance (``_PLAN``), not in the class.
_CLASSES: dict[tuple[type, tuple[str, ...], bool], type] = {}


def _traced_class(base: type, names: tuple[str, ...], root: bool) -> type:
    key = (base, names, root)
    if key not in _CLASSES:
        props: dict[str, Any] = {n: _gathered(n) for n in names}
        bases = (TracedModule, base) if root else (base,)
        _CLASSES[key] = type(f"Traced{base.__name__}", bases, props)
    return _CLASSES[key]


def _owned(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``root``'s modules whose parameters this call manages: not those under an earlier
    call's root (their parameters are sharded already)."""
    out, seen, stack = [], set(), [("", root)]
    while stack:
        path, mod = stack.pop()
        if id(mod) in seen or (mod is not root and hasattr(mod, _PLAN)):
            continue
        seen.add(id(mod))
        out.append((path, mod))
        for name, child in reversed(list(mod.named_children())):
            stack.append((f"{path}.{name}" if path else name, child))
    return out


def _check(
    module: nn.Module,
    mesh: DeviceMesh,
    reshard_after_forward: Any,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    unsupported: dict[str, Any],
) -> None:
    where = f"fully_shard_traced({type(module).__name__})"
    if isinstance(module, TracedModule):
        raise ValueError(f"{where}: the module is sharded by fully_shard_traced already")
    for path, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            what = "the module" if not path else f"its submodule {path!r}"
            raise ValueError(
                f"{where}: {what} is sharded by fsdp2.fully_shard already; the two modes do "
                "not mix in one model: shard every module with one of them"
            )
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"{where}: only a 1D mesh (FSDP) is traced yet, got a {mesh.ndim}D mesh (HSDP); "
            "use fsdp2.fully_shard for HSDP"
        )
    if not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"{where}: reshard_after_forward must be True or False in the traced mode, "
            f"got {reshard_after_forward!r} (no smaller-mesh copy yet)"
        )
    if mp_policy.grad_dtype is not None:
        raise NotImplementedError(f"{where}: MixedPrecisionPolicy.grad_dtype is not traced yet")
    if type(offload_policy) is not OffloadPolicy:
        raise NotImplementedError(f"{where}: offload_policy is not supported in the traced mode")
    for name, value in unsupported.items():
        if value is not None:
            raise NotImplementedError(f"{where}: {name} is not supported in the traced mode yet")


def fully_shard_traced(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008  (frozen)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008  (frozen)
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters for ``torch.compile(fullgraph=True)``: the all-gathers
    and reduce-scatters are functional collectives in the traced graphs.

    Like ``fsdp2.fully_shard``: call it on each block, then on the root; every parameter
    of ``module`` not managed by an earlier call becomes a ``Shard(0)`` DTensor on ``mesh``
    (``named_parameters()``, ``state_dict()`` and the optimizer see the same DTensors as
    with eager ``fully_shard``). Inside the forward of the module this call was made on,
    reading a managed parameter through its module (``module.weight``) all-gathers it
    (cast to ``mp_policy.param_dtype`` first), a collective every rank must make; its
    gradient is reduce-scattered in ``reduce_dtype`` and averaged over the mesh. Outside
    that forward the read returns the sharded DTensor, as with ``fully_shard``.

    Args:
        module: the module to shard; its class is swapped for a ``TracedModule``
            subclass (its forward casts inputs and outputs per ``mp_policy``).
        mesh: a 1D mesh (default: the world, as ``fully_shard``).
        reshard_after_forward: ``True``: when compiled, backward all-gathers again (the
            gather is recomputed, not saved); ``False``: the unsharded parameters are saved
            for backward. Eager (uncompiled) calls always save them.
        shard_placement_fn, ignored_params: not supported yet (``NotImplementedError``).
        mp_policy: ``param_dtype``, ``reduce_dtype``, ``output_dtype``,
            ``cast_forward_inputs`` as in ``fully_shard``; ``grad_dtype`` not yet.
        offload_policy: only ``OffloadPolicy()`` (no offload).

    Returns:
        ``module``, sharded in place.

    Raises:
        NotImplementedError: a feature the traced mode does not have yet (a 2D mesh,
            offloading, tensor-parallel DTensor parameters, 0-dim parameters, ...),
            before any collective.
        ValueError: ``module`` is sharded already (by either mode).
    """
    mesh = default_mesh() if mesh is None else mesh
    unsupported = {"shard_placement_fn": shard_placement_fn, "ignored_params": ignored_params}
    _check(module, mesh, reshard_after_forward, mp_policy, offload_policy, unsupported)
    owners = _owned(module)
    for path, mod in owners:
        for name, p in mod._parameters.items():
            fqn = f"{path}.{name}" if path else name
            if isinstance(p, DTensor):
                raise NotImplementedError(
                    f"fully_shard_traced: parameter {fqn!r} is a DTensor already (tensor "
                    "parallel?): the traced mode shards plain parameters only yet"
                )
            if p is not None and p.dim() == 0:
                raise NotImplementedError(
                    f"fully_shard_traced: parameter {fqn!r} is 0-dim; the traced mode "
                    "shards dim 0 only"
                )
    plan = _Plan(mesh, reshard_after_forward, mp_policy)
    sharded: dict[int, nn.Parameter] = {}  # a tied parameter is sharded once
    for _, mod in owners:
        names = []
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in sharded:
                dt = distribute_tensor(p.detach(), mesh, [Shard(0)])
                sharded[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            mod._parameters[name] = sharded[id(p)]
            names.append(name)
        root = mod is module
        if names or root:
            object.__setattr__(mod, _PLAN, plan)
            mod.__class__ = _traced_class(type(mod), tuple(names), root)
    return module
