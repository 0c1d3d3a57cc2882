"""Profiler labels: ``record_function`` ranges around the engine's work, so any
``torch.profiler`` trace shows per group "fsdp2::copy_in layers.3" (the all-gather input: a
cast to ``param_dtype``, CPU offload's host-to-device copy), "fsdp2::all_gather issue ...",
"fsdp2::all_gather wait ...", "fsdp2::copy_out ...", "fsdp2::reduce_scatter pack/issue/wait ...",
"fsdp2::all_reduce issue/wait ...", "fsdp2::reshard ..." inside the hooks' own ranges
("fsdp2::hook pre_forward layers.3", ..., "fsdp2::hook final_callback"), next to the
model's own ops.

Free when no profiler runs: ``label`` checks the profiler's on/off flag and returns a shared
do-nothing context manager (the label's string is not even built). ``fsdp2.timeline`` reads
these names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar, cast

import torch
from torch.autograd.profiler import record_function

__all__ = ["PREFIX", "hook", "label"]

PREFIX = "fsdp2::"
_OFF: AbstractContextManager[Any] = nullcontext()

# While ``fsdp2.estimate_memory`` simulates a step: its tracker, told of every label and
# hook so it can sort the memory allocated inside them (see fsdp2/planning/estimate.py).
watch: Any = None


def label(kind: str, what: str | Callable[[], str]) -> AbstractContextManager[Any]:
    """``record_function("fsdp2::<kind> <what>")`` while a profiler runs, else nothing
    (``what`` may be a function, called only then)."""
    if watch is not None:
        return watch.label(kind)  # type: ignore[no-any-return]
    if torch._C._autograd._profiler_enabled():
        return record_function(f"{PREFIX}{kind} {what() if callable(what) else what}")
    return _OFF


_F = TypeVar("_F", bound=Callable[..., Any])


def hook(kind: str) -> Callable[[_F], _F]:
    """Label a state's hook method ``fsdp2::hook <kind> <its group's path>`` (the
    engine's time in hooks: ``fsdp2.timeline``'s "framework", with the waits inside)."""

    def deco(fn: _F) -> _F:
        @functools.wraps(fn)
        def labelled(self: Any, *args: Any, **kwargs: Any) -> Any:
            if watch is not None:
                with watch.hook(kind, self):
                    return fn(self, *args, **kwargs)
            if torch._C._autograd._profiler_enabled():
                what = self.group.path if self.group is not None else type(self.modules[0]).__name__
                with record_function(f"{PREFIX}hook {kind} {what}"):
                    return fn(self, *args, **kwargs)
            return fn(self, *args, **kwargs)

        return cast(_F, labelled)

    return deco
