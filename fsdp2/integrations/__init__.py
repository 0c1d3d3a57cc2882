"""Run code written for torch's FSDP2 (accelerate, the HF Trainer, transformers, Lightning,
torchtitan) on fsdp2 with one call: :func:`use_fsdp2`. See docs/frameworks.md."""

from fsdp2.integrations._switch import (
    is_using_fsdp2,
    restore_torch_fsdp,
    use_fsdp2,
    using_fsdp2,
)

__all__ = ["is_using_fsdp2", "restore_torch_fsdp", "use_fsdp2", "using_fsdp2"]
