"""Storage helpers: free and reallocate a tensor's memory while the tensor object (and
every view of it) stays valid. See [Note: flat storage] in param.py."""

from __future__ import annotations

from typing import Any

import torch

# While ``fsdp2.estimate_memory`` simulates a step: its tracker, told of every resize
# (resizing a storage is not an operator its dispatch mode sees).
watch: Any = None


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s storage (resize to 0 bytes); views of it stay valid objects."""
    storage = t.untyped_storage()
    if storage.nbytes() and t.device.type != "meta":
        storage.resize_(0)
        if watch is not None:
            watch.resized(t)


def alloc_storage(t: torch.Tensor) -> None:
    """Give ``t``'s storage its bytes back after ``free_storage`` (contents undefined)."""
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if storage.nbytes() != nbytes and t.device.type != "meta":
        storage.resize_(nbytes)
        if watch is not None:
            watch.resized(t)


def contiguous_stride(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (as torch computes them)."""
    stride: list[int] = []
    step = 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))
