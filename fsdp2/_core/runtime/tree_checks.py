"""Checks a root runs over its tree of ``fully_shard`` states at lazy init, before any
collective: each parameter in one group, one device, nothing left on meta."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from fsdp2._core.params.group import ParamGroup


def check_materialized(groups: list[ParamGroup], roots: list[nn.Module]) -> None:
    """Parameters left on the meta device cannot be gathered: say which (full names),
    before any collective (torch's FSDP2 raises RuntimeError here too)."""
    meta = [p.sharded for g in groups for p in g.params if p.sharded.is_meta]
    if meta:
        names = {id(t): n for root in roots for n, t in root.named_parameters()}
        on_meta = [names.get(id(t), "?") for t in meta]
        listing = ", ".join(on_meta[:20]) + (
            f" and {len(on_meta) - 20} more" if len(on_meta) > 20 else ""
        )
        raise RuntimeError(
            f"fully_shard parameters must be materialized before the first forward, but these "
            f"are still on the meta device: {listing}. Call model.to_empty(device=...) and then "
            "initialize them (e.g. reset_parameters() on each module, or your init_weights())"
        )


def validate_tree(groups: list[ParamGroup]) -> None:
    """Each parameter in one group, every group on one device (ValueError otherwise)."""
    owner: dict[int, str] = {}
    devices: dict[torch.device, str] = {}
    for g in groups:
        devices.setdefault(g.device, g.name)
        for p in g.params:
            key = id(p.sharded)
            if key in owner and owner[key] != g.name:
                raise ValueError(
                    f"parameter {p.fqn} is managed by both fully_shard({owner[key]}) and "
                    f"fully_shard({g.name}); group the modules that share it in one call: "
                    "fully_shard([a, b])"
                )
            owner[key] = g.name
    if len(devices) > 1:
        listing = ", ".join(f"{name} on {dev}" for dev, name in devices.items())
        raise ValueError(
            f"all fully_shard groups under one root must use one device, got {listing}; "
            "pass the same mesh (or meshes on the same device type) to every fully_shard call"
        )
