"""fsdp2 under torchft: each replica group a fault domain. See docs/fault_tolerance.md.

torchft (``pip install torchft``) runs several replica groups of the same job that agree on a
quorum every step through a lighthouse: a group that dies is dropped and the others go on, and
a group that comes back heals from a live peer. Inside each group the model is sharded with
``fully_shard`` over the group's own ranks; :func:`wire` makes the groups train as one.

# [Note: torchft wiring]
# Gradients: every ``FSDPModule``'s all-reduce hook (every parameter group of it: per-parameter
# meshes and expert parallelism included, see ``set_all_reduce_hook``) averages the reduced
# shard over the replica groups in the quorum with ``manager.allreduce``; a group that is
# healing contributes zeros, torchft's rule. Rank r of one group holds the same shard as rank
# r of every other group, so the hook averages like for like.
# State: what a healing group fetches is this rank's own shards (the local tensors of the
# sharded parameters, the persistent buffers, the optimizer state with each DTensor as its
# local tensor): rank r of the healthy group sends to rank r of the healing one, which has the
# same layout, so no collective and no full tensor is needed. torchft reads it from its quorum
# thread, possibly while the training thread runs a forward: the reader touches nothing of
# fsdp2's step (no ``state_dict()``, whose hooks reshard; the sharded parameters are read
# where the engine keeps them, not where a forward registers unsharded ones), and the
# optimizer step holds torchft's state-dict lock so that no read sees half a step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2._core.front.module import FSDPModule
from fsdp2._core.front.seam import managed_params
from fsdp2._core.support.unsharded import REPLICA_MARK
from fsdp2.optim import _sharded_like

__all__ = ["wire"]

KEY = "fsdp2"


def wire(
    manager: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    key: str = KEY,
    average_gradients: bool = True,
) -> None:
    """Make ``model``, sharded with ``fully_shard`` inside one torchft replica group, train
    as one model across the replica groups of ``manager`` (a ``torchft.Manager``).

    * The all-reduce hook of every ``FSDPModule`` in ``model`` (every parameter group)
      averages each reduced gradient shard over the replica groups
      (``manager.allreduce``).
    * ``manager.register_state_dict_fn(key, ...)``: a healing replica group loads this rank's
      shards (parameters, persistent buffers, ``optimizer``'s state) from the same rank of a
      healthy group. Register other state (an LR scheduler, the data loader) under keys of
      your own.
    * ``optimizer.step`` holds torchft's state-dict lock, so that a peer never reads half a
      step.

    ``average_gradients=False`` leaves the gradients alone, for torchft's ``LocalSGD`` /
    ``DiLoCo``, which average the parameters every few steps themselves (they read the
    sharded parameters' local shards between steps, which fsdp2 keeps registered).

    Call it once, after ``fully_shard`` and building ``optimizer`` (the plain optimizer; wrap
    it in ``torchft.optim.OptimizerWrapper`` for the loop, which starts the quorum in
    ``zero_grad`` and commits in ``step``). See [Note: torchft wiring].

    Raises:
        ValueError: ``optimizer`` is a ``fsdp2.replica_optim.ReplicaShardedOptimizer``;
            a parameter of ``model`` is not managed by ``fully_shard`` (its gradient
            would not be averaged across the replica groups), or ``optimizer`` holds a
            parameter that is not ``model``'s.
    """
    if getattr(optimizer, REPLICA_MARK, False):
        raise ValueError(
            "fsdp2.integrations.torchft.wire: the optimizer is a ReplicaShardedOptimizer "
            "(fsdp2.replica_optim), whose state is cut into pieces over HSDP's replicas; "
            "torchft heals a replica group from the same rank of another group and averages "
            "whole shards across groups, so wire the plain optimizer (torchft owns the "
            "replica dimension; see docs/parallelism.md)"
        )
    managed = managed_params(model, recurse=True)
    ids = {id(m.sharded) for m in managed}
    owners = {(id(mod), name) for m in managed for mod, name in m.owners}
    loose = [
        f"{path}.{name}" if path else name
        for path, module in model.named_modules()
        for name, p in module._parameters.items()
        if p is not None and (id(module), name) not in owners and p.requires_grad
    ]
    if loose and average_gradients:
        raise ValueError(
            f"fsdp2.integrations.torchft.wire: {', '.join(loose)} are not managed by "
            "fully_shard, so their gradients would not be averaged across the replica "
            "groups: shard the modules that hold them (or freeze them)"
        )
    foreign = [
        f"param_groups[{g}]['params'][{i}]"
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
        if id(p) not in ids
    ]
    if foreign:
        raise ValueError(
            f"fsdp2.integrations.torchft.wire: the optimizer's {', '.join(foreign)} are not "
            "parameters of the model sharded with fully_shard: build the optimizer from "
            "model.parameters() after fully_shard"
        )

    def hook(output: torch.Tensor) -> None:
        manager.allreduce(output).wait()

    for module in model.modules():
        if average_gradients and isinstance(module, FSDPModule):
            module.set_all_reduce_hook(hook)

    paths = {id(module): path for path, module in model.named_modules()}

    def state_dict() -> dict[str, Any]:
        return {
            "params": dict(_local_params(model, paths)),
            "buffers": dict(_buffers(model)),
            "optim": _to_local(optimizer.state_dict()),
        }

    def load_state_dict(state: dict[str, Any]) -> None:
        params = dict(_local_params(model, paths))
        missing = set(params) ^ set(state["params"])
        if missing:
            raise ValueError(
                f"fsdp2.integrations.torchft: the healing state does not match this model: "
                f"{sorted(missing)[:5]} differ (the replica groups must build the same model "
                "on the same layout)"
            )
        buffers = dict(_buffers(model))
        with torch.no_grad():
            for name, local in params.items():
                local.copy_(state["params"][name])
            for name, value in state["buffers"].items():
                buffers[name].copy_(value)
        managed_params(model, recurse=True, reshard=True)  # no stale unsharded copy
        optimizer.load_state_dict(_to_dtensors(state["optim"], optimizer))

    manager.register_state_dict_fn(key, load_state_dict, state_dict)
    optimizer.register_step_pre_hook(lambda *_: manager.disallow_state_dict_read())
    optimizer.register_step_post_hook(lambda *_: manager.allow_state_dict_read())


def _local_params(model: nn.Module, paths: dict[int, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, this rank's shard)`` of every managed parameter, read where the engine keeps
    the sharded parameter (whatever a forward has registered meanwhile)."""
    for m in managed_params(model, recurse=True):
        module, name = m.owners[0]
        path = paths[id(module)]
        yield (f"{path}.{name}" if path else name), m.sharded._local_tensor


def _buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The persistent buffers (what ``state_dict()`` holds besides the parameters)."""
    for path, module in model.named_modules():
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                yield (f"{path}.{name}" if path else name), b


def _to_local(tree: Any) -> Any:
    if isinstance(tree, DTensor):
        return tree._local_tensor
    if isinstance(tree, dict):
        return {k: _to_local(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_local(v) for v in tree]
    return tree


def _to_dtensors(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer state dict of local tensors (``state_dict()`` above) with each state
    tensor shaped like its parameter's shard wrapped back as that parameter's DTensor (as
    ``step_on_local_shards`` does after a local step)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = dict(state)
    state["state"] = {
        index: {
            k: _sharded_like(p, p._local_tensor, v, None) if isinstance(p, DTensor) else v
            for k, v in entry.items()
        }
        for index, entry in state["state"].items()
        for p in [params[int(index)]]
    }
    return state
