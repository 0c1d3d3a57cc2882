"""Run code written for torch's FSDP2 (accelerate, the HF Trainer, transformers, Lightning,
torchtitan) on fsdp2 with one call: :func:`use_fsdp2`, which also turns fsdp2's modes on
for the models those frameworks shard (``use_fsdp2(deterministic=True)``, ...). See
docs/frameworks.md."""

from fsdp2.integrations._modes import Modes
from fsdp2.integrations._switch import (
    current_modes,
    is_using_fsdp2,
    restore_torch_fsdp,
    use_fsdp2,
    using_fsdp2,
)

__all__ = [
    "Modes",
    "current_modes",
    "is_using_fsdp2",
    "restore_torch_fsdp",
    "use_fsdp2",
    "using_fsdp2",
]
