"""One training step as a timeline: a Chrome trace (opens in Perfetto) and a Gantt chart per
rank, with a one-line summary of where the step's time went.

    with fsdp2.timeline("runs/timeline") as tl:     # on every rank
        loss = model(x, y)
        loss.backward()
        optim.step()
        optim.zero_grad()
    print(tl.summary)   # step 1.920 s: compute 1.410 s, exposed comm 0.330 s, framework 0.180 s

# [Note: timeline]
# The block runs under ``torch.profiler`` (CPU, and CUDA when available) inside a
# ``fsdp2::step`` range. fsdp2 labels its own work (see _core/support/labels.py): hooks
# (``fsdp2::hook <kind> <module>``), and inside them collectives' issue and wait, the
# all-gather copy-out and reshards. On the thread that ran the block:
# * exposed comm: time inside an ``issue`` or ``wait`` label (the thread is stuck in a
#   collective: issuing it, or waiting for it to finish);
# * framework: the rest of the time inside fsdp2 labels (its Python, copies, allocations);
# * compute: everything else in the step: the model's forward and backward, the loss, the
#   optimizer, autograd's own work.
# Communication lanes, one per module: a collective is "in flight" from its issue to the
# end of the wait that consumed it; the part of that spent waiting is the exposed part.
# On CUDA the host view is what is measured (a host-side wait also stands for a stream
# dependency); the GPU kernels are in the Chrome trace but not split into the summary.
# The bytes of each collective come from the engine itself: the block subscribes an
# observer ([Note: observation] in fsdp2/_core/support/observe.py) that adds up what this rank
# sends into each collective it issues.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from fsdp2._core.support.labels import PREFIX
from fsdp2._core.support.observe import HUB, Collective, Observer

__all__ = ["Timeline", "timeline"]

_STEP = PREFIX + "step"
_COMM_OPS = ("all_gather", "reduce_scatter", "all_reduce")
# fsdp2.replica_optim's collectives over HSDP's replicas (labelled "replicas: <paths>")
_REPLICA = "replicas: "
_OPS = (*_COMM_OPS, "replica_reduce_scatter", "replica_all_gather")


@dataclass
class Timeline:
    """One profiled step of one rank (filled when the ``timeline`` block exits).

    Times are seconds. ``lanes`` maps each module (``layers.3``, ``the root (Llama)``) to
    its collectives: ``(op, start, end, issue, wait)`` with ``op`` one of ``all_gather``,
    ``reduce_scatter``, ``all_reduce`` (and ``replica_reduce_scatter``, ``replica_all_gather``
    under ``fsdp2.replica_optim``), ``start`` / ``end`` from the step's start (issued,
    consumed), and ``issue`` / ``wait`` the seconds the step's thread spent issuing it and
    waiting for it: its exposed part (see [Note: timeline]). ``comm_bytes`` maps each
    collective kind to the bytes this rank sent into fsdp2's collectives of that kind (an
    all-gather's input, a reduce-scatter's packed input, an all-reduce's tensor)."""

    rank: int = 0
    step_s: float = 0.0
    compute_s: float = 0.0
    exposed_comm_s: float = 0.0
    framework_s: float = 0.0
    collectives: dict[str, int] = field(default_factory=dict)
    comm_bytes: dict[str, int] = field(default_factory=dict)
    lanes: dict[str, list[tuple[str, float, float, float, float]]] = field(default_factory=dict)
    main: list[tuple[str, float, float]] = field(default_factory=list)  # (kind, start, end)
    trace_path: str | None = None
    png_path: str | None = None

    @property
    def summary(self) -> str:
        """``step 1.920 s: compute 1.410 s, exposed comm 0.330 s, framework 0.180 s``."""
        counts = ", ".join(f"{n} {op.replace('_', '-')}" for op, n in self.collectives.items())
        return (
            f"step {self.step_s:.3f} s: compute {self.compute_s:.3f} s, exposed comm "
            f"{self.exposed_comm_s:.3f} s, framework {self.framework_s:.3f} s"
            + (f" ({counts})" if counts else "")
        )


@contextmanager
def timeline(path: str | os.PathLike[str] | None = None, *, png: bool = True) -> Iterator[Timeline]:
    """Profile the block (one training step, on every rank) and describe it.

    On exit the returned :class:`Timeline` is filled, and with ``path`` this rank writes
    ``<path>.rank<r>.json`` (Chrome trace: open in https://ui.perfetto.dev) and, with
    ``png`` (needs matplotlib), ``<path>.rank<r>.png``: the step's thread (compute, fsdp2
    framework, exposed communication in red) and one lane per module with its all-gathers,
    reduce-scatters and all-reduces in flight, their exposed part in red, the summary as
    title. Not collective; no effect on the numbers. See [Note: timeline].

    Args:
        path: file prefix (directories are created); ``None`` writes nothing.
        png: also draw the Gantt chart.

    Raises:
        ImportError: ``png`` with ``path`` but matplotlib is not installed (raised before
            the block runs).
    """
    if path is not None and png:
        import matplotlib  # noqa: F401  (fail before the step, not after it)
    result = Timeline(rank=dist.get_rank() if dist.is_initialized() else 0)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    sent = _Sent(result.comm_bytes)
    with profile(activities=activities) as prof, HUB.observing(sent):
        with record_function(_STEP):
            yield result
    trace = None
    if path is not None:
        prefix = f"{os.fspath(path)}.rank{result.rank}"
        folder = os.path.dirname(prefix)
        if folder:
            os.makedirs(folder, exist_ok=True)
        result.trace_path = prefix + ".json"
        prof.export_chrome_trace(result.trace_path)
        with open(result.trace_path) as f:
            trace = json.load(f)
    events = _events(trace) if trace is not None else _events_of(prof)
    _analyze(result, events)
    if path is not None and png:
        result.png_path = f"{os.fspath(path)}.rank{result.rank}.png"
        _draw(result, result.png_path)


class _Sent(Observer):
    """Adds up the bytes this rank sends into fsdp2's collectives, by kind."""

    def __init__(self, into: dict[str, int]) -> None:
        self.into = into

    def collective(self, c: Collective) -> None:
        op = c.kind.replace("-", "_")
        if c.what.startswith(_REPLICA):
            op = f"replica_{op}"
        numel = c.input_numel if c.kind == "all-gather" else c.numel
        self.into[op] = self.into.get(op, 0) + numel * c.dtype.itemsize


_Event = tuple[str, float, float, str]  # name, start us, end us, thread id


def _events(trace: dict[str, object]) -> list[_Event]:
    out = []
    raw = trace.get("traceEvents", [])
    assert isinstance(raw, list)
    for e in raw:
        if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e:
            start = float(e["ts"])
            out.append((str(e["name"]), start, start + float(e["dur"]), str(e.get("tid", ""))))
    return out


def _events_of(prof: profile) -> list[_Event]:
    out = []
    for e in prof.events():
        start = e.time_range.start
        out.append((e.name, float(start), float(e.time_range.end), str(e.thread)))
    return out


def _measure(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _analyze(result: Timeline, events: list[_Event]) -> None:
    steps = [e for e in events if e[0] == _STEP]
    if not steps:
        return
    step = max(steps, key=lambda e: e[2] - e[1])
    main_tid = step[3]  # the thread that ran the block
    t0, t1 = step[1], step[2]
    mine = [e for e in events if e[3] == main_tid and e[1] >= t0 and e[2] <= t1 and e[0] != _STEP]
    labels = [e for e in mine if e[0].startswith(PREFIX)]
    comm: list[tuple[float, float]] = []
    other: list[tuple[float, float]] = []
    issues: list[tuple[str, list[str], float, float]] = []
    waits: list[tuple[str, list[str], float, float]] = []
    for name, a, b, _ in labels:
        words = name[len(PREFIX) :].split(" ", 2)
        if len(words) == 3 and words[0] in _COMM_OPS and words[1] in ("issue", "wait"):
            comm.append((a, b))
            op, text = words[0], words[2]
            if text.startswith(_REPLICA):
                op, text = f"replica_{op}", text.removeprefix(_REPLICA)
            what = text.removeprefix("bucket ").split(", ")
            (issues if words[1] == "issue" else waits).append((op, what, a, b))
        else:
            other.append((a, b))
    s = 1e-6
    result.step_s = (t1 - t0) * s
    result.exposed_comm_s = _measure(comm) * s
    result.framework_s = (_measure(comm + other) - _measure(comm)) * s
    result.compute_s = result.step_s - result.exposed_comm_s - result.framework_s
    result.collectives = {op: sum(1 for i in issues if i[0] == op) for op in _OPS}
    result.collectives = {op: n for op, n in result.collectives.items() if n}
    for op, paths, a, b in waits:
        for p in paths:
            started = [i for i in issues if i[0] == op and p in i[1] and i[2] <= a]
            issue = max(started, key=lambda i: i[2]) if started else (op, [p], a, a)
            lane = result.lanes.setdefault(p, [])
            start, issued = (issue[2] - t0) * s, (issue[3] - issue[2]) * s
            lane.append((op, start, (b - t0) * s, issued, (b - a) * s))
    result.main = [("comm", (a - t0) * s, (b - t0) * s) for a, b in comm]
    result.main += [("framework", (a - t0) * s, (b - t0) * s) for a, b in other]


_COLORS = {
    "all_gather": "#4C72B0",
    "reduce_scatter": "#55A868",
    "all_reduce": "#8172B2",
    "replica_reduce_scatter": "#8C613C",
    "replica_all_gather": "#64B5CD",
}


def _draw(result: Timeline, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lanes = list(result.lanes)
    height = 1.2 + 0.32 * (len(lanes) + 1)
    fig, ax = plt.subplots(figsize=(14, max(height, 2.6)))
    y_main = len(lanes)
    ax.broken_barh([(0, result.step_s)], (y_main - 0.4, 0.8), color="#C8D3E0")
    for kind, a, b in sorted(result.main, key=lambda m: m[0] == "comm"):
        color = "#D62728" if kind == "comm" else "#F0A030"
        ax.broken_barh([(a, b - a)], (y_main - 0.4, 0.8), color=color)
    for y, lane in enumerate(reversed(lanes)):
        for op, a, b, issue, wait in result.lanes[lane]:
            ax.broken_barh([(a, b - a)], (y - 0.3, 0.6), color=_COLORS[op])
            red = [(a, issue), (b - wait, wait)]
            ax.broken_barh([r for r in red if r[1] > 0], (y - 0.3, 0.6), color="#D62728")
    ax.set_yticks(range(len(lanes) + 1), [*reversed(lanes), "step thread"])
    ax.set_xlim(0, max(result.step_s, 1e-9))
    ax.set_xlabel("seconds from the step's start")
    ax.set_title(f"rank {result.rank}: {result.summary}", fontsize=9)
    legend = [
        Patch(color="#C8D3E0", label="compute (model, autograd, optimizer)"),
        Patch(color="#F0A030", label="fsdp2 framework"),
        Patch(color="#D62728", label="exposed communication"),
        *(Patch(color=c, label=op.replace("_", "-") + " in flight") for op, c in _COLORS.items()),
    ]
    ax.legend(handles=legend, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
