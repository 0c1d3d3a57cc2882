"""Counting the collectives a training step issues, shared by the communication tests.

``CommCounter`` wraps ``torch.distributed``'s ``all_gather_single``, ``all_gather_into_tensor``,
``reduce_scatter_single``, ``reduce_scatter_tensor`` and ``all_reduce`` (patched on the module
for the ``with`` block only, then restored) and records each call's kind, group size and input
numel as a ``Call``. On gloo fsdp2 reduce-scatters by a send/receive exchange (2 ranks) or an
in-place all-reduce of the same input ([Note: gloo reduce-scatter] in fsdp2/_core/collectives.py);
the counter records both as ``"RS"`` (with ``api`` ``"exchange"`` or ``"all_reduce"``;
``is_fsdp2_reduce_scatter`` tells that all-reduce from others), and its all-gathers by sends
and receives ([Note: gloo all-gather]; also straight into the parameters, ``all_gather_into``)
as ``"AG"`` with ``api`` ``"exchange"``; a 2-rank reduce-scatter sent straight from the
gradients (``reduce_scatter_grads``) counts as ``"RS"`` ``"exchange"`` with the numel of the
packed input it stands for.
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
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp2._core import collectives as fsdp2_collectives

__all__ = [
    "AG_API",
    "RS_API",
    "Call",
    "CommCounter",
    "count_calls",
    "is_fsdp2_reduce_scatter",
    "prefetch_order",
    "shard_numel",
    "spy_all_gathers",
    "spy_reduce_scatters",
]

# The single-tensor collectives' names: torch 2.13 renamed them (fsdp2/_core/compat.py).
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
        exchange = fsdp2_collectives._reduce_scatter_by_exchange

        def counted_exchange(input: torch.Tensor, op: Any, group: dist.ProcessGroup) -> Any:
            live = group in dist.distributed_c10d._world.pg_map
            self.events.append(Call("RS", "exchange", 2, input.numel(), self.phase, live))
            return exchange(input, op, group)

        gather = fsdp2_collectives._all_gather_by_exchange

        def counted_gather(output: torch.Tensor, input: torch.Tensor, group: Any) -> Any:
            live = group in dist.distributed_c10d._world.pg_map
            call = Call("AG", "exchange", group.size(), input.numel(), self.phase, live)
            self.events.append(call)
            return gather(output, input, group)

        into = fsdp2_collectives.all_gather_into

        def counted_into(input: torch.Tensor, sizes: Any, rows: Any, group: Any) -> Any:
            live = group in dist.distributed_c10d._world.pg_map
            self.events.append(
                Call("AG", "exchange", group.size(), input.numel(), self.phase, live)
            )
            return into(input, sizes, rows, group)

        straight = fsdp2_collectives.reduce_scatter_grads

        def counted_straight(grads: Any, dtype: Any, op: Any, group: Any) -> Any:
            pending = straight(grads, dtype, op, group)
            if pending is not None:  # else packed and counted as an exchange
                live = group in dist.distributed_c10d._world.pg_map
                numel = 2 * pending.output.numel()
                self.events.append(Call("RS", "exchange", 2, numel, self.phase, live))
            return pending

        for name, fn in (
            ("_reduce_scatter_by_exchange", counted_exchange),
            ("_all_gather_by_exchange", counted_gather),
            ("all_gather_into", counted_into),
            ("reduce_scatter_grads", counted_straight),
        ):
            self._stack.enter_context(mock.patch.object(fsdp2_collectives, name, fn))
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
            kind = "RS" if api == "all_reduce" and is_fsdp2_reduce_scatter() else _KINDS[api]
            self.events.append(Call(kind, api, size, tensor.numel(), self.phase, live))
            return orig(*args, **kwargs)

        return counted


_RS_BY_AR = fsdp2_collectives._reduce_scatter_by_all_reduce.__code__


def is_fsdp2_reduce_scatter(depth: int = 6) -> bool:
    """Whether the ``dist.all_reduce`` being called (from a patch wrapper, up to ``depth``
    frames down) is fsdp2's reduce-scatter on gloo."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code is _RS_BY_AR:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def spy_reduce_scatters(
    record: Callable[[torch.Tensor, Any, dist.ProcessGroup | None], None],
) -> Iterator[None]:
    """Call ``record(input, op, group)`` for every reduce-scatter issued in the block:
    ``dist.reduce_scatter_single`` (``RS_API``: torch's FSDP2, fsdp2 off gloo) and fsdp2's
    all-reduce standing in for it on gloo."""
    rs, ar = getattr(dist, RS_API), dist.all_reduce

    def spy_rs(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):  # type: ignore[no-untyped-def]
        record(input, op, group)
        return rs(output, input, op=op, group=group, async_op=async_op)

    def spy_ar(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):  # type: ignore[no-untyped-def]
        if is_fsdp2_reduce_scatter():
            record(tensor, op, group)
        return ar(tensor, op=op, group=group, async_op=async_op)

    exchange = fsdp2_collectives._reduce_scatter_by_exchange

    def spy_exchange(input: torch.Tensor, op: Any, group: dist.ProcessGroup) -> Any:
        record(input.view(-1), op, group)
        return exchange(input, op, group)

    straight = fsdp2_collectives.reduce_scatter_grads

    def spy_straight(grads: Any, dtype: torch.dtype, op: Any, group: Any) -> Any:
        pending = straight(grads, dtype, op, group)
        if pending is not None:  # the packed input it stands for (else packed and spied)
            record(torch.empty(2 * pending.output.numel(), dtype=dtype, device="meta"), op, group)
        return pending

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(dist, RS_API, spy_rs))
        stack.enter_context(mock.patch.object(dist, "all_reduce", spy_ar))
        for name, fn in (
            ("_reduce_scatter_by_exchange", spy_exchange),
            ("reduce_scatter_grads", spy_straight),
        ):
            stack.enter_context(mock.patch.object(fsdp2_collectives, name, fn))
        yield


@contextlib.contextmanager
def spy_all_gathers(
    record: Callable[[torch.Tensor, dist.ProcessGroup | None], None],
) -> Iterator[None]:
    """Call ``record(input, group)`` for every all-gather issued in the block:
    ``dist.all_gather_single`` (``AG_API``: torch's FSDP2, fsdp2 off gloo) and fsdp2's sends
    and receives standing in for it on gloo."""
    ag = getattr(dist, AG_API)

    def spy_ag(output, input, group=None, async_op=False, **kw):  # type: ignore[no-untyped-def]
        record(input, group)
        return ag(output, input, group=group, async_op=async_op, **kw)

    gather = fsdp2_collectives._all_gather_by_exchange

    def spy_gather(output: torch.Tensor, input: torch.Tensor, group: Any) -> Any:
        record(input, group)
        return gather(output, input, group)

    into = fsdp2_collectives.all_gather_into

    def spy_into(input: torch.Tensor, sizes: Any, rows: Any, group: Any) -> Any:
        record(input, group)
        return into(input, sizes, rows, group)

    with mock.patch.object(dist, AG_API, spy_ag):
        with mock.patch.object(fsdp2_collectives, "_all_gather_by_exchange", spy_gather):
            with mock.patch.object(fsdp2_collectives, "all_gather_into", spy_into):
                yield


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
