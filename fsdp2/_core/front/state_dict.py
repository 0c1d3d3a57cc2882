"""State-dict hooks: sharded models load full (unsharded) tensors too.

``model.state_dict()`` returns the sharded parameters, DTensors, under their original
names (detached): as torch's FSDP2, a state-dict pre-hook on each module owning managed
parameters reshards its groups first (after a forward whose backward has not run, after
``unshard()``, between micro-batches with ``set_reshard_after_backward(False)``), so that
the sharded parameters are registered afterwards too; a later forward or backward gathers
them again. Loading copies into the sharded parameters (registered for the load) and the
``fully_shard`` module reshards the group afterwards. A post-hook
also re-wraps each value so that its wrapper has storage offset 0 (see ``param._wrap``:
torch 2.13 cannot pickle a DTensor whose local tensor is a view at an offset, which ours
are; ``detach()`` builds a new wrapper). Loading copies each value into its DTensor
parameter, and a plain full tensor (a checkpoint of the unsharded model, e.g. a Hugging
Face state dict loaded on CPU) cannot be copied into a DTensor. A load pre-hook on each
module that owns managed parameters replaces such a value by this rank's shard of it:
every rank holds the full tensor, so no communication is needed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp2._core.params.dtypes import check as check_grad_dtypes
from fsdp2._core.params.group import ParamGroup, Sharded
from fsdp2._core.params.param import _wrap
from fsdp2._core.runtime import relayout


def register_state_dict_hooks(group: ParamGroup) -> None:
    """Let every owner module of ``group``'s parameters accept full tensors and return
    picklable DTensors."""
    by_module: dict[int, tuple[nn.Module, list[tuple[str, Any]]]] = {}
    for p in group.params:
        for m, name in p.owners:
            by_module.setdefault(id(m), (m, []))[1].append((name, p))
    for m, entries in by_module.values():
        m.register_state_dict_pre_hook(_Reshard(group))
        m.register_load_state_dict_pre_hook(_ShardFullTensors(group, entries))
        m.register_load_state_dict_post_hook(_AdoptAssigned(group))
        m.register_state_dict_post_hook(_Picklable(group, entries))


def register_load_reshard(modules: list[nn.Module], groups: list[ParamGroup]) -> None:
    """After a load into one of ``modules`` (a ``fully_shard`` call's), reshard its groups
    left unsharded: the values loaded went into the sharded parameters, so the unsharded
    copy is stale. A load into a submodule alone leaves that to the next forward or
    ``unshard()`` (the version counters moved: [Note: stale unsharded] in group.py)."""

    def reshard(module: nn.Module, incompatible_keys: Any) -> None:
        for g in groups:
            if g.sharded_state is not Sharded.SHARDED:
                g.reshard()

    for m in modules:
        m.register_load_state_dict_post_hook(reshard)


class _Reshard:
    """State-dict pre-hook: reshard the group (torch's FSDP2 does the same), so that the
    state dict holds, and the module registers, the sharded parameters."""

    def __init__(self, group: ParamGroup) -> None:
        self.group = group

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self.group.sharded_state is not Sharded.SHARDED:
            self.group.reshard()


class _Picklable:
    """State-dict post-hook: DTensor values get a zero-offset wrapper (same local
    tensor)."""

    def __init__(self, group: ParamGroup, entries: list[tuple[str, Any]]) -> None:
        self.group = group
        self.entries = entries

    def __call__(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
    ) -> None:
        for name, _ in self.entries:
            value = state_dict.get(prefix + name)
            if isinstance(value, DTensor) and value.storage_offset() != 0:
                state_dict[prefix + name] = _wrap(
                    value._local_tensor, value._spec, value.requires_grad
                )


class _AdoptAssigned:
    """Load post-hook: ``assign=True`` swapped parameter objects; adopt them."""

    def __init__(self, group: ParamGroup) -> None:
        self.group = group

    def __call__(self, module: nn.Module, incompatible_keys: Any) -> None:
        relayout.adopt_registered(self.group)


class _ShardFullTensors:
    """Load pre-hook: full plain tensors of the right shape become local shards."""

    def __init__(self, group: ParamGroup, entries: list[tuple[str, Any]]) -> None:
        self.group = group
        self.entries = entries

    def __call__(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
    ) -> None:
        check_grad_dtypes(self.group.params, thorough=True)  # [Note: gradient dtypes]
        if self.group.sharded_state is Sharded.UNSHARDED:
            # load into the sharded parameters; the fully_shard module's post-hook reshards
            # once its whole subtree has read its values (which may view the unsharded ones)
            self.group.register_sharded()
        for name, p in self.entries:
            key = prefix + name
            value = state_dict.get(key)
            if (
                not isinstance(value, torch.Tensor)
                or isinstance(value, DTensor)
                or value.shape != p.global_shape
            ):
                continue  # missing keys and shape errors are load_state_dict's to report
            sharded = p.sharded
            # No communication: every rank holds the full value and keeps its piece.
            state_dict[key] = distribute_tensor(
                value.detach().to(sharded.device),
                sharded.device_mesh,
                sharded.placements,
                src_data_rank=None,
            )
