"""HSDP at FSDP's optimizer memory: gradients and optimizer state sharded over the replicas.

HSDP (``fully_shard`` on a ``(replicate, shard)`` mesh of ``R x S`` ranks) all-gathers
inside a shard group and all-reduces each gradient shard across the replicas, so each rank
holds its shard's gradient and optimizer state whole: ``R`` copies of both. Wrapping the
optimizer shards them over the replicas too (ZeRO over HSDP's replicas)::

    mesh = init_device_mesh("cuda", (R, S), mesh_dim_names=("replicate", "shard"))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = fsdp2.replica_optim.shard_over_replicas(torch.optim.AdamW(model.parameters(), lr=3e-4))
    for batch in data:
        model(batch).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # or optim.clip_grad_norm_
        optim.step()
        optim.zero_grad()

Each HSDP group then reduce-scatters its gradient shard over the replicas instead of
all-reducing it: replica rank ``r`` keeps piece ``r`` of each parameter's flattened local
shard (``ceil(n / R)`` elements), the optimizer steps that piece alone (its state is a
piece too), and an all-gather over the replicas puts the updated shards back together on
every replica at the end of ``step()``. An all-reduce is a reduce-scatter plus an
all-gather, so the bytes across replicas stay those of HSDP's all-reduce (when gradients
are reduced in the parameters' dtype; a ``reduce_dtype`` of bf16 under fp32 parameters
halves the reduce-scatter but not the all-gather of the fp32 shards), while the gradient
and the optimizer state per rank are divided by ``R``. The numbers are HSDP's: the same
sums (bitwise for two replicas) and the same elementwise update; gradient norms equal to
rounding (summed over the pieces in another order).

What changes for the training loop:

- The gradients of the wrapped HSDP parameters are held in pieces, and each piece is its
  parameter's ``.grad``: a DTensor whose local tensor is the piece, which the standard tools
  read exactly (``torch.nn.utils.clip_grad_norm_``, ``GradScaler``, the frameworks'
  clipping; [Note: pieces as .grad] in fsdp2/_core/replicas/piece_grad.py), as do
  :meth:`ReplicaShardedOptimizer.clip_grad_norm_` and ``fsdp2.clip_grad_norm_``.
  ``p.grad.full_tensor()`` gathers it whole; an op that needs its layout (a view) raises.
  ``optim.zero_grad()`` and ``model.zero_grad()`` clear them.
- ``optim.state[p]`` holds the pieces; ``state_dict()``, ``load_state_dict()``,
  ``torch.distributed.checkpoint``'s ``get_optimizer_state_dict`` /
  ``set_optimizer_state_dict`` and DCP save and load use the usual layout (each state
  tensor sharded like its parameter), so a checkpoint moves between this and plain HSDP
  (or FSDP), at any mesh shape.
- Only elementwise optimizers (``fsdp2.optim.ELEMENTWISE_OPTIMIZERS``, or
  ``elementwise=True``) can step pieces; ``fsdp2.optim.Muon`` and other matrix-wise
  optimizers are refused.

Parameters that are not on an HSDP group (a 1D mesh, plain tensors, other DTensors) are
stepped on their local tensors as ``fsdp2.optim.step_on_local_shards`` does.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from fsdp2._core.replicas.piece_grad import PieceGrad, flatten_mesh
from fsdp2._core.replicas.piece_state import Slot, clip_slots, like, piece_of, whole_state
from fsdp2._core.replicas.pieces import finish_gather, gather_pieces
from fsdp2._core.support.unsharded import REPLICA_MARK, sharded_of, sharded_owners, track
from fsdp2.optim import ELEMENTWISE_OPTIMIZERS, MATRIX_WISE_OPTIMIZERS, Muon

__all__ = ["PieceGrad", "ReplicaShardedOptimizer", "shard_over_replicas"]


def shard_over_replicas(
    optimizer: torch.optim.Optimizer, *, elementwise: bool = False
) -> ReplicaShardedOptimizer:
    """Shard ``optimizer``'s state, and the gradients it steps, over HSDP's replicas.

    Args:
        optimizer: an optimizer built over the model's parameters (after ``fully_shard``,
            before its first step), e.g. ``torch.optim.AdamW(model.parameters(), lr=3e-4)``.
            It is not stepped itself: the returned optimizer takes its class,
            hyperparameters, parameter groups and state (cut into pieces).
        elementwise: assert that ``optimizer``'s update is elementwise (needed for a class
            not in ``fsdp2.optim.ELEMENTWISE_OPTIMIZERS``). An optimizer that mixes
            elements (Muon, LBFGS, Adafactor) would compute something else on pieces.

    Returns:
        a :class:`ReplicaShardedOptimizer`; use it in place of ``optimizer``.

    Raises:
        TypeError: ``optimizer`` is not elementwise, or is matrix-wise.
        ValueError: a parameter of a wrapped HSDP module
            is missing from it; a module reduces deterministically
            (``fsdp2.reduction.set_deterministic``).
    """
    return ReplicaShardedOptimizer(optimizer, elementwise=elementwise)


class ReplicaShardedOptimizer(torch.optim.Optimizer):
    """An elementwise optimizer whose state and gradients are sharded over HSDP's replicas
    (see the module's docs). Build it with :func:`shard_over_replicas`.

    ``param_groups`` are the wrapped optimizer's (the model's sharded parameters and their
    hyperparameters), the same list: an LR scheduler built on either optimizer (a framework
    builds its scheduler on the optimizer it made, before the wrap) sets this one's learning
    rates; ``state[p]`` holds ``p``'s pieces.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, elementwise: bool = False) -> None:
        _check_elementwise(optimizer, elementwise)
        self._inner: torch.optim.Optimizer | None = None
        self._wrapped: torch.optim.Optimizer | None = None
        self._slots: list[Slot] = []
        self._owners = sharded_owners()
        setattr(self, REPLICA_MARK, True)
        super().__init__(optimizer.param_groups, optimizer.defaults)  # the groups themselves
        self._cls = type(optimizer)
        _start_replica_sharding(self._slots)  # checks every group first, then switches them
        self._inner = self._build_inner()
        self._owners = {}
        if any(optimizer.state.values()):  # stepped already, or eager (Adagrad): cut it up
            self.load_state_dict(optimizer.state_dict())
        self._wrapped = optimizer
        optimizer.param_groups = self.param_groups  # one list from here on (load_state_dict)

    # ---- construction -------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        owners = self._owners or sharded_owners()
        for i, p in enumerate(group["params"]):
            if sharded_of(p) is not p:
                raise ValueError(
                    f"shard_over_replicas: param_groups[{len(self.param_groups) - 1}]['params']"
                    f"[{i}] is an unsharded parameter, a temporary of fully_shard: the "
                    "optimizer was built from parameters() between a forward and its "
                    "backward (or after unshard()). Build it from the sharded parameters: "
                    "before the first forward, after a backward, or after model.reshard()"
                )
        self._slots += [Slot(p, owners.get(id(p))) for p in group["params"]]
        if self._inner is not None:  # added after construction
            _start_replica_sharding(self._slots)
            self._inner.add_param_group(_inner_group(group, self._slots[-len(group["params"]) :]))

    def _build_inner(self) -> torch.optim.Optimizer:
        it = iter(self._slots)
        groups = [_inner_group(g, [next(it) for _ in g["params"]]) for g in self.param_groups]
        accepted = inspect.signature(self._cls.__init__).parameters
        kwargs = {k: v for k, v in self.defaults.items() if k in accepted and k != "params"}
        return self._cls(groups, **kwargs)

    # ---- the step -------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the pieces, then all-gather them over the replicas into every shard."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inner = self._inner
        assert inner is not None
        self._refresh()
        _sync_hyperparameters(self.param_groups, inner.param_groups)
        # Step the parameters outside HSDP groups, then each HSDP group's pieces in turn,
        # issuing its all-gather over the replicas at once: it runs while the next group
        # steps. At most two groups' all-gathers are in flight, so the step holds about two
        # groups' gathered shards, not the whole model's.
        others: list[tuple[Slot, Any]] = []
        groups: dict[int, tuple[Any, list[tuple[Slot, Any]]]] = {}
        for slot in self._slots:
            g = slot.grad()
            if slot.split:
                groups.setdefault(id(slot.group), (slot.group, []))[1].append((slot, g))
            else:
                others.append((slot, g))
        previous = None
        try:
            _step_some(inner, others)
            for group, slots in groups.values():
                if not _step_some(inner, slots):
                    continue
                fps = [slot.fp for slot, g in slots if g is not None]
                work = gather_pieces(group, fps)
                if previous is not None:
                    finish_gather(*previous)
                previous = (group, fps, work)
        finally:
            if previous is not None:
                finish_gather(*previous)
            del previous
        self._mirror_state()
        if self._wrapped is not None:  # what torch's LR schedulers built on it check
            self._wrapped._opt_called = True  # type: ignore[attr-defined]
        return loss

    def piece_grads(self) -> list[torch.Tensor]:
        """The gradients this rank steps (pieces, and local shards of other parameters)."""
        return [g for g in (slot.grad() for slot in self._slots) if g is not None]

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's parameters, taking the
        norm over the gradient pieces of every rank (a collective: every rank calls it).
        Returns the total norm (a plain tensor, the same on every rank)."""
        return clip_slots(self._slots, max_norm, norm_type, error_if_nonfinite, foreach)

    # ---- state ----------------------------------------------------------------------

    def _refresh(self) -> None:
        inner = self._inner
        assert inner is not None
        it = iter(self._slots)
        for ig in inner.param_groups:
            params = ig["params"]
            for k in range(len(params)):
                slot = next(it)
                if not slot.stale():
                    continue
                old = slot.piece
                slot.piece = slot._make_piece()
                params[k] = slot.piece
                if old in inner.state:
                    st = inner.state.pop(old)
                    inner.state[slot.piece] = {
                        key: v.to(slot.piece.device) if like(v, old) else v for key, v in st.items()
                    }

    def _mirror_state(self) -> None:
        inner = self._inner
        assert inner is not None
        state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        for slot in self._slots:
            st = inner.state.get(slot.piece)
            if st:
                state[slot.param] = st
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        """The usual layout: each state tensor sharded like its parameter (the pieces are
        all-gathered over the replicas: a collective, every rank calls it)."""
        self._mirror_state()
        pieced, self.state = self.state, whole_state(self._slots, self.state)  # type: ignore[assignment]
        try:
            return super().state_dict()
        finally:
            self.state = pieced

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of the usual layout (saved with or without replica sharding,
        from ``state_dict()``, ``torch.distributed.checkpoint`` or a plain optimizer)."""
        super().load_state_dict(state_dict)
        inner = self._inner
        assert inner is not None
        self._refresh()
        loaded = self.state
        inner.state = defaultdict(dict)
        for slot in self._slots:
            st = loaded.get(slot.param)
            if st:
                inner.state[slot.piece] = {k: piece_of(slot, k, v) for k, v in st.items()}
        _sync_hyperparameters(self.param_groups, inner.param_groups)
        self._mirror_state()
        if self._wrapped is not None:  # it replaced the groups: the wrapped optimizer's too
            self._wrapped.param_groups = self.param_groups


# ---- helpers -------------------------------------------------------------------------


def _check_elementwise(optimizer: torch.optim.Optimizer, elementwise: bool) -> None:
    if isinstance(optimizer, (Muon, *MATRIX_WISE_OPTIMIZERS)):
        raise TypeError(
            f"shard_over_replicas: {type(optimizer).__name__} updates whole matrices; pieces of "
            "a shard cannot step it. Keep it on plain HSDP (its parameters in their own "
            "fully_shard modules), or wrap only an elementwise optimizer"
        )
    if not elementwise and not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise TypeError(
            f"shard_over_replicas: {type(optimizer).__name__} is not one of the elementwise "
            f"torch.optim optimizers ({names}); stepping pieces of a shard is only right when "
            "each element's update depends on that element alone. Pass elementwise=True if "
            "that holds for this optimizer"
        )


def _start_replica_sharding(slots: list[Slot]) -> None:
    """Check every HSDP group the slots touch, then switch them to replica sharding: an
    error leaves every group as it was."""
    groups = {id(s.group): s.group for s in slots if s.split}
    _check_complete(slots)
    for g in groups.values():
        if g.reduce.exact:
            raise ValueError(
                f"shard_over_replicas: fully_shard({g.name}) reduces deterministically "
                "(fsdp2.reduction.set_deterministic), which replica sharding does not do yet"
            )
        for fp in g.params:
            local = fp.sharded._local_tensor
            fake = isinstance(local, torch._subclasses.FakeTensor)  # fsdp2.estimate_memory's
            if (type(local) is not torch.Tensor and not fake) or not local.is_contiguous():
                raise ValueError(
                    f"shard_over_replicas: {fp.fqn} of fully_shard({g.name}) has a local shard "
                    f"of type {type(local).__name__} (contiguous: {local.is_contiguous()}); "
                    "pieces need a plain contiguous one"
                )
    for g in groups.values():
        if not g.reduce.replica_shard:
            for fp in g.params:  # one reduction of the pieces' norms (collective: every rank)
                flatten_mesh(fp)
            g.update(reduce={"replica_shard": True})
            track(g)


def _check_complete(slots: list[Slot]) -> None:
    held = {id(s.param) for s in slots}
    for slot in slots:
        g = slot.group
        if g is None or not slot.split:
            continue
        for fp in g.params:
            if fp.requires_grad and id(fp.sharded) not in held:
                raise ValueError(
                    f"shard_over_replicas: {fp.fqn} of fully_shard({g.name}) is not in the "
                    f"optimizer, but {slot.name} of the same module is: its gradient would be "
                    "kept in pieces that no optimizer steps. Put every trainable parameter of "
                    "an HSDP module in the one optimizer (freeze the others: requires_grad_(False))"
                )


def _inner_group(group: dict[str, Any], slots: list[Slot]) -> dict[str, Any]:
    return {**{k: v for k, v in group.items() if k != "params"}, "params": [s.piece for s in slots]}


def _step_some(inner: torch.optim.Optimizer, slots: list[tuple[Slot, Any]]) -> bool:
    """Step the inner optimizer on ``slots``' pieces alone (the others have no gradient, so
    an elementwise optimizer leaves them and their state as they are); False if none has
    a gradient."""
    stepped = [slot for slot, g in slots if g is not None]
    if not stepped:
        return False
    for slot, g in slots:
        slot.piece.grad = g
    try:
        inner.step()
    finally:
        for slot in stepped:
            slot.piece.grad = None
    return True


def _sync_hyperparameters(outer: list[dict[str, Any]], inner: list[dict[str, Any]]) -> None:
    for og, ig in zip(outer, inner, strict=True):
        for k, v in og.items():
            if k != "params":
                ig[k] = v
