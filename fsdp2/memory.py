"""``fsdp2.memory``: the import path of ``estimate_memory`` before the package had folders;
the code is in ``fsdp2/planning/`` (``estimate.py``, ``tracker.py``)."""

from fsdp2.planning.estimate import PARTS, MemoryEstimate, estimate_memory

__all__ = ["PARTS", "MemoryEstimate", "estimate_memory"]
