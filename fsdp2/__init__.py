"""fsdp2: fully sharded data parallel training for PyTorch, API-compatible
with torch's FSDP2 ``fully_shard`` (torch 2.13's API; runs on torch 2.11 to 2.14)."""

from fsdp2._core.support import compat as _compat  # noqa: F401, I001  (first: refuses a torch older than fsdp2 supports)
from typing import TYPE_CHECKING, Any

from fsdp2 import optim
from fsdp2._version import __version__
from fsdp2._core.front import pipelining as _pipelining  # noqa: F401  (fsdp2 enables it itself)
from fsdp2._core.support.debug import is_debug, set_debug
from fsdp2.api import (
    AllGather,
    Comm,
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ReduceScatter,
    ShardPlacementResult,
    cpu_offload_by_budget,
)
from fsdp2.clip import clip_grad_norm_
from fsdp2._core.front.replicate import ReplicateModule, replicate
from fsdp2._core.front.sharding import (
    FSDPModule,
    GradientReductionHandle,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)

if TYPE_CHECKING:
    from fsdp2 import checkpoint
    from fsdp2.planning.estimate import MemoryEstimate, estimate_memory
    from fsdp2.planning.timeline import Timeline, timeline

# Imported at first use (PEP 562): `import fsdp2` costs what training needs, no more
# (docs/benchmarks.md, "Import time").
_LAZY = {
    "checkpoint": ("fsdp2.checkpoint", None),
    "MemoryEstimate": ("fsdp2.planning.estimate", "MemoryEstimate"),
    "estimate_memory": ("fsdp2.planning.estimate", "estimate_memory"),
    "Timeline": ("fsdp2.planning.timeline", "Timeline"),
    "timeline": ("fsdp2.planning.timeline", "timeline"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'fsdp2' has no attribute {name!r}")
    import importlib

    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__",
    "AllGather",
    "CPUOffloadPolicy",
    "Comm",
    "DataParallelMeshDims",
    "FSDPModule",
    "GradientReductionHandle",
    "MemoryEstimate",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReduceScatter",
    "ReplicateModule",
    "ShardPlacementResult",
    "Timeline",
    "UnshardHandle",
    "checkpoint",
    "clip_grad_norm_",
    "cpu_offload_by_budget",
    "estimate_memory",
    "fully_shard",
    "is_debug",
    "optim",
    "register_fsdp_forward_method",
    "replicate",
    "set_debug",
    "share_comm_ctx",
    "timeline",
]
