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
from collections import Counter
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


def peak_step_bytes_compiled(  # type: ignore[no-untyped-def]
    step: Callable[[], object], model: torch.nn.Module, optim, names: Counter[str] | None = None
) -> int:
    """``peak_step_bytes`` for a step with ``torch.compile``d code in it (``names``, if
    given, counts the names of the step's profiler events, e.g. ``gloo:all_gather``).

    Under a dispatch mode dynamo skips compiled frames (they run eagerly, op by op), so
    this counts tensor allocations instead, through ``torch.profiler``'s memory events:
    c10's CPU allocator reports every allocation made while profiling (inductor's buffers
    included, they come from ``empty_strided``) and every free of such a block; the peak
    of their running sum is the step's peak over the persistent state. Frees of blocks
    allocated before the step are not reported (none in a step that starts after
    ``zero_grad(set_to_none=True)``), and memory not from c10's allocator (gloo's own
    buffers, Python objects) is not counted.
    """
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    every = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    if names is not None:
        names.update(e.name() for e in every)
    events = [e for e in every if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return persistent_bytes(model, optim) + peak
