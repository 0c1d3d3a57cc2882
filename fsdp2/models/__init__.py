"""Reference models used by the example trainer, the benchmarks and the tests.
Not part of the sharding library: ``fsdp2``'s core never imports this package."""

from fsdp2.models.llama import Llama, LlamaConfig, TransformerBlock

__all__ = ["Llama", "LlamaConfig", "TransformerBlock"]
