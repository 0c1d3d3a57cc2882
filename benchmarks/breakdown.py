"""Where one training step's time goes, per rank: compute, exposed communication,
the sharding engine's copies / allocations / Python, the optimizer, and the rest,
for fsdp2, torch's FSDP2, DDP and an unsharded single-rank compute floor.

All implementations train the same Llama model in one process group, interleaved
step by step (as in compare.py). After ``--warmup`` rounds, rounds alternate: an
un-profiled round (its step times are the real ones, ``step s``) and a round run
under ``torch.profiler.profile(activities=[CPU])`` whose trace is broken down.
Every number is seconds per step, the median over the profiled (or un-profiled)
steps, per category separately (so the medians need not add up exactly). Two
tables: rank 0, and the max over ranks of each number (``--each-rank``: every rank).

    python benchmarks/breakdown.py                       # the issue's configuration
    python benchmarks/breakdown.py --layers 2 --dim 128 --steps 2 --warmup 1
    python benchmarks/breakdown.py --impls fsdp2,torch_fsdp2 --trace /tmp/bd

(kineto prints ``USDT: ... profiler_start/stop`` lines on stderr; the report is on
stdout.)

How the trace is read. Only the main thread's events inside the step count (on
CPU, autograd runs the backward on the calling thread; gloo runs collectives on
its own threads, shown as ``gloo busy``). The events nest; each event's *self*
time (its length minus its children's) gets exactly one category from the event
and its ancestors, so nothing is counted twice and the categories plus ``other``
add up to the profiled step. Regions are found by names this script adds by
patching, before any model is built or wrapped (the library is not modified):

- ``bd::hook::<engine>.<method>``: each engine's hook entry points. fsdp2:
  ``FSDPState._pre_forward/_post_forward/_pre_backward/_post_backward_node_done/
  post_backward`` and ``StepContext.finish_backward`` (which calls
  ``drain_reductions``). torch's FSDP2: ``FSDPState._pre_forward/_post_forward/
  _pre_backward/_root_post_backward_final_callback`` and
  ``FSDPParamGroup.post_backward`` (its own ``FSDP::*`` labels then nest inside).
  DDP's reducer is C++: its events ``torch::distributed::reducer::mul_out`` (a
  gradient scaled into its bucket) and ``...reducer::copy_bucket_to_grad`` count
  as engine copies, and the end of the backward after the last autograd node
  (the reducer's finalize) as a hook region whose untraced time is the wait.
- ``bd::wait``: ``torch.distributed.Work.wait`` (every Python-level wait, including
  the one ``dist.*(async_op=False)`` does).
- ``bd::storage_resize``: ``torch.UntypedStorage.resize_`` (how both FSDP2s
  allocate and free unsharded parameters; it has no aten event of its own).
- ``bd::fwd`` / ``bd::bwd`` / ``bd::opt``: model+loss forward, ``loss.backward()``,
  ``optimizer.step(); optimizer.zero_grad()``.

Categories (an "op" is an aten op, a ``fsdp::`` custom op of torch's FSDP2, or
``bd::storage_resize``; the outermost op decides for everything nested in it):

- compute: ops outside every hook / collective / optimizer region: the model's
  forward, loss and backward kernels, autograd's ``AccumulateGrad`` included.
- exposed comm: time the main thread spends inside a collective's issue (any
  ``c10d::*`` event: for gloo that is queueing it, and for reduce-scatter a clone
  of the input) or inside ``bd::wait``, wherever they occur (in hooks, in DDP's
  forward buffer broadcast), plus DDP's untraced finalize time. The collective
  itself runs on a gloo thread; only time the main thread is stuck counts.
  ``#coll`` counts the outermost ``c10d::*`` events per step.
- copies: ops in hook regions that copy: copy_, _to_copy/to, clone, cat, stack,
  contiguous, split_with_sizes_copy, _chunk_cat, _foreach_copy_, narrow_copy, and
  torch's ``fsdp::`` copy-in/-out ops; DDP's bucket copies.
- alloc: ops in hook regions that allocate or free: empty, empty_strided,
  empty_like, new_empty(_strided), zeros(_like), new_zeros, resize_, storage resize.
- hook ops: every other op in a hook region: gradient scaling (div_, mul_),
  accumulation (add_), and the many view ops (view, as_strided, split, chunk,
  detach, ...): cheap each, dispatcher overhead mostly.
- py in hooks: hook regions' remaining self time: the engine's Python (and the
  profiler's own cost per event, which is largest here: many small events).
- optimizer: everything inside ``bd::opt``, collectives excepted (none here).
- other: the rest of the step: the model's and autograd's own Python/C++ between
  ops (self time of ``bd::fwd``, ``autograd::engine::evaluate_function: *``,
  ``*Backward0`` nodes), DDP's forward, ``loss.item()``, profiler overhead.

The third table (rank 0) splits exposed comm into ``comm issue`` (inside ``c10d::*``)
and ``comm wait`` (``bd::wait`` and DDP's finalize), counts collectives by kind
(AG all-gather, RS reduce-scatter, AR all-reduce), and gives ``gloo busy`` (wall
time of ``gloo:*`` events on gloo's threads: the collectives themselves, waiting
for the peer included), ``hook regions`` (outermost hook calls per step) and
``hooks wall`` (their inclusive time: comm + copies + alloc + hook ops + py in hooks
spent in hooks), with the profiled fwd / bwd / opt split.

Limits: the profiler costs about 1-2 us per event (thousands per step, in compute and
hooks alike) and its start/stop perturbs the ranks' timing, so compare ``prof. step
s`` with ``step s`` (un-profiled, same run) before trusting the small columns; on a
loaded machine single steps vary by 10-20%, so look at ``--each-rank`` and a second
run before reading a difference. An op is charged for the page faults of first
touching freshly allocated memory (a copy into a just re-allocated unsharded
buffer, say), which lands in ``copies``, not ``alloc``. Work done on gloo
threads (the collective, gloo's own copies) is not in any column; ``gloo busy``
is its wall time per step. A wait inside C++ (DDP's reducer, DDP's buffer
broadcast) has no event: DDP's finalize wait is inferred as above, the broadcast
wait lands in ``other``. Time the main thread is descheduled lands in whatever
it was doing: with 2 ranks and their gloo threads on 2 cores, waking a gloo thread
to run a collective can take the core from the thread that issued it (so ``comm
issue`` also holds time the collective runs), and compute slows by sharing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _step_trace import CATS, Breakdown, analyze, patch_engines, raw_events  # noqa: E402
from compare import build, llama_config, wrap  # noqa: E402

IMPLS = ("fsdp2", "torch_fsdp2", "ddp", "single")


# ---- running -------------------------------------------------------------------------


def worker(rank: int, args: argparse.Namespace) -> None:
    load_before = os.getloadavg()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    torch.set_num_threads(args.threads)
    impls = args.impls.split(",")
    patch_engines(impls)
    mesh = init_device_mesh("cpu", (args.world_size,))
    cfg = llama_config(args)
    wrap_args = argparse.Namespace(dtype="fp32", reshard=args.reshard, offload=False, float8=False)
    models: dict[str, nn.Module] = {}
    optims: dict[str, torch.optim.Optimizer] = {}
    for impl in impls:
        models[impl] = wrap(impl, build(cfg), mesh, wrap_args)
        optims[impl] = torch.optim.AdamW(models[impl].parameters(), lr=1e-3)
    rounds = args.warmup + 2 * args.steps
    gen = torch.Generator().manual_seed(1234)
    data = torch.randint(
        0, cfg.vocab_size, (rounds, args.world_size * args.batch, args.seq + 1), generator=gen
    )

    def step(impl: str, i: int) -> tuple[float, float, float, float]:
        """One training step; wall seconds (total, fwd, bwd, opt)."""
        batch = data[i, rank * args.batch : (rank + 1) * args.batch]
        model, optim = models[impl], optims[impl]
        t0 = time.perf_counter()
        with record_function(f"bd::step::{impl}"):
            with record_function("bd::fwd"):
                loss = model(batch[:, :-1], batch[:, 1:])
            t1 = time.perf_counter()
            with record_function("bd::bwd"):
                loss.backward()
            t2 = time.perf_counter()
            with record_function("bd::opt"):
                optim.step()
                optim.zero_grad()
            t3 = time.perf_counter()
            loss.item()
        return time.perf_counter() - t0, t1 - t0, t2 - t1, t3 - t2

    plain: dict[str, list[tuple[float, ...]]] = {i: [] for i in impls}
    profiled: dict[str, list[Breakdown]] = {i: [] for i in impls}
    for r in range(rounds):
        traced = r >= args.warmup and (r - args.warmup) % 2 == 1
        ctx = profile(activities=[ProfilerActivity.CPU]) if traced else contextlib.nullcontext()
        with ctx as prof:
            for impl in impls:
                dist.barrier()
                times = step(impl, r)
                if r >= args.warmup and not traced:
                    plain[impl].append(times)
        if traced:
            assert prof is not None
            if args.trace and r == args.warmup + 1:
                os.makedirs(args.trace, exist_ok=True)
                prof.export_chrome_trace(os.path.join(args.trace, f"rank{rank}.json"))
            raw = raw_events(prof)
            for impl in impls:
                profiled[impl].append(analyze(raw, impl))
    load_after = os.getloadavg()
    mine = {impl: summarize(plain[impl], profiled[impl]) for impl in impls}
    everyone: list[Any] = [None] * args.world_size
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        report(args, impls, everyone, load_before, load_after)
    dist.destroy_process_group()


def summarize(plain: list[tuple[float, ...]], prof: list[Breakdown]) -> dict[str, Any]:
    """Medians over steps of every number one table row shows."""

    def med(xs: Iterable[float]) -> float:
        return statistics.median(list(xs))

    out: dict[str, Any] = {
        "step": med(t[0] for t in plain),
        "fwd": med(t[1] for t in plain),
        "bwd": med(t[2] for t in plain),
        "opt": med(t[3] for t in plain),
        "pstep": med(b.step for b in prof),
        "pfwd": med(b.fwd for b in prof),
        "pbwd": med(b.bwd for b in prof),
        "popt": med(b.opt for b in prof),
        "issue": med(b.issue for b in prof),
        "wait": med(b.wait for b in prof),
        "hooks": med(b.hooks for b in prof),
        "hook_calls": med(b.hook_calls for b in prof),
        "gloo": med(b.gloo for b in prof),
        "ncoll": med(sum(b.colls.values()) for b in prof),
        "colls": prof[-1].colls,
    }
    for c in CATS:
        out[c] = med(b.cats[c] for b in prof)
    return out


# ---- report --------------------------------------------------------------------------


def _colls(colls: dict[str, int]) -> str:
    return " ".join(f"{k} {v}" for k, v in sorted(colls.items())) or "-"


def _table(impls: list[str], rows: dict[str, dict[str, Any]], title: str) -> None:
    print(f"\n{title}\n")
    print(
        "| impl | step s | prof. step s | fwd / bwd / opt s | compute | exposed comm | #coll | "
        "copies | alloc | hook ops | py in hooks | optimizer | other |"
    )
    print("| --- |" + " ---: |" * 12)
    for i in impls:
        r = rows[i]
        cols = [
            f"{r['step']:.3f}",
            f"{r['pstep']:.3f}",
            f"{r['fwd']:.2f} / {r['bwd']:.2f} / {r['opt']:.2f}",
            f"{r['compute']:.3f}",
            f"{r['comm']:.3f}",
            f"{r['ncoll']:.0f}",
            *(f"{r[c]:.3f}" for c in ("copies", "alloc", "hook_ops", "hook_python")),
            f"{r['optimizer']:.3f}",
            f"{r['other']:.3f}",
        ]
        print(f"| {i} | " + " | ".join(cols) + " |")


def _detail(impls: list[str], rows: dict[str, dict[str, Any]], title: str) -> None:
    print(f"\n{title}\n")
    print(
        "| impl | prof. fwd / bwd / opt s | comm issue | comm wait | collectives | gloo busy | "
        "hook regions | hooks wall |"
    )
    print("| --- |" + " ---: |" * 7)
    for i in impls:
        r = rows[i]
        print(
            f"| {i} | {r['pfwd']:.2f} / {r['pbwd']:.2f} / {r['popt']:.2f} | {r['issue']:.3f} | "
            f"{r['wait']:.3f} | {_colls(r['colls'])} | {r['gloo']:.3f} | "
            f"{r['hook_calls']:.0f} | {r['hooks']:.3f} |"
        )


def report(args, impls, everyone, load_before, load_after) -> None:  # type: ignore[no-untyped-def]
    print(f"# python {' '.join(sys.argv)}")
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cpus, torch {torch.__version__}, gloo, world {args.world_size}, "
        f"{args.threads} thread/rank, Llama {args.layers} layers dim {args.dim} "
        f"{args.heads} heads vocab {args.vocab}, batch {args.batch}x{args.seq}/rank, fp32, "
        f"AdamW(lr=1e-3), reshard_after_forward={args.reshard}, {args.warmup} warmup + "
        f"{args.steps} un-profiled + {args.steps} profiled steps (median)"
    )
    fmt = ", ".join
    print(
        f"# load average (1/5/15 min): before {fmt(f'{x:.2f}' for x in load_before)}, "
        f"after {fmt(f'{x:.2f}' for x in load_after)} (rank 0)"
    )
    print(
        "# seconds per step; 'step s' and 'fwd / bwd / opt s' from the un-profiled steps, "
        "every other column from the profiled ones"
    )
    ranks = range(len(everyone)) if args.each_rank else [0]
    for rank in ranks:
        _table(impls, everyone[rank], f"rank {rank}")
    if len(everyone) > 1:
        worst = {
            i: {
                k: (
                    max(r[i][k] for r in everyone)
                    if isinstance(everyone[0][i][k], float | int)
                    else everyone[0][i][k]
                )
                for k in everyone[0][i]
            }
            for i in impls
        }
        _table(impls, worst, "max over ranks (of each number separately)")
    _detail(impls, everyone[0], "communication and hooks, rank 0")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--reshard", type=lambda s: s.lower() in ("1", "true", "yes"), default=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps (and as many not)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--each-rank", action="store_true", help="a table for every rank")
    ap.add_argument("--trace", help="write each rank's first profiled round here (chrome)")
    ap.add_argument("--port", type=int, default=29556)
    args = ap.parse_args(argv)
    unknown = set(args.impls.split(",")) - set(IMPLS)
    if unknown:
        ap.error(f"unknown impls {sorted(unknown)}; choose from {IMPLS}")
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    mp.spawn(worker, args=(args,), nprocs=args.world_size)


if __name__ == "__main__":
    main()
