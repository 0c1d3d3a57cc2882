"""Counting the collectives a training step issues, shared by the communication tests.

``CommCounter`` records each collective of a ``with`` block as a ``Call`` (kind, how it was
carried, group size, input numel): fsdp2's through the engine's observer interface (an
``Observer`` subscribed to ``fsdp2._core.support.observe.HUB``: [Note: observation]), and everything
else (torch's FSDP2, DDP, the tests' own) by wrapping ``torch.distributed``'s public
``all_gather_single``, ``all_gather_into_tensor``, ``reduce_scatter_single``,
``reduce_scatter_tensor`` and ``all_reduce`` for the block. A ``torch.distributed`` call made
while fsdp2 issues one of its own (inside its "... issue" region, e.g. a custom comm's) is
fsdp2's collective, counted once. On gloo fsdp2 reduce-scatters by a send/receive exchange (2
ranks) or an in-place all-reduce ([Note: gloo reduce-scatter] in fsdp2/_core/comm/gloo.py): both
count as ``"RS"`` (``api`` ``"exchange"`` or ``"all_reduce"``), its all-gathers by sends and
receives as ``"AG"`` with ``api`` ``"exchange"``; a reduce-scatter's numel is that of the
packed input (every rank's rows), an all-gather's that of this rank's input.
``spy_all_gathers`` / ``spy_reduce_scatters`` show a test every all-gather / reduce-scatter
either way.
Tests may interleave marker strings (``mark``, ``mark_computes``) to record
when a module computes relative to the collectives. DTensor's ``full_tensor()`` (functional
collectives) and ``models.full_params`` / ``full_grads`` bypass these patches: tests may check
full gradients inside a counted region.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp2._core.support.observe import HUB, Collective, Observer

__all__ = [
    "AG_API",
    "RS_API",
    "Call",
    "CommCounter",
    "count_calls",
    "prefetch_order",
    "shard_numel",
    "spy_all_gathers",
    "spy_reduce_scatters",
]

# The single-tensor collectives' names: torch 2.13 renamed them (fsdp2/_core/support/compat.py).
AG_API = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
RS_API = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)

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


_OBSERVED_KINDS = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR"}


class _Issues(Observer):
    """Follows fsdp2's collectives: ``on_collective(c)`` for each, and whether fsdp2 is
    inside one of its "... issue" regions (where its ``torch.distributed`` calls are)."""

    def __init__(self, on_collective: Callable[[Collective], None]) -> None:
        self.on_collective = on_collective
        self.depth = 0

    def collective(self, c: Collective) -> None:
        self.on_collective(c)

    def enter(self, kind: str, what: str) -> None:
        if kind.endswith(" issue"):
            self.depth += 1

    def exit(self, kind: str) -> None:
        if kind.endswith(" issue"):
            self.depth -= 1


def _live(group: dist.ProcessGroup | None) -> bool:
    return group is None or group in dist.distributed_c10d._world.pg_map


class CommCounter(contextlib.AbstractContextManager):
    """Records collectives (see ``Call``) and test markers while the ``with`` block runs.

    ``events`` interleaves ``Call`` objects with marker strings appended by ``mark``; set
    ``phase`` to label the calls that follow.
    """

    def __init__(self) -> None:
        self.events: list[Call | str] = []
        self.phase = "?"
        self._stack = contextlib.ExitStack()
        self._fsdp2 = _Issues(self._observed)

    def __enter__(self) -> CommCounter:
        for api in _KINDS:
            orig = getattr(dist, api, None)
            if orig is not None:
                self._stack.enter_context(mock.patch.object(dist, api, self._wrap(api, orig)))
        self._stack.enter_context(HUB.observing(self._fsdp2))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def _observed(self, c: Collective) -> None:
        kind = _OBSERVED_KINDS[c.kind]
        numel = c.input_numel if kind == "AG" else c.numel
        self.events.append(Call(kind, c.transport, c.group_size, numel, self.phase, _live(c.group)))

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
            if not self._fsdp2.depth:  # else fsdp2's own, counted by its observer
                bound = sig.bind(*args, **kwargs).arguments
                group = bound.get("group")
                tensor = next(bound[k] for k in _INPUT_ARG if k in bound)
                size = dist.get_world_size() if group is None else group.size()
                call = Call(_KINDS[api], api, size, tensor.numel(), self.phase, _live(group))
                self.events.append(call)
            return orig(*args, **kwargs)

        return counted


@contextlib.contextmanager
def _spy(
    kinds: set[str],
    apis: set[str],
    record: Callable[[torch.Tensor, Any, dist.ProcessGroup | None], None],
) -> Iterator[None]:
    """``record(input, op, group)`` for every collective of ``kinds`` fsdp2 issues (its input
    as a meta tensor of the numel ``CommCounter`` records) and every call of ``apis``
    outside fsdp2."""
    fsdp2 = _Issues(lambda c: None)

    def observed(c: Collective) -> None:
        if c.kind in kinds:
            numel = c.input_numel if c.kind == "all-gather" else c.numel
            record(torch.empty(numel, dtype=c.dtype, device="meta"), c.op, c.group)

    fsdp2.on_collective = observed
    with contextlib.ExitStack() as stack:
        for api in apis:
            orig = getattr(dist, api)
            sig = inspect.signature(orig)

            def spied(*args: Any, _orig: Any = orig, _sig: Any = sig, **kwargs: Any) -> Any:
                if not fsdp2.depth:
                    bound = _sig.bind(*args, **kwargs).arguments
                    tensor = next(bound[k] for k in _INPUT_ARG if k in bound)
                    record(tensor, bound.get("op"), bound.get("group"))
                return _orig(*args, **kwargs)

            stack.enter_context(mock.patch.object(dist, api, spied))
        stack.enter_context(HUB.observing(fsdp2))
        yield


def spy_reduce_scatters(
    record: Callable[[torch.Tensor, Any, dist.ProcessGroup | None], None],
) -> contextlib.AbstractContextManager[None]:
    """Call ``record(input, op, group)`` for every reduce-scatter issued in the block: fsdp2's
    (however carried) and ``dist.reduce_scatter_single`` (``RS_API``: torch's FSDP2)."""
    return _spy({"reduce-scatter"}, {RS_API}, record)


def spy_all_gathers(
    record: Callable[[torch.Tensor, dist.ProcessGroup | None], None],
) -> contextlib.AbstractContextManager[None]:
    """Call ``record(input, group)`` for every all-gather issued in the block: fsdp2's
    (however carried) and ``dist.all_gather_single`` (``AG_API``: torch's FSDP2)."""
    return _spy({"all-gather"}, {AG_API}, lambda t, op, group: record(t, group))


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
