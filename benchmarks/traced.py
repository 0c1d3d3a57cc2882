"""fsdp2's traced mode against per-block compiled fsdp2 and torch's FSDP2: step time, peak
memory, compile time and recompiles, on the Llama benchmark model (CPU, gloo, inductor).

Every implementation trains the same model (``compare.py``'s Llama: same init, same data)
in one process group per rank, interleaved one step of each in turn so machine noise hits
all alike:

- ``fsdp2-compiled``: ``block.compile()`` then ``fsdp2.fully_shard`` on each block, then
  the root (torchtitan's way; the hooks and collectives run eagerly between the graphs);
- ``torch-compiled``: the same with ``torch.distributed.fsdp.fully_shard``;
- ``traced``: ``fsdp2.traced.fully_shard_traced`` on each block and the root, then
  ``torch.compile(model, fullgraph=True)`` (inductor; the loss is in the graph): the
  all-gathers and reduce-scatters are graph ops;
- ``traced+PASS`` (``--inductor-pass PASS``, repeatable; ``--all-passes``): ``traced``
  compiled with one of inductor's collective passes turned on (``_inductor_passes.PASSES``;
  joined with ``+``, e.g. ``traced+bucket+reorder``, several at once), through
  ``torch.compile``'s ``options`` (which also patch the backward's compile).

    python benchmarks/traced.py                                    # ~4 layers dim 128
    python benchmarks/traced.py --all-passes --steps 10 --warmup 2
    python benchmarks/traced.py --impls traced,traced+bucket --steps 3 --warmup 1

The table: ``step ms`` is the median step (forward with the loss, backward, AdamW step,
``zero_grad``) after ``--warmup`` steps; ``vs torch-compiled`` the ratio of medians and, in
brackets, the median and range of the per-repeat ratios (both stepped in the same repeat);
``peak MiB`` the max over ranks of persistent state (local shards, optimizer state) plus
the step's peak of tensor allocations (``_memory.peak_step_bytes_compiled``: the profiler's
memory events; ``_memory.peak_step_bytes``'s dispatch mode would make dynamo skip the
compiled frames); ``first s`` the first step, compiles included; ``graphs`` dynamo's new
graphs in the first step and ``later`` new graphs, recompiles and graph breaks after it
(all must be 0); ``gloo ops`` the collectives gloo ran in one step, per kind (torch's
reduce-scatters and the traced mode's run as gloo all-reduces; eager fsdp2 gathers and
reduces by send/recv exchanges on gloo; bucketing shows as fewer); ``max abs dloss`` the
largest difference from ``torch-compiled``'s loss over all steps (rank-averaged).

Caches: before any model, each rank compiles a tiny function so that inductor's one-time
start (its compile workers) lands on no implementation; each implementation's first step
then runs in a fresh inductor cache (``torch._inductor.utils.fresh_cache``: a new cache
directory and inductor's in-process caches cleared), so ``first s`` is a cold compile for
every one, whatever compiled before it. ``--warm-cache`` skips that (the default cache
directory and the in-process caches: a later implementation reuses an earlier one's
kernels, and a second run its own).

``overlap`` (``aten_distributed_optimizations.enable_overlap_scheduling``, the ATen-graph
overlap scheduler config.py recommends) is GPU-only in torch 2.13 (``GPU_ONLY``: its cost
model asks triton for the GPU's memory bandwidth), so ``--inductor-pass overlap`` is refused.

Not here: torch's FSDP2 "traceable" path (compiled autograd tracing its hooks'
collectives). In torch 2.13 every FSDP2 hook is wrapped in ``torch._dynamo.disable``
unconditionally (``_fsdp_common._dynamo_disable``; the ``skip_fsdp_hooks`` switch is gone).
Compiled autograd does run over torch's FSDP2 (tried: 3 blocks, ``aot_eager``), but dynamo
breaks the graph at every hook (10 breaks, 7 graphs) and the collectives stay eager: there
is no configuration in which torch's FSDP2 puts its collectives in a graph.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch._inductor.utils import fresh_cache
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _inductor_passes import GPU_ONLY, PASSES, passes_of, warm_inductor  # noqa: E402
from _memory import peak_step_bytes_compiled  # noqa: E402
from compare import build, llama_config  # noqa: E402

IMPLS = ("fsdp2-compiled", "torch-compiled", "traced")
REF = "torch-compiled"


def wrap(impl: str, model: nn.Module, mesh: Any) -> nn.Module:
    if impl in ("fsdp2-compiled", "torch-compiled"):
        if impl == "fsdp2-compiled":
            from fsdp2 import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        for block in model.layers:  # type: ignore[union-attr]
            block.compile()
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from fsdp2.traced import fully_shard_traced

    for block in model.layers:  # type: ignore[union-attr]
        fully_shard_traced(block, mesh=mesh)
    fully_shard_traced(model, mesh=mesh)
    return torch.compile(model, fullgraph=True, options=passes_of(impl) or None)  # type: ignore[return-value]


def counts() -> tuple[int, int, int]:
    """dynamo's graphs compiled, recompiles and graph breaks so far (process totals)."""
    from torch._dynamo.utils import counters

    return (
        counters["stats"]["unique_graphs"],
        sum(counters["recompiles"].values()),
        sum(counters["graph_break"].values()),
    )


def gloo_ops(names: Counter[str]) -> str:
    """The step's collectives as gloo ran them, per kind (``all_gather 77 all_reduce 39``)."""
    kinds = sorted((k.removeprefix("gloo:"), n) for k, n in names.items() if k.startswith("gloo:"))
    return " ".join(f"{k} {n}" for k, n in kinds)


def worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    caches = tempfile.mkdtemp(prefix=f"traced-bench-{rank}-")  # per rank: no shared entries
    if not args.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = caches
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64  # every variant compiles Llama.forward anew
    mesh = init_device_mesh("cpu", (args.world_size,))
    warm_inductor()
    cfg = llama_config(args)
    impls = args.impl_list
    models, optims = {}, {}
    for impl in impls:
        models[impl] = wrap(impl, build(cfg), mesh)
        optims[impl] = torch.optim.AdamW(models[impl].parameters(), lr=1e-3, foreach=True)
    gen = torch.Generator().manual_seed(1234)
    total = args.steps + args.warmup
    data = torch.randint(
        0, cfg.vocab_size, (total, args.world_size * args.batch, args.seq + 1), generator=gen
    )

    def step(impl: str, i: int) -> float:
        batch = data[i, rank * args.batch : (rank + 1) * args.batch]
        loss = models[impl](batch[:, :-1], batch[:, 1:])
        loss.backward()
        optims[impl].step()
        optims[impl].zero_grad()
        return float(loss.item())

    times: dict[str, list[float]] = {i: [] for i in impls}
    first: dict[str, float] = {}
    losses = {i: [0.0] * total for i in impls}
    graphs = {i: [0, 0, 0, 0] for i in impls}  # first-step graphs; later graphs, recompiles, breaks
    for i in range(total):
        for impl in impls:
            dist.barrier()
            before = counts()
            cold = i == 0 and not args.warm_cache
            with fresh_cache(dir=caches, delete=False) if cold else contextlib.nullcontext():
                t0 = time.perf_counter()
                losses[impl][i] = step(impl, i)
                dt = time.perf_counter() - t0
            after = counts()
            if i == 0:
                first[impl] = dt
                graphs[impl][0] = after[0] - before[0]
            else:
                for k in range(3):
                    graphs[impl][k + 1] += after[k] - before[k]
            if i >= args.warmup:
                times[impl].append(dt)
    peaks, ops = {}, {}
    for impl in impls:
        dist.barrier()
        names: Counter[str] = Counter()
        peaks[impl] = peak_step_bytes_compiled(
            functools.partial(step, impl, total - 1), models[impl], optims[impl], names
        )
        ops[impl] = gloo_ops(names)
    loss_t = torch.tensor([losses[i] for i in impls], dtype=torch.float64)
    dist.all_reduce(loss_t)
    loss_t /= args.world_size
    peak_t = torch.tensor([peaks[i] for i in impls], dtype=torch.float64)
    dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
    first_t = torch.tensor([first[i] for i in impls], dtype=torch.float64)
    dist.all_reduce(first_t, op=dist.ReduceOp.MAX)
    if rank == 0:
        report(args, impls, times, loss_t, peak_t.tolist(), first_t.tolist(), graphs, ops)
    dist.destroy_process_group()
    shutil.rmtree(caches, ignore_errors=True)


def report(args, impls, times, losses, peaks, first, graphs, ops) -> None:  # type: ignore[no-untyped-def]
    med = {i: statistics.median(times[i]) for i in impls}
    ref = REF if REF in impls else impls[0]
    iref = impls.index(ref)
    print(f"# python {' '.join(sys.argv)}")
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cpus, torch {torch.__version__}, gloo, world {args.world_size}, "
        f"{args.threads} thread(s)/rank, {args.layers} layers dim {args.dim}, batch "
        f"{args.batch}x{args.seq}/rank, fp32, {args.steps} steps after {args.warmup} (median), "
        f"{'warm' if args.warm_cache else 'fresh'} inductor cache"
    )
    print(
        f"| impl | step ms | vs {ref} (per repeat) | peak MiB/rank | mem vs {ref} | first s | "
        "graphs | later: graphs/recompiles/breaks | gloo ops | max abs dloss |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for k, i in enumerate(impls):
        paired = sorted(a / b for a, b in zip(times[i], times[ref], strict=True))
        dloss = (losses[k] - losses[iref]).abs().max().item()
        g = graphs[i]
        print(
            f"| {i} | {med[i] * 1e3:.1f} | {med[i] / med[ref]:.2f}x "
            f"({statistics.median(paired):.2f}, {paired[0]:.2f}-{paired[-1]:.2f}) | "
            f"{peaks[k] / 2**20:.1f} | {peaks[k] / peaks[iref]:.2f}x | {first[k]:.1f} | "
            f"{g[0]} | {g[1]}/{g[2]}/{g[3]} | {ops[i]} | {dloss:.2e} |"
        )
    print(f"\nlast loss ({ref}): {losses[iref][-1].item():.5f}")
    for i in impls:
        if "+" in i:
            print(f"{i}: {passes_of(i)}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"from {IMPLS} and traced+PASS")
    ap.add_argument(
        "--inductor-pass",
        action="append",
        default=[],
        metavar="PASS",
        help=f"adds traced+PASS; PASS from {sorted(PASSES)}, or several joined with +",
    )
    ap.add_argument("--all-passes", action="store_true", help="adds traced+PASS for each PASS")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--port", type=int, default=29561)
    ap.add_argument(
        "--warm-cache", action="store_true", help="no fresh inductor cache for the first steps"
    )
    args = ap.parse_args(argv)
    impls = args.impls.split(",")
    passes = list(args.inductor_pass) + (sorted(PASSES) if args.all_passes else [])
    impls += [f"traced+{p}" for p in passes if f"traced+{p}" not in impls]
    for impl in impls:
        base, *names = impl.split("+")
        if base not in IMPLS or (names and base != "traced"):
            ap.error(f"unknown impl {impl!r}; choose from {IMPLS} or traced+PASS")
        gpu = [f"{n}: {GPU_ONLY[n]}" for n in names if n in GPU_ONLY]
        if gpu:
            ap.error(f"{impl!r}: this pass does not run on CPU: {'; '.join(gpu)}")
        unknown = [n for n in names if n not in PASSES]
        if unknown:
            ap.error(f"{impl!r}: unknown pass {unknown}; choose from {sorted(PASSES)}")
    args.impl_list = impls
    if args.warmup < 1:
        ap.error("--warmup must be at least 1 (the first step compiles)")
    mp.spawn(worker, args=(args,), nprocs=args.world_size)


if __name__ == "__main__":
    main()
