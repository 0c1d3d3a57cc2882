"""Profiler labels: ``record_function`` ranges around the engine's work, so any
``torch.profiler`` trace shows per group "fsdp2::copy_in layers.3" (the all-gather input: a
cast to ``param_dtype``, CPU offload's host-to-device copy), "fsdp2::all_gather issue ...",
"fsdp2::all_gather wait ...", "fsdp2::copy_out ...", "fsdp2::reduce_scatter pack/issue/wait ...",
"fsdp2::all_reduce issue/wait ...", "fsdp2::reshard ..." inside the hooks' own ranges
("fsdp2::hook pre_forward layers.3", ..., "fsdp2::hook final_callback"), next to the
model's own ops.

Free when no profiler runs and nobody observes: ``label`` checks the profiler's on/off flag
and the observers (observe.py) and returns a shared do-nothing context manager (the label's
string is not even built). ``fsdp2.timeline`` reads these names; observers are told of the
same regions ([Note: observation] in observe.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar, cast

import torch
from torch.autograd.profiler import record_function

from fsdp2._core.support.observe import HUB

__all__ = ["PREFIX", "hook", "label"]

PREFIX = "fsdp2::"
_OFF: AbstractContextManager[Any] = nullcontext()


class _Observed:
    """A region the observers are told of (and the profiler, if one runs)."""

    __slots__ = ("kind", "what", "rf")

    def __init__(self, kind: str, what: str) -> None:
        self.kind, self.what = kind, what
        self.rf: Any = None

    def __enter__(self) -> None:
        HUB.enter(self.kind, self.what)
        if torch._C._autograd._profiler_enabled():
            self.rf = record_function(f"{PREFIX}{self.kind} {self.what}")
            self.rf.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.rf is not None:
            self.rf.__exit__(*exc)
        HUB.exit(self.kind)


def label(kind: str, what: str | Callable[[], str]) -> AbstractContextManager[Any]:
    """``record_function("fsdp2::<kind> <what>")`` while a profiler runs, and a region the
    observers see while any is subscribed, else nothing (``what`` may be a function,
    called only then)."""
    if HUB.observers:
        return _Observed(kind, what() if callable(what) else what)
    if torch._C._autograd._profiler_enabled():
        return record_function(f"{PREFIX}{kind} {what() if callable(what) else what}")
    return _OFF


_F = TypeVar("_F", bound=Callable[..., Any])


def hook(kind: str) -> Callable[[_F], _F]:
    """Label a method ``fsdp2::hook <kind> <self.path>`` (the engine's time in hooks:
    ``fsdp2.timeline``'s "framework", with the waits inside; observers see region
    ``"hook <kind>"``)."""
    region = f"hook {kind}"

    def deco(fn: _F) -> _F:
        @functools.wraps(fn)
        def labelled(self: Any, *args: Any, **kwargs: Any) -> Any:
            if HUB.observers or torch._C._autograd._profiler_enabled():
                with label(region, self.path):
                    return fn(self, *args, **kwargs)
            return fn(self, *args, **kwargs)

        return cast(_F, labelled)

    return deco
