"""A group's run-time settings: what ``FSDPModule``'s setters change.

Two small frozen dataclasses, one per side of a step: how parameters are gathered and
released (``GatherSettings``), and how gradients are reduced (``ReduceSettings``). A group
owns one of each and replaces them through ``ParamGroup.update`` (the one path every
setter takes), which also recomputes what is derived from them, so nothing is derived
per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp2.api import AllGather, ReduceScatter


@dataclass(frozen=True)
class GatherSettings:
    """How a group's parameters are all-gathered and freed.

    Attributes:
        post_forward: ``reshard_after_forward`` normalized: ``True`` frees after forward,
            ``False`` keeps, an int ``k`` keeps a copy sharded over ``k`` ranks.
        reshard_after_backward: free the unsharded parameters after backward.
        unshard_in_backward: all-gather for backward (``False`` when backward does not
            need the parameters).
        comm: a custom all-gather (``set_custom_all_gather``, or the process group's
            allocator), ``None`` for c10d's.
        bucket_bytes: gather with the groups that run next in one all-gather, up to this
            many unsharded bytes (``set_bucket_bytes``); ``None``: alone.
        keep_storage: resharding keeps the unsharded storage allocated, so the unsharded
            parameters keep their data pointers (``set_keep_unsharded_storage``).
    """

    post_forward: bool | int = True
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    comm: AllGather | None = None
    bucket_bytes: int | None = None
    keep_storage: bool = False


@dataclass(frozen=True)
class ReduceSettings:
    """How a group's gradients are reduced.

    Attributes:
        sync: reduce gradients in backward (``False``: accumulate them unsharded,
            ``set_requires_gradient_sync``).
        all_reduce: HSDP: all-reduce over the replicate dim after the reduce-scatter.
        reduce_unused: reduce zeros for parameters without a gradient this backward.
        max_inflight: reductions in flight before the oldest is waited.
        divide_factor: divide by this instead of the data-parallel size.
        force_sum: reduce with ``SUM`` only and divide locally.
        hook: called on each flat reduced gradient before it lands.
        comm: a custom reduce-scatter, ``None`` for c10d's.
        group: a separate process group for reduce-scatters, ``None`` for the shard group.
        bucket_bytes: reduce with the groups whose backward finished next in one
            reduce-scatter, up to this many input bytes (``set_bucket_bytes``); ``None``:
            alone.
        exact: sum micro-batches and ranks in the canonical order, in fp32, and divide
            once (``fsdp2.reduction.set_deterministic``; [Note: canonical sum] in exact.py).
        replica_shard: HSDP: reduce-scatter over the replicate dim instead of the
            all-reduce, each rank keeping its piece of every parameter's gradient
            (``fsdp2.replica_optim``; [Note: pieces] in pieces.py).
    """

    sync: bool = True
    all_reduce: bool = True
    reduce_unused: bool = False
    max_inflight: int = 1
    divide_factor: float | None = None
    force_sum: bool = False
    hook: Callable[[torch.Tensor], None] | None = None
    comm: ReduceScatter | None = None
    group: dist.ProcessGroup | None = None
    bucket_bytes: int | None = None
    exact: bool = False
    replica_shard: bool = False
