"""Counting the collectives a training step issues, shared by the communication tests.

``CommCounter`` wraps ``torch.distributed``'s ``all_gather_single``, ``all_gather_into_tensor``,
``reduce_scatter_single``, ``reduce_scatter_tensor`` and ``all_reduce`` (patched on the module
for the ``with`` block only, then restored) and records each call's kind, group size and input
numel as a ``Call``. Tests may interleave marker strings (``mark``, ``mark_computes``) to record
when a module computes relative to the collectives. DTensor's ``full_tensor()`` (functional
collectives) and ``models.full_params`` / ``full_grads`` bypass these patches: tests may check
full gradients inside a counted region.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["Call", "CommCounter", "count_calls", "prefetch_order", "shard_numel"]

_KINDS = {
    "all_gather_single": "AG",
    "all_gather_into_tensor": "AG",
    "reduce_scatter_single": "RS",
    "reduce_scatter_tensor": "RS",
    "all_reduce": "AR",
}
_INPUT_ARG = ("input_tensor", "input", "tensor")


@dataclass(frozen=True)
class Call:
    """One collective issued inside a counted region."""

    kind: str  # "AG", "RS" or "AR"
    api: str  # the torch.distributed function called
    group_size: int
    numel: int  # of the input
    phase: str  # the counter's phase when it was issued ("forward", "backward", ...)
    live_group: bool  # the group is registered in c10d (not destroyed)


class CommCounter(contextlib.AbstractContextManager):
    """Records collectives (see ``Call``) and test markers while the ``with`` block runs.

    ``events`` interleaves ``Call`` objects with marker strings appended by ``mark``; set
    ``phase`` to label the calls that follow.
    """

    def __init__(self) -> None:
        self.events: list[Call | str] = []
        self.phase = "?"
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> CommCounter:
        for api in _KINDS:
            orig = getattr(dist, api, None)
            if orig is not None:
                self._stack.enter_context(mock.patch.object(dist, api, self._wrap(api, orig)))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def mark(self, marker: str) -> None:
        self.events.append(marker)

    def mark_computes(self, computes: Sequence[tuple[str, nn.Module]]) -> None:
        """For each ``(tag, module)``: mark ``C(tag)`` when its forward starts and ``Cb(tag)``
        when its backward starts (hooks registered for good: call once per model)."""
        for tag, mod in computes:
            mod.register_forward_pre_hook(lambda *_, t=tag: self.mark(f"C({t})"))
            mod.register_full_backward_pre_hook(lambda *_, t=tag: self.mark(f"Cb({t})"))

    @property
    def calls(self) -> list[Call]:
        return [e for e in self.events if isinstance(e, Call)]

    def take(self) -> list[Call | str]:
        """Return the events so far and start a fresh list."""
        events, self.events = self.events, []
        return events

    def take_calls(self) -> list[Call]:
        """Return the collectives so far (markers dropped) and start a fresh list."""
        return [e for e in self.take() if isinstance(e, Call)]

    def _wrap(self, api: str, orig: Any) -> Any:
        sig = inspect.signature(orig)

        def counted(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs).arguments
            group = bound.get("group")
            tensor = next(bound[k] for k in _INPUT_ARG if k in bound)
            live = group is None or group in dist.distributed_c10d._world.pg_map
            size = dist.get_world_size() if group is None else group.size()
            self.events.append(Call(_KINDS[api], api, size, tensor.numel(), self.phase, live))
            return orig(*args, **kwargs)

        return counted


def count_calls(calls: Sequence[Call], *fields: str) -> dict[tuple[Any, ...], int]:
    """``(call.<field>, ...) -> count``, e.g. ``count_calls(calls, "phase", "kind")``."""
    return dict(Counter(tuple(getattr(c, f) for f in fields) for c in calls))


def shard_numel(params: Sequence[torch.Tensor], world_size: int) -> int:
    """Per-rank flat size of a group (its all-gather input numel): each parameter padded to
    ``ceil(dim0 / world_size)`` rows."""
    return sum(-(-p.shape[0] // world_size) * math.prod(p.shape[1:]) for p in params)


def prefetch_order(events: Sequence[Call | str], phase: str, by_numel: dict[int, str]) -> list[str]:
    """The all-gathers of ``phase`` (as ``AG(<group>)``, the group named by its input numel in
    ``by_numel``) interleaved with that phase's compute markers (``C(...)`` in forward,
    ``Cb(...)`` in backward; see ``CommCounter.mark_computes``)."""
    out = []
    for e in events:
        if isinstance(e, str):
            if (phase == "forward") == e.startswith("C("):
                out.append(e)
        elif e.kind == "AG" and e.phase == phase:
            out.append(f"AG({by_numel[e.numel]})")
    return out
