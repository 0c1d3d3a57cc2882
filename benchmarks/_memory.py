"""Peak live memory of a training step on CPU, without a caching allocator.

``torch.cuda.max_memory_allocated`` has no CPU counterpart, and torch's
``MemTracker`` misses storages grown with ``untyped_storage().resize_`` (how
both FSDP2 implementations allocate unsharded parameters). So we sample the C
heap in use (glibc ``mallinfo2``: arena + mmapped bytes) after every aten op
through a dispatch mode; tensors are the bulk of it. The peak of a step is
``persistent state bytes + (max heap during the step - heap before it)``.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def heap_in_use() -> int:
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class _PeakHeap(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.peak = heap_in_use()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        heap = heap_in_use()
        if heap > self.peak:
            self.peak = heap
        return out


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local)."""
    seen: dict[int, int] = {}
    stack = list(tensors)
    while stack:
        t = stack.pop()
        local = t.to_local() if hasattr(t, "to_local") else t
        if is_traceable_wrapper_subclass(local):  # e.g. torchao float8 weights
            names, _ = local.__tensor_flatten__()
            stack.extend(getattr(local, n) for n in names)
            continue
        st = local.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


def persistent_bytes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    """Parameters (local shards), buffers and optimizer state held between steps."""
    tensors = [*model.parameters(), *model.buffers()]
    for state in optim.state.values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return storage_bytes(tensors)


def peak_step_bytes(step: Callable[[], object], model: torch.nn.Module, optim) -> int:  # type: ignore[no-untyped-def]
    """Run ``step`` once and return its peak live bytes (see module docstring)."""
    gc.collect()
    base = heap_in_use()
    mode = _PeakHeap()
    with mode:
        step()
    return persistent_bytes(model, optim) + max(0, mode.peak - base)
