"""fsdp2: fully sharded data parallel training for PyTorch, API-compatible
with torch's FSDP2 ``fully_shard`` (torch 2.13's API; runs on torch 2.11 to 2.14)."""

from fsdp2._core import compat as _compat  # noqa: F401, I001  (first: refuses a torch older than fsdp2 supports)
from fsdp2 import checkpoint, optim
from fsdp2._core.debug import is_debug, set_debug
from fsdp2.api import (
    AllGather,
    Comm,
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ReduceScatter,
    ShardPlacementResult,
)
from fsdp2.clip import clip_grad_norm_
from fsdp2._core.sharding import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from fsdp2.planning.estimate import MemoryEstimate, estimate_memory
from fsdp2.planning.timeline import Timeline, timeline

__all__ = [
    "AllGather",
    "CPUOffloadPolicy",
    "Comm",
    "DataParallelMeshDims",
    "FSDPModule",
    "MemoryEstimate",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReduceScatter",
    "ShardPlacementResult",
    "Timeline",
    "UnshardHandle",
    "checkpoint",
    "clip_grad_norm_",
    "estimate_memory",
    "fully_shard",
    "is_debug",
    "optim",
    "register_fsdp_forward_method",
    "set_debug",
    "share_comm_ctx",
    "timeline",
]
