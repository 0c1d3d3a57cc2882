"""What layers built on the core (the FSDP1 migration layer, ``checkpoint/__init__.py``) may read
or hook: the one place they touch the core's objects, so that the core can change behind it.

* ``managed_params(module)``: the parameters a ``fully_shard`` group manages, each with
  its sharded DTensor parameter and the ``(module, attribute)`` pairs that register it.
* ``on_backward_end(module, callback)``: run ``callback`` after every backward that
  ``module``'s root drives, once its gradients have landed on the sharded parameters.
* ``comm_device_type()``: the device type the default process group communicates on.
* ``compute_device(module)``: the device ``module``'s groups compute on (where
  ``to_empty`` materialises a meta-device model's shards).
* ``rests_on_host(module)``: the sharded parameters kept on the host between steps (CPU
  offload, ``offload_after_backward=True``), for the memory estimate.
* ``install_exit_drain()``: let gloo's workers finish before interpreter exit, for a
  layer that runs collectives of its own ([Note: clean exit]).
* ``gather_pieces(packed, sizes, make_rows, group, world, what)``: the engine's all-gather
  of one flat buffer, landing each rank's pieces in caller-made tensors (straight from the
  wire on gloo: [Note: gloo straight in and out]), made only when needed, for a layer that
  gathers tensors of its own.
* ``step_phase(module)``: ``"forward"`` / ``"backward"`` while a step of a root in
  ``module``'s subtree is inside one, else ``None``.
* ``divide_unreduced_grads(module, factor)``: divide the gradients ``module``'s subtree
  accumulated without sync since the last call (the pipeline schedules' per-step scaling,
  under gradient accumulation over several steps), leaving earlier ones alone.
* ``unit_settings(root)``: a read-only snapshot of what each ``fully_shard`` call under
  ``root`` runs with (reshard after forward, policies, prefetch lists), so that a layer (or
  its tests) can check what it configured without reading the core's objects.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2._core.comm.collectives import Into, all_gather
from fsdp2._core.comm.gloo import Received
from fsdp2._core.comm.transport import copy_out
from fsdp2._core.front.offload import mapping_key
from fsdp2._core.params.storage import free_storage
from fsdp2._core.runtime.reduce import bank_grads
from fsdp2._core.runtime.slot import Slot
from fsdp2._core.runtime.state import FSDPState, state_of
from fsdp2._core.runtime.step import StepPhase
from fsdp2._core.support.clean_exit import install_exit_drain
from fsdp2._core.support.mesh import comm_device_type
from fsdp2.api import MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "ManagedParam",
    "UnitSettings",
    "comm_device_type",
    "compute_device",
    "divide_unreduced_grads",
    "gather_pieces",
    "install_exit_drain",
    "managed_params",
    "on_backward_end",
    "rests_on_host",
    "step_phase",
    "unit_settings",
]


@dataclass(frozen=True)
class ManagedParam:
    """One managed parameter: ``sharded`` is its DTensor parameter (registered on the
    owners whenever the group is resharded); ``owners`` the ``(module, name)`` pairs that
    register it (more than one for tied parameters)."""

    sharded: DTensor
    owners: tuple[tuple[nn.Module, str], ...]


def _states(module: nn.Module, recurse: bool) -> list[FSDPState]:
    mods = module.modules() if recurse else [module]
    out: list[FSDPState] = []
    for m in mods:
        st = state_of(m)
        if st is not None and all(st is not o for o in out):
            out.append(st)
    return out


def managed_params(
    module: nn.Module, *, recurse: bool = False, reshard: bool = False
) -> list[ManagedParam]:
    """The parameters managed by ``module``'s ``fully_shard`` group (and, with
    ``recurse``, by every group in ``module``'s subtree), in the order ``fully_shard``
    found them (the same on every rank). ``[]`` for a module without one.
    With ``reshard``, each group is resharded first, so the sharded parameters are the
    registered ones."""
    out: list[ManagedParam] = []
    for st in _states(module, recurse):
        for group in st.groups:
            if reshard:
                group.reshard()
            out.extend(ManagedParam(p.sharded, tuple(p.owners)) for p in group.params)
    return out


def divide_unreduced_grads(module: nn.Module, factor: float) -> None:
    """Divide by ``factor`` the unsharded gradients every group in ``module``'s subtree
    accumulated since the last call, and keep them aside with the earlier ones (the no-sync
    sums the next reduction adds in): one share of a gradient accumulated over several
    schedule steps, scaled once. Between steps only (no collective)."""
    for st in _states(module, recurse=True):
        for group, state in zip(st.groups, st.slot.grads, strict=True):
            if group.reduce.exact:
                raise RuntimeError(
                    f"{group.path}: fsdp2.reduction.set_deterministic does not cover pipeline "
                    "schedules (their gradient scaling between schedule steps); turn it off "
                    "for pipelined stages (docs/reproducibility.md)"
                )
            bank_grads(group, state, factor)


def gather_pieces(
    packed: torch.Tensor,
    sizes: list[int],
    make_rows: Callable[[], list[list[torch.Tensor]]],
    group: dist.ProcessGroup,
    world: int,
    what: str,
) -> Callable[[], None]:
    """Issue the all-gather of ``packed`` (this rank's pieces of ``sizes``, back to back)
    over ``group`` (``world`` ranks); the returned function waits for it, after which the
    rows ``make_rows()`` returned (``rows[r][i]``: a ``(sizes[i],)`` tensor) hold group rank
    ``r``'s piece ``i``. On gloo exchange the peers' pieces are received straight into the
    rows, made at the issue; otherwise they are copied out of the rank-major result, and
    made at the wait (so they and that result are not alive before they must be).

    ``packed`` is consumed: once waited, its storage (and the rank-major result's) is freed
    at once, not when gloo's worker thread drops its reference to a finished send or
    receive, which it may do a moment later (under load, one more bucket alive)."""
    rows: list[list[torch.Tensor]] = []
    into = Into(sizes, rows, lambda: rows.extend(make_rows()))
    (result,) = all_gather([packed], group, world, what, into=into)

    def wait() -> None:
        if isinstance(result, Received):
            result.wait()
            free_storage(packed, what)
            return
        output = result.wait_rows()
        rows.extend(make_rows())
        for r, row in enumerate(output):
            copy_out(row, sizes, rows[r])
        del output
        free_storage(result.output, what)  # (with one rank: a view of packed)
        free_storage(packed, what)

    return wait


def step_phase(module: nn.Module) -> str | None:
    """``"forward"`` or ``"backward"`` while a training step of a root in ``module``'s
    subtree is inside its forward or backward; ``None`` between steps."""
    for st in _states(module, recurse=True):
        ctx = st.ctx
        if ctx is not None and ctx.phase is not StepPhase.IDLE:
            return str(ctx.phase.value)
    return None


def compute_device(module: nn.Module) -> torch.device | None:
    """The device the first ``fully_shard`` group in ``module``'s subtree computes on
    (``None`` without one)."""
    for st in _states(module, recurse=True):
        if st.groups:
            return st.groups[0].device
    return None


def rests_on_host(module: nn.Module) -> list[DTensor]:
    """The sharded parameters in ``module``'s subtree whose group keeps them, with their
    gradients and optimizer state, on the host between steps: CPU offload with
    ``offload_after_backward=True`` ([Note: offload by phase] in params/residence.py)."""
    return [
        p.sharded
        for st in _states(module, recurse=True)
        for g in st.groups
        if g.residence.at_rest
        for p in g.params
    ]


def on_backward_end(module: nn.Module, callback: Callable[[], None]) -> None:
    """Run ``callback()`` at the end of every backward driven by the root whose tree
    holds ``module`` (hooks of every module in that tree run, in registration order),
    after fsdp2 has landed (and, with CPU offload, synchronized) the gradients.

    Raises:
        ValueError: ``module`` was not passed to ``fully_shard``.
    """
    st = state_of(module)
    if st is None:
        raise ValueError(f"{type(module).__name__} was not passed to fully_shard")
    st.slot.on_backward_end.append(callback)


@dataclass(frozen=True)
class UnitSettings:
    """What one ``fully_shard`` call runs with, now (a snapshot; changing it changes nothing).

    Prefetch targets are named by the first module passed to their ``fully_shard`` call.
    """

    reshard_after_forward: bool | int
    """The effective ``reshard_after_forward`` (``set_reshard_after_forward`` and the
    root's default of ``False`` after its first forward included)."""
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy | Mapping[str, OffloadPolicy]
    """The call's one policy when all its parameters run with it; else (a mapping given to
    ``fully_shard`` that split them) a read-only mapping of every parameter it manages,
    named as the call's mapping keys them, to its policy (``OffloadPolicy()``: on the
    device); given back to ``fully_shard``, it groups them the same way."""
    forward_prefetch: tuple[nn.Module, ...] | None
    """The explicit ``set_modules_to_forward_prefetch`` list; ``None``: none was set."""
    backward_prefetch: tuple[nn.Module, ...] | None
    """The explicit ``set_modules_to_backward_prefetch`` list; ``None``: none was set."""
    implicit_forward_prefetch: tuple[nn.Module, ...]
    """What the pre-forward prefetches without an explicit list: the unit that ran right
    after this one in the last forward (empty before the first forward, or for the last)."""


def unit_settings(root: nn.Module) -> dict[nn.Module, UnitSettings]:
    """The settings of every ``fully_shard`` call in ``root``'s subtree that manages
    parameters, keyed by each module passed to it (in ``root.modules()`` order). Prefetch
    targets outside ``root``'s subtree are left out of the tuples."""
    states = _states(root, recurse=True)
    first = {id(st): st.modules[0] for st in states if st.groups}
    first.update({id(st.slot): st.modules[0] for st in states if st.groups})

    def named(targets: list[FSDPState] | list[Slot]) -> tuple[nn.Module, ...]:
        return tuple(first[id(t)] for t in targets if id(t) in first)

    out: dict[nn.Module, UnitSettings] = {}
    for m in root.modules():
        st = state_of(m)
        if st is None or not st.groups:
            continue
        g = st.groups[0]  # the groups of one call share their settings, but offload
        listed = len(st.modules) > 1
        by_name = {
            mapping_key(p.fqn, listed): group.offload_policy
            for group in st.groups
            for p in group.params
        }
        offload: OffloadPolicy | Mapping[str, OffloadPolicy] = g.offload_policy
        if len(set(by_name.values())) > 1:  # split by a mapping ([Note: offload by name])
            offload = MappingProxyType(by_name)
        out[m] = UnitSettings(
            reshard_after_forward=g.gather.post_forward,
            mp_policy=st.mp_policy,
            offload_policy=offload,
            forward_prefetch=None if st.fwd_prefetch is None else named(st.fwd_prefetch),
            backward_prefetch=None if st.bwd_prefetch is None else named(st.bwd_prefetch),
            implicit_forward_prefetch=named(st.slot.fwd_next),
        )
    return out
