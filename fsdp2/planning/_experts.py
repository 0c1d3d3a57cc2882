"""Stacked expert parameters in :func:`fsdp2.estimate_memory`: sharded as torchtitan shards
them, and a warning where a sharded model still holds them padded.

[Note: expert placement]
A mixture of experts stacks its experts' weights in 3-D parameters ``(num_experts, out, in)``
(Hugging Face's Mixtral and Qwen2-MoE ``experts.gate_up_proj`` and ``down_proj``,
``fsdp2.models.moe``'s ``w1``, ``w2``, ``w3``). ``fully_shard``'s default, ``Shard(0)``,
splits the experts: over more shard ranks than experts, each of the first ``num_experts``
ranks holds a whole expert and every other rank padding, so rank 0 holds (and every
all-gather moves) ``shard_size / num_experts`` times its even share. torchtitan shards them
on dim 1 then (``efsdp * ep > num_experts``; ``parallelize_moe`` does the same, docs/moe.md,
"What Shard(1) buys"): every rank an equal slice of every expert, nothing padded.
``estimate_memory(shard_placement_fn="auto")``, its default, places them so (``auto``):
``Shard(1)`` for a 3-D parameter whose dim 0 is smaller than the shard size when dim 1
divides evenly over it (``fully_shard`` takes ``Shard(d > 0)`` only then), else dim 0.
Whoever sharded the model, ``padded`` finds the 3-D parameters still on dim 0 with fewer
rows than shard ranks, for a warning that says how to fix it (``PaddedExperts``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from fsdp2._core.support.unsharded import sharded_owners

Placement = Callable[[nn.Parameter], Shard | None]


def _shape(p: nn.Parameter) -> tuple[int, ...]:
    """The shape ``fully_shard`` splits: a tensor-parallel parameter's local one."""
    return tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape)


def auto(shard_size: int) -> Placement:
    """``shard_placement_fn`` for a mesh of ``shard_size`` shard ranks: ``Shard(1)`` for a
    3-D parameter with fewer rows than that and a dim 1 that divides evenly over it, else
    ``None`` (dim 0). See [Note: expert placement]."""

    def placement(p: nn.Parameter) -> Shard | None:
        shape = _shape(p)
        if len(shape) == 3 and shape[0] < shard_size and shape[1] % shard_size == 0:
            return Shard(1)
        return None

    return placement


def on_dim1(p: nn.Parameter) -> Shard | None:
    """``shard_placement_fn``: every 3-D parameter on dim 1 (``fully_shard`` refuses one whose
    dim 1 does not divide evenly), the rest on dim 0."""
    return Shard(1) if len(_shape(p)) == 3 else None


class Padded(NamedTuple):
    """A 3-D parameter sharded on dim 0 over more shard ranks than its rows."""

    fqn: str
    shape: tuple[int, ...]
    shard_size: int


def padded(model: nn.Module) -> list[Padded]:
    """``model``'s (sharded) 3-D parameters on dim 0 with fewer rows than shard ranks."""
    owners = sharded_owners()
    found = []
    for name, p in model.named_parameters():
        owner = owners.get(id(p))
        if owner is None:
            continue
        group, fp = owner
        shape, size = tuple(fp.shape), group.info.shard_size
        if len(shape) == 3 and fp.shard_dim == 0 and shape[0] < size:
            found.append(Padded(name, shape, size))
    return found


def any_on_dim1(model: nn.Module) -> bool:
    """Whether any of ``model``'s (sharded) 3-D parameters is sharded on dim 1."""
    owners = sharded_owners()
    found = (owners.get(id(p)) for p in model.parameters())
    return any(o is not None and len(o[1].shape) == 3 and o[1].shard_dim == 1 for o in found)


def message(found: list[Padded], fix: str) -> str:
    """What ``found`` costs, then ``fix``: one paragraph, block indices folded (``*``)."""
    names: dict[str, tuple[int, ...]] = {}
    for f in found:
        names.setdefault(re.sub(r"\.\d+\.", ".*.", f.fqn), f.shape)
    rows, size = found[0].shape[0], found[0].shard_size
    return (
        f"{' and '.join(f'{n} {s}' for n, s in names.items())} are sharded on dim 0, {rows} "
        f"rows over {size} shard ranks: shard ranks {rows} to {size - 1} hold only padding, "
        f"and rank 0 holds (and every all-gather moves) {size / rows:.3g} times an even "
        f"share of them. {fix}"
    )


class PaddedExperts(UserWarning):
    """``estimate_memory``'s warning: the sharded model holds ``found`` padded (see
    [Note: expert placement])."""

    def __init__(self, text: str, found: list[Padded]) -> None:
        super().__init__(text)
        self.found = found


def fix_for(shard_placement_fn: object, built: bool) -> str:
    """How ``estimate_memory``'s caller shards them on dim 1: its ``build`` (``built``), its
    ``shard_placement_fn`` (``"auto"``: the mesh, as dim 1 does not divide over it)."""
    if built:
        return (
            "Return Shard(1) for them from the shard_placement_fn of build's fully_shard "
            'calls, as parallelize_moe does (docs/moe.md, "What Shard(1) buys").'
        )
    if shard_placement_fn == "auto":
        return (
            "Their dim 1 does not divide evenly over the shard ranks, so "
            'shard_placement_fn="auto" kept dim 0: plan a mesh_shape whose shard size divides '
            "it (an HSDP mesh_shape (R, S) shards over S ranks)."
        )
    return 'shard_placement_fn="auto" (the default) shards them on dim 1, as torchtitan does.'


def warn_padded(model: nn.Module, fix: str) -> None:
    """Warn (``PaddedExperts``) when the sharded ``model`` holds 3-D parameters padded."""
    found = padded(model)
    if found:
        text = f"estimate_memory: {message(found, fix)}"
        warnings.warn(PaddedExperts(text, found), stacklevel=2)
