"""The gathers of fsdp2's traced mode: all-gather forward, reduce-scatter backward.

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

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp2.api import MixedPrecisionPolicy


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
