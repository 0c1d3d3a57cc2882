"""``estimate_memory``'s ``offload_policy``: one policy for every ``fully_shard`` call, or a
mapping from parameter names relative to the model (``fsdp2.cpu_offload_by_budget(model,
budget)``'s), which the simulation splits into each call's own map ([Note: offload by name]
in fsdp2/_core/front/offload.py: a call's names are relative to its module).

What a rank holds between steps on the host (``MemoryEstimate.held_on_host``) is read from
the engine's own groups: the parameters of groups whose state rests there
(``offload_after_backward=True``), their gradients and optimizer state ([Note: offload by
phase] in fsdp2/_core/params/residence.py), also on a CPU plan, where host and device are
one memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch.nn as nn

from fsdp2.api import CPUOffloadPolicy, OffloadPolicy

Offload = OffloadPolicy | Mapping[str, OffloadPolicy]


def unpinned(offload: Offload) -> Offload:
    """``offload`` with ``pin_memory=False`` (the same bytes; pinning needs an accelerator
    the plan may lack)."""
    if isinstance(offload, Mapping):
        return {name: unpinned(p) for name, p in offload.items()}  # type: ignore[misc]
    if isinstance(offload, CPUOffloadPolicy):
        return dataclasses.replace(offload, pin_memory=False)
    return offload


def describe(offload: Offload) -> str:
    """How the settings name ``offload`` (``""`` for none)."""
    if isinstance(offload, Mapping):
        n = sum(isinstance(p, CPUOffloadPolicy) for p in offload.values())
        return f", CPU offload of {n} parameter{'s' if n != 1 else ''}" if n else ""
    if not isinstance(offload, CPUOffloadPolicy):
        return ""
    flags = [
        f"{f}=False"
        for f in ("offload_after_forward", "offload_after_backward")
        if not getattr(offload, f)
    ]
    return ", CPU offload" + (f" ({', '.join(flags)})" if flags else "")


def per_call(offload: Offload, model: nn.Module, blocks: list[nn.Module]) -> dict[int, Offload]:
    """``id(module) -> offload_policy`` for each block's ``fully_shard`` call and the
    root's: a single policy for every call; a mapping's names to the deepest block whose
    path prefixes them (made relative to it), the others to the root."""
    if not isinstance(offload, Mapping):
        return {id(m): offload for m in [*blocks, model]}
    maps: dict[int, dict[str, OffloadPolicy]] = {id(m): {} for m in [*blocks, model]}
    paths = {name: id(m) for name, m in model.named_modules() if id(m) in maps and name}
    for name, policy in offload.items():
        prefixes = [p for p in paths if name.startswith(p + ".")]
        if prefixes:
            path = max(prefixes, key=len)
            maps[paths[path]][name[len(path) + 1 :]] = policy
        else:
            maps[id(model)][name] = policy
    return dict(maps)
