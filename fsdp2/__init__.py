"""fsdp2: fully sharded data parallel training for PyTorch, API-compatible
with ``torch.distributed.fsdp.fully_shard``."""

from .api import (
    AllGather,
    Comm,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ReduceScatter,
)
from .clip import clip_grad_norm_
from .fully_shard import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)

__all__ = [
    "AllGather",
    "CPUOffloadPolicy",
    "Comm",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReduceScatter",
    "UnshardHandle",
    "clip_grad_norm_",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
