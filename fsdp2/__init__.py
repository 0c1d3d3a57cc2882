"""fsdp2: fully sharded data parallel training for PyTorch, API-compatible
with ``torch.distributed.fsdp.fully_shard``."""

from .api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .fully_shard import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
]
