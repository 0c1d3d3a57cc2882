"""Storage helpers: free and reallocate a tensor's memory while the tensor object (and
every view of it) stays valid. See [Note: flat storage] in param.py."""

from __future__ import annotations

import torch

from fsdp2._core.support.observe import HUB


def free_storage(t: torch.Tensor, owner: str) -> None:
    """Release ``t``'s storage (resize to 0 bytes); views of it stay valid objects.
    Observers are told (resizing is not an operator a dispatch mode sees), with ``owner``
    (the group's path)."""
    storage = t.untyped_storage()
    if storage.nbytes() and t.device.type != "meta":
        storage.resize_(0)
        if HUB.observers:
            HUB.resized(t, owner)


def alloc_storage(t: torch.Tensor, owner: str) -> None:
    """Give ``t``'s storage its bytes back after ``free_storage`` (contents undefined)."""
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if storage.nbytes() != nbytes and t.device.type != "meta":
        storage.resize_(nbytes)
        if HUB.observers:
            HUB.resized(t, owner)


def contiguous_stride(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (as torch computes them)."""
    stride: list[int] = []
    step = 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))
