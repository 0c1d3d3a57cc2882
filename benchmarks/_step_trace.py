"""The profiled step of ``breakdown.py``: name its regions, then read its trace.

``patch_engines`` wraps the engines' hook entry points, ``Work.wait`` and
``UntypedStorage.resize_`` in ``record_function`` labels (``bd::hook::*``, ``bd::wait``,
``bd::storage_resize``); ``analyze`` nests one rank's CPU events of one step
(``bd::step::<impl>`` around ``bd::fwd`` / ``bd::bwd`` / ``bd::opt``) and charges each
event's self time to exactly one category. The regions, the categories and their limits are
described in ``breakdown.py``'s docstring.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import profiler as _autograd_profiler
from torch.profiler import profile, record_function

__all__ = ["CATS", "Breakdown", "analyze", "patch_engines", "raw_events"]

CATS = (
    "compute",
    "comm",
    "copies",
    "alloc",
    "hook_ops",
    "hook_python",
    "optimizer",
    "other",
)
COPY_OPS = frozenset(
    "aten::" + n
    for n in (
        "copy_",
        "_to_copy",
        "to",
        "clone",
        "cat",
        "stack",
        "contiguous",
        "split_with_sizes_copy",
        "_chunk_cat",
        "chunk_cat",
        "_foreach_copy_",
        "narrow_copy",
    )
)
ALLOC_OPS = frozenset(
    "aten::" + n
    for n in (
        "empty",
        "empty_strided",
        "empty_like",
        "new_empty",
        "new_empty_strided",
        "zeros",
        "zeros_like",
        "new_zeros",
        "resize_",
    )
) | {"bd::storage_resize"}
DDP_COPIES = (
    "torch::distributed::reducer::mul_out",
    "torch.distributed.ddp.reducer::copy_bucket_to_grad",
)
FINALIZE = "bd::hook::ddp.finalize"  # synthetic region, see _ddp_finalize
COLL_KINDS = (("allgather", "AG"), ("reduce_scatter", "RS"), ("allreduce", "AR"))


# ---- patching: name the regions ------------------------------------------------------


def _labelled(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _autograd_profiler._is_profiler_enabled:
            return fn(*args, **kwargs)
        with record_function(label):
            return fn(*args, **kwargs)

    return wrapper


def _patch(cls: type, names: Iterable[str], prefix: str) -> None:
    for name in names:
        setattr(cls, name, _labelled(getattr(cls, name), f"{prefix}.{name}"))


def patch_engines(impls: list[str]) -> None:
    """Label hook entry points, waits and storage resizes. Must run before any
    model is wrapped: the engines register bound methods as hooks."""
    if "fsdp2" in impls:
        from fsdp2._core.runtime import state as _state
        from fsdp2._core.runtime import step as _step

        _patch(
            _state.FSDPState,
            (
                "_pre_forward",
                "_post_forward",
                "_pre_backward",
                "_post_backward_node_done",
                "post_backward",
            ),
            "bd::hook::fsdp2",
        )
        _patch(_step.StepContext, ("finish_backward",), "bd::hook::fsdp2")
    if "torch_fsdp2" in impls:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group, _fsdp_state

        _patch(
            _fsdp_state.FSDPState,
            (
                "_pre_forward",
                "_post_forward",
                "_pre_backward",
                "_root_post_backward_final_callback",
            ),
            "bd::hook::torch",
        )
        _patch(_fsdp_param_group.FSDPParamGroup, ("post_backward",), "bd::hook::torch")
    dist.Work.wait = _labelled(dist.Work.wait, "bd::wait")  # type: ignore[method-assign]
    torch.UntypedStorage.resize_ = _labelled(  # type: ignore[method-assign]
        torch.UntypedStorage.resize_, "bd::storage_resize"
    )


# ---- reading the trace ---------------------------------------------------------------


@dataclass
class Node:
    name: str
    start: int  # ns
    end: int
    children: list[Node] = field(default_factory=list)


@dataclass
class Breakdown:
    """One rank's profiled step of one implementation, in seconds."""

    step: float
    fwd: float
    bwd: float
    opt: float
    cats: dict[str, float]
    issue: float  # comm split: collective issue vs wait
    wait: float
    colls: dict[str, int]
    hooks: float  # inclusive wall time of the outermost hook regions
    hook_calls: int
    gloo: float  # union of gloo:* events on other threads


def _tree(events: list[tuple[str, int, int]]) -> Node:
    """Nest (name, start, end) events of one thread; the first must span the rest."""
    events.sort(key=lambda e: (e[1], -e[2]))
    root = Node(*events[0])
    stack = [root]
    for name, start, end in events[1:]:
        while len(stack) > 1 and start >= stack[-1].end:
            stack.pop()
        node = Node(name, start, min(end, stack[-1].end))
        stack[-1].children.append(node)
        stack.append(node)
    return root


def _ddp_finalize(bwd: Node) -> None:
    """Group what DDP's reducer does after the last autograd node (its finalize:
    wait for the buckets' all-reduces, copy them to .grad) under one region."""
    last = max(
        (i for i, c in enumerate(bwd.children) if c.name.startswith("autograd::engine::")),
        default=None,
    )
    if last is None:
        return
    tail = bwd.children[last + 1 :]
    region = Node(FINALIZE, bwd.children[last].end, bwd.end, tail)
    bwd.children = [*bwd.children[: last + 1], region]


def _is_op(name: str) -> bool:
    return name.startswith(("aten::", "fsdp::")) or name == "bd::storage_resize"


def _hook_op_category(name: str) -> str:
    if name in ALLOC_OPS:
        return "alloc"
    if name in COPY_OPS or name.startswith("fsdp::") or name in DDP_COPIES:
        return "copies"
    return "hook_ops"


def _union(intervals: list[tuple[int, int]]) -> int:
    """Total length covered by the intervals."""
    total, reach = 0, None
    for s, e in sorted(intervals):
        if reach is not None and s < reach:
            s = reach
        if e > s:
            total += e - s
            reach = e if reach is None else max(reach, e)
        elif reach is None:
            reach = e
    return total


def analyze(raw: list[tuple[str, int, int, int]], impl: str) -> Breakdown:
    """Break down the step ``bd::step::<impl>`` from (name, start, end, thread) events."""
    label = f"bd::step::{impl}"
    step_ev = next(e for e in raw if e[0] == label)
    s0, s1, main = step_ev[1], step_ev[2], step_ev[3]
    mine = [(n, s, e) for n, s, e, t in raw if t == main and s >= s0 and e <= s1]
    mine.remove((label, s0, s1))
    root = _tree([(label, s0, s1), *mine])
    phases = {c.name: c for c in root.children if c.name in ("bd::fwd", "bd::bwd", "bd::opt")}
    if impl == "ddp" and "bd::bwd" in phases:
        _ddp_finalize(phases["bd::bwd"])
    gloo = _union([(s, e) for n, s, e, t in raw if t != main and s < s1 and e > s0 and "gloo" in n])

    cats = dict.fromkeys(CATS, 0)
    comm = {"issue": 0, "wait": 0}
    colls: dict[str, int] = {}
    hooks = [0, 0]

    def walk(node: Node, region: str, opcat: str | None) -> None:
        name = node.name
        if region not in ("issue", "wait"):
            if name.startswith("c10d::"):
                region = "issue"
                kind = next((k for key, k in COLL_KINDS if key in name), name[6:].strip("_"))
                colls[kind] = colls.get(kind, 0) + 1
            elif name == "bd::wait":
                region = "wait"
            elif region == "top" and name == "bd::opt":
                region = "opt"
            elif region == "top" and (name.startswith("bd::hook::") or name in DDP_COPIES):
                region = "hook"
                hooks[0] += node.end - node.start
                hooks[1] += 1
        if opcat is None and region in ("top", "hook"):
            if name in DDP_COPIES:
                opcat = "copies"
            elif _is_op(name):
                opcat = "compute" if region == "top" else _hook_op_category(name)
        self_ns = node.end - node.start - sum(c.end - c.start for c in node.children)
        if region in ("issue", "wait"):
            comm[region] += self_ns
            cat = "comm"
        elif region == "opt":
            cat = "optimizer"
        elif opcat is not None:
            cat = opcat
        elif name == FINALIZE:  # DDP's C++ finalize: its untraced time is the wait
            comm["wait"] += self_ns
            cat = "comm"
        elif region == "hook":
            cat = "hook_python"
        else:
            cat = "other"
        cats[cat] += self_ns
        for c in node.children:
            walk(c, region, opcat)

    walk(root, "top", None)
    ns = 1e-9

    def dur(name: str) -> float:
        n = phases.get(name)
        return (n.end - n.start) * ns if n is not None else 0.0

    return Breakdown(
        step=(s1 - s0) * ns,
        fwd=dur("bd::fwd"),
        bwd=dur("bd::bwd"),
        opt=dur("bd::opt"),
        cats={k: v * ns for k, v in cats.items()},
        issue=comm["issue"] * ns,
        wait=comm["wait"] * ns,
        colls=colls,
        hooks=hooks[0] * ns,
        hook_calls=hooks[1],
        gloo=gloo * ns,
    )


def raw_events(prof: profile) -> list[tuple[str, int, int, int]]:
    out = []
    for e in prof.profiler.kineto_results.events():  # type: ignore[union-attr]
        if e.device_type() == torch.autograd.DeviceType.CPU:
            out.append((e.name(), e.start_ns(), e.end_ns(), e.start_thread_id()))
    return out
