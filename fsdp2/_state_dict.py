"""State-dict hooks: sharded models load full (unsharded) tensors too.

``model.state_dict()`` needs nothing from us: the registered parameters are
the sharded DTensors under their original names. Loading, however, copies each
value into its DTensor parameter, and a plain full tensor (a checkpoint of the
unsharded model, e.g. a Hugging Face state dict loaded on CPU) cannot be
copied into a DTensor. A load pre-hook on each module that owns managed
parameters replaces such a value by this rank's shard of it: every rank holds
the full tensor, so no communication is needed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ._param_group import ParamGroup


def register_load_hooks(group: ParamGroup) -> None:
    """Let every owner module of ``group``'s parameters accept full tensors."""
    by_module: dict[int, tuple[nn.Module, list[tuple[str, Any]]]] = {}
    for p in group.params:
        for m, name in p.owners:
            by_module.setdefault(id(m), (m, []))[1].append((name, p))
    for m, entries in by_module.values():
        m.register_load_state_dict_pre_hook(_ShardFullTensors(group, entries))
        m.register_load_state_dict_post_hook(_AdoptAssigned(group))


class _AdoptAssigned:
    """Load post-hook: ``assign=True`` swapped parameter objects; adopt them."""

    def __init__(self, group: ParamGroup) -> None:
        self.group = group

    def __call__(self, module: nn.Module, incompatible_keys: Any) -> None:
        self.group.adopt_registered()


class _ShardFullTensors:
    """Load pre-hook: full plain tensors of the right shape become local shards."""

    def __init__(self, group: ParamGroup, entries: list[tuple[str, Any]]) -> None:
        self.group = group
        self.entries = entries

    def __call__(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
    ) -> None:
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
