"""The unsharded parameters an optimizer must never hold, and the check at every optimizer
step that none does.

# [Note: optimizers holding unsharded parameters]
# Outside forward and backward a module's registered parameters are normally its sharded
# DTensors, the ones an optimizer must update. While a group is unsharded (a training forward
# keeps the root's for its backward; ``set_reshard_after_backward(False)``; a create_graph
# backward's hold; ``unshard()``) the modules hold the unsharded parameters instead: copies
# the next all-gather overwrites, whose gradients are reduced away. An optimizer built from
# them trains nothing, silently (torch's FSDP2 does that after a sanity forward). So:
#
# * ``FSDPModule.named_parameters`` (so ``parameters()``, ``requires_grad_``, ``zero_grad``)
#   gives the sharded parameters of the groups the engine keeps unsharded, outside forward and
#   backward (``StepContext.sharded_for``). The module attributes still hold the unsharded
#   ones (a chunked loss calls the head outside the forward), and so does ``parameters()``
#   after a user's ``unshard()`` (``ParamGroup.by_user``: torch's behaviour, which scripts
#   use to read the unsharded values) until the group reshards or a forward uses it;
# * a plain submodule's ``parameters()`` (one fsdp2 did not wrap) and ``unshard()`` still
#   hand out unsharded tensors. Every group's unsharded parameters are tracked here (the
#   groups weakly) and a global optimizer step pre-hook
#   (``torch.optim.optimizer.register_optimizer_step_pre_hook``, installed by the first
#   ``fully_shard``) raises before a step that would update one, naming the parameter and
#   the fix. The cost is one dictionary lookup per parameter per step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["install_optimizer_check", "track"]

# Every group's parameters, tracked weakly (a weak reference to an unsharded parameter itself
# would stop ``torch.utils.swap_tensors``, which relayouts use): the check looks parameters
# up by identity in a map rebuilt whenever a group's parameter objects changed.
_GROUPS: weakref.WeakSet[Any] = weakref.WeakSet()
_epoch = 0
_Entry = tuple[weakref.ref[Any], int, bool]  # (group, index in group.params, sharded face)
_map: tuple[int, dict[int, _Entry]] = (-1, {})
_installed = False


def track(group: Any) -> None:
    """(Re)track ``group``'s parameters (``group.params[i].unsharded`` / ``.sharded``): call
    whenever its parameter objects change. ``group`` is a ``ParamGroup``."""
    global _epoch
    _GROUPS.add(group)
    _epoch += 1


def _tracked_map() -> dict[int, _Entry]:
    """``id(parameter) -> (its group, its index in group.params, whether it is the sharded
    face)``: every unsharded parameter, and the sharded ones of groups with one shard rank
    (which may forward on views of them: [Note: steps between forward and backward])."""
    global _map
    if _map[0] != _epoch:
        found: dict[int, _Entry] = {}
        for g in list(_GROUPS):
            ref = weakref.ref(g)
            for i, p in enumerate(g.params):
                if p.unsharded is not None:
                    found[id(p.unsharded)] = (ref, i, False)
                if g.world == 1:
                    found[id(p.sharded)] = (ref, i, True)
        _map = (_epoch, found)
    return _map[1]


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
            if entry[2]:  # a sharded parameter of a group with one shard rank
                if fp.sharded is p and p.grad is not None and group.aliased:
                    written[id(group)] = group
                continue
            if fp.unsharded is not p:
                continue  # an id that outlived its parameter
            raise RuntimeError(
                f"fsdp2: {type(optimizer).__name__}.step() would update the unsharded "
                f"parameter {fp.fqn} (param_groups[{i}]['params'][{j}]) "
                f"of fully_shard({group.name}), a temporary copy that the next all-gather "
                "overwrites: the optimizer was built while that module's parameters were "
                "unsharded (after a forward whose backward had not run, or unshard()), "
                "from a module whose parameters() gives the registered tensors. Build the "
                "optimizer from the sharded parameters: before the first forward, after a "
                "backward or model.reshard(), or from the fully_shard module's "
                "parameters(). See docs/reliability.md (call orders)"
            )
    for group in written.values():  # see [Note: steps between forward and backward]
        torch.autograd.graph.increment_version(group.sharded_flat)


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
