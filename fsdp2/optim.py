"""Step an optimizer on the local shards of sharded parameters.

A ``torch.optim`` optimizer over ``fully_shard`` parameters steps DTensors: every
elementwise op of the update (a dozen per parameter for AdamW) goes through DTensor's
dispatch, which on small or many parameters costs several times the arithmetic itself
(64 ``Linear(16, 16)`` layers, AdamW, one rank: 23 ms against 4 ms on plain tensors).
For an *elementwise* optimizer (each element's update depends only on that element of
the parameter, its gradient and its state, plus scalars) stepping the local shards as
plain tensors gives the same numbers bit for bit, without the dispatch::

    optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
    fsdp2.optim.step_on_local_shards(optim)
    ...
    optim.step()  # runs AdamW on each parameter's local shard

Everything else about the optimizer stays as it was: ``param_groups`` hold the sharded
parameters, ``optim.state`` holds DTensor state sharded like its parameter (so
``state_dict()``, ``load_state_dict()`` and ``torch.distributed.checkpoint`` save and
reload it across world sizes and meshes), LR schedulers and ``zero_grad`` work unchanged.
Only inside ``step()`` do ``param_groups`` and ``state`` hold the local tensors; step
pre- and post-hooks run there too and see them.

Optimizers that orthogonalize or otherwise mix whole matrices cannot step shards:
``Muon`` here is ``torch.optim.Muon`` for sharded parameters (each matrix put together and
orthogonalized on one rank), ``muon_param_groups`` splits a model's parameters between it
and AdamW, and a guard installed on import refuses a ``MATRIX_WISE_OPTIMIZERS`` optimizer
over ``fully_shard``'s sharded parameters (see ``fsdp2/muon/``).
"""

from __future__ import annotations

import functools
import types
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsdp2.muon import Muon, install_matrix_wise_guard, muon_param_groups

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "MATRIX_WISE_OPTIMIZERS",
    "Muon",
    "muon_param_groups",
    "step_on_local_shards",
]

#: ``torch.optim`` classes whose update is elementwise (checked by ``step_on_local_shards``).
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)

#: Optimizers whose update works on whole matrices (``torch.optim.Muon``; subclasses count as
#: theirs). Stepping ``fully_shard``'s sharded parameters with one raises ``RuntimeError`` at
#: its first step (a global step pre-hook installed on import; ``fsdp2.optim.Muon`` is exempt).
#: Rebind the tuple to add a matrix-wise optimizer of your own, e.g.
#: ``fsdp2.optim.MATRIX_WISE_OPTIMIZERS += (MyShampoo,)``.
MATRIX_WISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Muon,)

install_matrix_wise_guard(lambda: MATRIX_WISE_OPTIMIZERS)  # read at each step: rebindable

_MARK = "_fsdp2_local_step"


def step_on_local_shards(
    optimizer: torch.optim.Optimizer, *, elementwise: bool = False
) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` update each DTensor parameter's local shard directly.

    Args:
        optimizer: any optimizer over ``fully_shard`` (DTensor) parameters; parameters
            that are not DTensors are stepped as they are.
        elementwise: assert that ``optimizer``'s update is elementwise. Needed for a class
            not in ``ELEMENTWISE_OPTIMIZERS`` (subclasses of those count as theirs); an
            optimizer that mixes elements (LBFGS, Adafactor's row and column factors,
            Muon's orthogonalization, a gradient norm inside the step) would silently
            compute something else on shards, so it is refused without this flag. Do
            not set it for such an optimizer.

    Returns:
        ``optimizer`` itself (its ``step`` is wrapped; calling this again does nothing).

    Raises:
        TypeError: ``optimizer`` is not elementwise (see ``elementwise``).

    At each step a parameter's gradient must be a DTensor with the parameter's placements
    and its non-scalar state DTensors sharded like it (as ``torch.distributed.checkpoint``
    and ``load_state_dict`` of a sharded state dict leave them); otherwise the step raises
    ``ValueError`` naming the parameter before changing anything. A closure, if given, is
    called once before the update with gradients enabled, as the elementwise optimizers
    of ``torch.optim`` do.
    """
    if getattr(optimizer, _MARK, False):
        return optimizer
    if not elementwise and not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        raise TypeError(
            f"step_on_local_shards: {type(optimizer).__name__} is not one of the elementwise "
            f"torch.optim optimizers ({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}); "
            "stepping shards is only right when each element's update depends on that "
            "element alone. Pass elementwise=True if that holds for this optimizer."
        )
    step = optimizer.step  # the bound step, with any wrapper (an LR scheduler's) around it

    @functools.wraps(step)
    def local_step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with _LocalView(self):
            step()
        return loss

    # A bound method, as LR schedulers expect to find (they re-bind its ``__func__``).
    optimizer.step = types.MethodType(local_step, optimizer)  # type: ignore[method-assign]
    setattr(optimizer, _MARK, True)
    return optimizer


class _LocalView:
    """While entered, ``optimizer.param_groups`` and ``optimizer.state`` hold the local
    tensors of DTensor parameters, their gradients and state; on exit (also on an error)
    the sharded objects are back, with state the step created wrapped as DTensors."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params: list[list[Any]] = []  # each group's original params list
        self.locals: list[tuple[DTensor, torch.Tensor]] = []
        self.state: Any = None

    def __enter__(self) -> None:
        opt = self.optimizer
        state = opt.state
        local_state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        views = []
        for gi, group in enumerate(opt.param_groups):
            params = group["params"]
            swapped = []
            for pi, p in enumerate(params):
                if not isinstance(p, DTensor):
                    swapped.append(p)
                    if p in state:
                        local_state[p] = state[p]
                    continue
                local = p._local_tensor
                grad = p.grad
                where = f"param_groups[{gi}]['params'][{pi}]"
                local_grad = None if grad is None else _local_like(p, grad, f"the grad of {where}")
                entry = state.get(p)
                if entry:
                    local_state[local] = {
                        k: _local_like(p, v, f"state {k!r} of {where}") for k, v in entry.items()
                    }
                views.append((p, local, local_grad))
                swapped.append(local)
            self.params.append(params)
            group["params"] = swapped
        # Nothing raised: commit the view.
        for p, local, local_grad in views:
            local.grad = local_grad
            self.locals.append((p, local))
        self.state = state
        opt.state = local_state

    def __exit__(self, *exc: object) -> None:
        opt = self.optimizer
        local_state = opt.state
        state = self.state
        for group, params in zip(opt.param_groups, self.params, strict=True):
            group["params"] = params
        mine = set()
        for p, local in self.locals:
            local.grad = None
            mine.add(id(local))
            entry = local_state.get(local)
            if entry is None:
                continue
            old = state.get(p) or {}
            state[p] = {k: _sharded_like(p, local, v, old.get(k)) for k, v in entry.items()}
        for key, value in local_state.items():  # plain parameters
            if id(key) not in mine and key not in state and value:
                state[key] = value
        opt.state = state


def _local_like(p: DTensor, value: Any, what: str) -> Any:
    """``value``'s local tensor, checking it is sharded like ``p`` (scalars pass)."""
    if isinstance(value, DTensor):
        if value._spec is not p._spec and (
            value.placements != p.placements
            or value.device_mesh != p.device_mesh
            or value.shape != p.shape
        ):
            raise ValueError(
                f"step_on_local_shards: {what} is a DTensor with placements "
                f"{value.placements} and shape {tuple(value.shape)}; the parameter's are "
                f"{p.placements} and {tuple(p.shape)}. Stepping local shards needs them "
                "sharded alike."
            )
        return value._local_tensor
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        raise ValueError(
            f"step_on_local_shards: {what} (a parameter of shape {tuple(p.shape)}) is a "
            f"plain tensor of shape {tuple(value.shape)}, not a DTensor sharded like the "
            "parameter. Load optimizer state with torch.distributed.checkpoint or a sharded "
            "state dict."
        )
    return value


def _sharded_like(p: DTensor, local: torch.Tensor, value: Any, before: Any) -> Any:
    """State ``value`` after a local step: the DTensor it came from, a new DTensor sharded
    like ``p`` for a new tensor of the local shard's shape, anything else as it is (a
    tensor of another shape then fails the next step's check)."""
    if isinstance(before, DTensor) and before._local_tensor is value:
        return before
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local.shape:
        if value.dtype == p.dtype and value.stride() == local.stride():
            # The parameter's spec describes it exactly; sharing it keeps the next step's
            # placement check an identity test. (DTensor's constructor is private API.)
            return DTensor(value, p._spec, requires_grad=False)
        return DTensor.from_local(
            value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return value
