"""The parameters an optimizer must never hold, and the check at every optimizer step that
none does.

# [Note: optimizers holding unsharded parameters]
# A module registers what torch's FSDP2 registers (``reshard_after_forward``'s docs): the
# sharded DTensors, except while a group is unsharded (the root between a training forward
# and its backward; ``reshard_after_forward=False``; ``set_reshard_after_backward(False)``
# between micro-batches; ``unshard()``; a create_graph backward's hold), when it registers the
# unsharded parameters, and between forward and backward with ``reshard_after_forward=int``,
# when it registers the faces on the smaller mesh ([Note: the parameters between forward and
# backward] in small_shard.py). ``parameters()``, ``named_parameters()``, ``get_parameter()``
# and the attributes all give the registered ones, as on torch's FSDP2.
#
# The unsharded parameters and the faces are temporaries: the next all-gather overwrites them
# and their gradients are reduced away. An optimizer built from them (after a sanity forward,
# between micro-batches) trains nothing, silently, on torch's FSDP2. Here every group's
# temporaries are tracked (the groups weakly) and a global optimizer step pre-hook
# (``torch.optim.optimizer.register_optimizer_step_pre_hook``, installed by the first
# ``fully_shard``) raises before a step that would update one, naming the parameter and the
# fix; every rank built its optimizer the same way, so every rank raises, before any
# collective. The cost is one dictionary lookup per parameter per step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = [
    "REPLICA_MARK",
    "any_replica_sharded",
    "install_optimizer_check",
    "sharded_of",
    "sharded_owners",
    "track",
]

# set on a ReplicaShardedOptimizer: it steps parameters of replica-sharded groups
REPLICA_MARK = "_fsdp2_replica_sharded"

# Every group's parameters, tracked weakly (a weak reference to an unsharded parameter itself
# would stop ``torch.utils.swap_tensors``, which relayouts use): the check looks parameters
# up by identity in a map rebuilt whenever a group's parameter objects changed.
_GROUPS: weakref.WeakSet[Any] = weakref.WeakSet()
_epoch = 0
# (group, index in group.params, which face: "unsharded", "sharded" or "small")
_Entry = tuple[weakref.ref[Any], int, str]
_map: tuple[int, dict[int, _Entry]] = (-1, {})
_installed = False


def track(group: Any) -> None:
    """(Re)track ``group``'s parameters (``group.params[i].unsharded`` / ``.sharded``): call
    whenever its parameter objects change. ``group`` is a ``ParamGroup``."""
    global _epoch
    _GROUPS.add(group)
    _epoch += 1


def _tracked_map() -> dict[int, _Entry]:
    """``id(parameter) -> (its group, its index in group.params, which face)``: every
    unsharded parameter and face on the smaller mesh, and the sharded parameters of groups
    with one shard rank (which may forward on views of them: [Note: steps between forward
    and backward])."""
    global _map
    if _map[0] != _epoch:
        found: dict[int, _Entry] = {}
        for g in list(_GROUPS):
            ref = weakref.ref(g)
            for i, p in enumerate(g.params):
                if p.unsharded is not None:
                    found[id(p.unsharded)] = (ref, i, "unsharded")
                if g.world == 1 or g.reduce.replica_shard:
                    found[id(p.sharded)] = (ref, i, "sharded")
            faces = g.small.faces if g.small is not None else None
            for face, p in zip(faces or (), g.flat_params, strict=False):
                if face is not None:
                    found[id(face)] = (ref, g.params.index(p), "small")
        _map = (_epoch, found)
    return _map[1]


def sharded_of(t: torch.Tensor) -> torch.Tensor:
    """The sharded parameter whose temporary ``t`` is (an unsharded parameter, a face on
    the smaller mesh), else ``t`` itself: for fsdp2's own functions that take
    ``model.parameters()`` at any point of a step (``fsdp2.clip_grad_norm_``)."""
    entry = _tracked_map().get(id(t)) if _GROUPS else None
    if entry is None or entry[2] == "sharded":
        return t
    group = entry[0]()
    if group is None:
        return t
    fp = group.params[entry[1]]
    return fp.sharded if fp.unsharded is t or _is_face(group, t) else t  # else: a stale id


def _is_face(group: Any, t: torch.Tensor) -> bool:
    return group.small is not None and any(f is t for f in group.small.faces or ())


def install_optimizer_check() -> None:
    """Register the optimizer step pre-hook once per process."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_check_optimizer)
        _installed = True


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _GROUPS:
        return
    found = _tracked_map()
    written: dict[int, Any] = {}  # aliased groups the step will write
    for i, pg in enumerate(optimizer.param_groups):
        for j, p in enumerate(pg["params"]):
            entry = found.get(id(p))
            if entry is None:
                continue
            group = entry[0]()
            if group is None:
                continue
            fp = group.params[entry[1]]
            face = entry[2]
            if face == "sharded":  # of a group with one shard rank, or replica sharding
                if group.reduce.replica_shard and not getattr(optimizer, REPLICA_MARK, False):
                    _refuse_pieced(optimizer, group, fp.fqn, i, j)
                if fp.sharded is p and p.grad is not None and group.aliased:
                    written[id(group)] = group
                continue
            if face == "unsharded" and fp.unsharded is not p:
                continue  # an id that outlived its parameter
            if face == "small" and not _is_face(group, p):
                continue
            what = (
                "unsharded parameter"
                if face == "unsharded"
                else "parameter resharded to the smaller mesh (reshard_after_forward=int)"
            )
            raise RuntimeError(
                f"fsdp2: {type(optimizer).__name__}.step() would update the {what} "
                f"{fp.fqn} (param_groups[{i}]['params'][{j}]) of fully_shard({group.name}), "
                "a temporary that the next all-gather overwrites and whose gradient is "
                "reduced away: the optimizer was built from parameters() while that "
                "module's parameters were not sharded (between a forward and its backward, "
                "between micro-batches with set_reshard_after_backward(False), or after "
                "unshard()), when parameters() gives the registered temporaries, as on "
                "torch's FSDP2 (which would train nothing, silently). Build the optimizer "
                "from the sharded parameters: before the first forward, after a backward, "
                "or after model.reshard() on every FSDP module. See docs/reliability.md "
                "(call orders)"
            )
    for group in written.values():  # see [Note: steps between forward and backward]
        torch.autograd.graph.increment_version(group.sharded_flat)


def _refuse_pieced(optimizer: torch.optim.Optimizer, group: Any, fqn: str, i: int, j: int) -> None:
    raise RuntimeError(
        f"fsdp2: {type(optimizer).__name__}.step() would update {fqn} "
        f"(param_groups[{i}]['params'][{j}]) of fully_shard({group.name}), whose gradient "
        "is sharded over the replicas by fsdp2.replica_optim: its .grad is this rank's piece "
        "and only the ReplicaShardedOptimizer holding it steps it. Put every parameter of "
        "that module in the one ReplicaShardedOptimizer (docs/parallelism.md)"
    )


def any_replica_sharded() -> bool:
    """Whether a live group shards its gradients over the replicas ([Note: pieces])."""
    return any(g.reduce.replica_shard for g in list(_GROUPS))


def sharded_owners() -> dict[int, tuple[Any, Any]]:
    """``id(sharded parameter) -> (its group, its FSDPParam)`` for every live group."""
    return {id(p.sharded): (g, p) for g in list(_GROUPS) for p in g.params}


# [Note: steps between forward and backward]
# A group with one shard rank (``replicate``, ``Replicate()`` parameters, world size 1) forwards
# on views of its sharded storage (``GroupLayout.aliased``). An optimizer step between a forward
# and its backward then changes the values autograd saved, and the backward would compute
# gradients from a mix of old and new weights. On a plain module autograd refuses that
# ("modified by an inplace operation"), because the step bumps the parameters' version
# counter; a DTensor's in-place op runs on its local tensor below autograd and bumps nothing
# there. So the step pre-hook above, in the same pass over the optimizer's parameters, bumps
# the storage's version of every aliased group whose sharded parameters the step will update
# (those with a gradient): its unsharded parameters share that counter, so a backward that
# saved them fails as on the plain module. With no graph holding them (a step between steps,
# the usual order) the bump changes nothing; another model's optimizer bumps nothing.
