"""Reference models used by the example trainer, the benchmarks and the tests.
Not part of the sharding library: ``fsdp2``'s core never imports this package."""

from fsdp2.models.llama import Llama, LlamaConfig, TransformerBlock
from fsdp2.models.moe import (
    GroupedExperts,
    MoE,
    MoEBlock,
    MoEConfig,
    MoETransformer,
    apply_expert_parallel,
    parallelize_moe,
)

__all__ = [
    "GroupedExperts",
    "Llama",
    "LlamaConfig",
    "MoE",
    "MoEBlock",
    "MoEConfig",
    "MoETransformer",
    "TransformerBlock",
    "apply_expert_parallel",
    "parallelize_moe",
]
