"""The classes a ``fully_shard_traced`` module and its parameter owners get."""

from __future__ import annotations

from typing import Any, NoReturn

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from fsdp2.traced._gather import _Plan, arm, drop_sums, gather, gather_tied, set_sync

_PLAN = "_fsdp2_traced_plan"  # the instance attribute holding a module's _Plan
_SLOTS = "_fsdp2_traced_slots"  # an owner's {parameter name: its slot in the plan}


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
        if _gathers(plan):  # the DTensor is not read: [Note: traced leaves]
            return gather(plan, getattr(self, _SLOTS)[name])
        param = self._parameters[name]
        assert param is not None
        return param

    return property(get)


class _Rearming(nn.Module):
    """Mixed into an owner's class: its ``register_parameter`` (``setattr``,
    ``load_state_dict(assign=True)``) and ``_apply`` (``to``, ``to_empty``, ``float``...)
    re-arm the managed parameters they replace. See [Note: traced leaves]."""

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        super().register_parameter(name, param)
        slots: dict[str, int] | None = self.__dict__.get(_SLOTS)
        if slots is not None and name in slots:
            if param is None:
                raise ValueError(
                    f"{type(self).__name__}.{name} is managed by fully_shard_traced: it "
                    "cannot be set to None"
                )
            arm(getattr(self, _PLAN), slots[name], param)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._apply(*args, **kwargs)
        plan: _Plan = getattr(self, _PLAN)
        for name, slot in getattr(self, _SLOTS).items():
            param = self._parameters[name]
            assert param is not None
            arm(plan, slot, param)
        return out


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
    ``output_dtype`` (``MixedPrecisionPolicy``), in the graph. Of eager ``FSDPModule``'s
    step controls it has ``set_requires_gradient_sync`` (and ``zero_grad`` drops the no-sync
    sums); the others have no traced counterpart: each raises ``NotImplementedError``
    rather than being ignored.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        plan: _Plan = getattr(self, _PLAN)
        if plan.cast_inputs:
            args, kwargs = _cast(plan.param_dtype, (args, kwargs))
        outermost = plan.active == 0
        if outermost:  # tied parameters gathered once: [Note: traced gathers]
            plan.forward_sync = plan.sync
            plan.cache = gather_tied(plan) if plan.tied else None
        plan.active += 1
        try:
            out = super().forward(*args, **kwargs)
        finally:
            plan.active -= 1
            if outermost:
                plan.cache = None
        return _cast(plan.output_dtype, out)

    def _plans(self, recurse: bool) -> list[_Plan]:
        """This call's plan, and with ``recurse`` those of the calls on its submodules."""
        if not recurse:
            return [getattr(self, _PLAN)]
        plans: dict[int, _Plan] = {}
        for mod in self.modules():
            plan = getattr(mod, _PLAN, None)
            if plan is not None:
                plans.setdefault(id(plan), plan)
        return list(plans.values())

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward reduces gradients, as ``FSDPModule.set_requires_gradient_sync``:
        ``False`` accumulates the unsharded gradients locally (in ``reduce_dtype`` if set),
        with no collective in the backward graph, until a backward with ``True`` adds their
        sum before reducing. Unlike eager fsdp2 the mode is read by the forward (set it
        before the forward of the micro-batch); compiled, each mode is its own graph (one
        recompile). See [Note: traced accumulation]."""
        for plan in self._plans(recurse):
            set_sync(plan, bool(requires_gradient_sync))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, and the no-sync sums not yet reduced (as eager
        fsdp2's ``zero_grad`` clears its pending gradients)."""
        super().zero_grad(set_to_none)
        for plan in self._plans(True):
            drop_sums(plan)

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
        bases = ((TracedModule,) if root else ()) + ((_Rearming,) if names else ()) + (base,)
        _CLASSES[key] = type(f"Traced{base.__name__}", bases, props)
    return _CLASSES[key]
