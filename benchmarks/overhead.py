"""Framework overhead: many tiny sharded layers, so compute is negligible.

Runs fsdp2 and torch's FSDP2 interleaved in the same process group and prints
median step time and fully_shard init time per implementation, with ratios.
``--bucket-bytes N`` calls ``set_bucket_bytes(N)`` on fsdp2's root (bucketed
collectives; torch's FSDP2 has no such setting). ``--baseline DIR`` adds another
fsdp2 (the ``fsdp2`` package under DIR, e.g. a ``git worktree`` of an older
commit) as a third implementation, to measure a change A/B in one run.

    python benchmarks/overhead.py --layers 64 --world-size 2
    python benchmarks/overhead.py --replicate-below 4096 --replicate   # Replicate() small params
    git worktree add /tmp/before HEAD~1
    python benchmarks/overhead.py --baseline /tmp/before
    python benchmarks/overhead.py --world-size 1 --traced   # the traced mode's floor

``--traced`` adds three: ``single`` (the unsharded model, eager), ``single_compiled`` (it
under ``torch.compile(fullgraph=True)``, inductor) and ``traced``
(``fsdp2.traced.fully_shard_traced`` on each block and the root, then the same compile:
no Python hook per block, the collectives in the graph); ``--inductor-pass P`` (repeatable)
adds those and ``traced+P``, compiled with one of inductor's collective passes
(``_inductor_passes.PASSES``, as in traced.py).
``fwd+bwd ms`` is forward, loss and ``backward()``; ``opt ms`` the optimizer step and
``zero_grad`` (DTensor parameters make it slower than the unsharded model's, whatever the
engine); ``first s`` the first step (the compiles, each from a fresh inductor cache as in
traced.py). Below the table, each traced row against both unsharded models: the fwd+bwd
ratio of the medians and the range of the per-step ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch._inductor.utils import fresh_cache
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _baseline import load_baseline  # noqa: E402
from _inductor_passes import GPU_ONLY, PASSES, passes_of, warm_inductor  # noqa: E402


def build(layers: int, dim: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(layers)])


def shard_with(
    impl: str, model: nn.Module, mesh, bucket_bytes: int | None = None, below: int = 0
) -> float:
    if impl in ("single", "single_compiled"):
        return 0.0
    if impl.startswith("traced"):
        from fsdp2.traced import fully_shard_traced

        t0 = time.perf_counter()
        for block in model:
            fully_shard_traced(block, mesh=mesh)
        fully_shard_traced(model, mesh=mesh)
        return time.perf_counter() - t0
    if impl in ("fsdp2_small", "fsdp2_replicate"):
        from torch.distributed.tensor import Replicate

        import fsdp2

        t0 = time.perf_counter()
        if impl == "fsdp2_replicate":
            for block in model:
                fsdp2.replicate(block, mesh=mesh)
            fsdp2.replicate(model, mesh=mesh)
        else:  # parameters under ``below`` elements replicated, the rest sharded

            def small(p: nn.Parameter) -> Replicate | None:
                return Replicate() if p.numel() < below else None

            for block in model:
                fsdp2.fully_shard(block, mesh=mesh, shard_placement_fn=small)
            fsdp2.fully_shard(model, mesh=mesh, shard_placement_fn=small)
        if bucket_bytes is not None:
            model.set_bucket_bytes(bucket_bytes)  # type: ignore[operator]
        return time.perf_counter() - t0
    if impl == "fsdp2":
        from fsdp2 import fully_shard
    elif impl == "baseline":
        fully_shard = sys.modules["fsdp2_baseline"].fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    t0 = time.perf_counter()
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if bucket_bytes is not None and impl == "fsdp2":
        model.set_bucket_bytes(bucket_bytes)  # type: ignore[operator]
    return time.perf_counter() - t0


def worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (args.world_size,))
    impls = ["fsdp2", "torch"]
    if args.replicate_below:
        impls.append("fsdp2_small")
    if args.replicate:
        impls.append("fsdp2_replicate")
    if args.baseline:
        load_baseline(args.baseline)
        impls.append("baseline")
    if args.traced or args.inductor_pass:
        impls += ["single", "single_compiled", "traced"]
    impls += [f"traced+{p}" for p in args.inductor_pass]
    compiled = [i for i in impls if i == "single_compiled" or i.startswith("traced")]
    caches = tempfile.mkdtemp(prefix=f"overhead-{rank}-")  # fresh_cache's, per rank
    if compiled:
        warm_inductor()
    models, opts, inits = {}, {}, {i: [] for i in impls}
    for impl in impls:
        m = build(args.layers, args.dim)
        inits[impl].append(shard_with(impl, m, mesh, args.bucket_bytes, args.replicate_below))
        if impl in compiled:
            m = torch.compile(m, fullgraph=True, options=passes_of(impl) or None)
        models[impl] = m
        opts[impl] = torch.optim.SGD(m.parameters(), lr=1e-3)
    times: dict[str, list[float]] = {i: [] for i in impls}
    fwd_bwd: dict[str, list[float]] = {i: [] for i in impls}
    first: dict[str, float] = {}
    x = torch.randn(8, args.dim)
    for it in range(args.warmup + args.steps):
        for impl in impls:  # interleaved
            m, opt = models[impl], opts[impl]
            dist.barrier()
            cold = it == 0 and impl in compiled  # a cold compile for each, see traced.py
            ctx = fresh_cache(dir=caches, delete=False) if cold else contextlib.nullcontext()
            t0 = time.perf_counter()
            with ctx:
                m(x).sum().backward()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            dt = time.perf_counter() - t0
            if it == 0:
                first[impl] = dt
            if it >= args.warmup:
                times[impl].append(dt)
                fwd_bwd[impl].append(t1 - t0)
    for _ in range(2):  # more init samples
        for impl in impls:
            m = build(args.layers, args.dim)
            inits[impl].append(shard_with(impl, m, mesh, below=args.replicate_below))
    if rank == 0:
        med = {i: statistics.median(times[i]) for i in impls}
        fb = {i: statistics.median(fwd_bwd[i]) for i in impls}
        opt_ms = {
            i: statistics.median(a - b for a, b in zip(times[i], fwd_bwd[i], strict=True))
            for i in impls
        }
        ini = {i: statistics.median(inits[i]) for i in impls}
        print(
            f"# {' '.join(sys.argv)}  ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cpus, "
            f"world {args.world_size}, torch {torch.__version__})"
        )
        print(
            f"{'impl':16} {'step ms':>9} {'per layer us':>13} {'init ms':>9} "
            f"{'fwd+bwd ms':>11} {'opt ms':>8} {'first s':>8}"
        )
        for i in impls:
            print(
                f"{i:16} {med[i] * 1e3:9.2f} {med[i] / args.layers * 1e6:13.1f} "
                f"{ini[i] * 1e3:9.1f} {fb[i] * 1e3:11.2f} {opt_ms[i] * 1e3:8.2f} {first[i]:8.2f}"
            )
        step_ratio = med["fsdp2"] / med["torch"]
        init_ratio = ini["fsdp2"] / ini["torch"]
        print(f"ratio fsdp2/torch: step {step_ratio:.2f}x, init {init_ratio:.2f}x")
        if args.baseline:
            print(
                f"ratio fsdp2/baseline: step {med['fsdp2'] / med['baseline']:.2f}x, "
                f"init {ini['fsdp2'] / ini['baseline']:.2f}x"
            )
        for other in ("fsdp2_small", "fsdp2_replicate"):
            if other in impls:
                ratios = sorted(a / b for a, b in zip(times[other], times["fsdp2"], strict=True))
                print(
                    f"ratio {other}/fsdp2: step {med[other] / med['fsdp2']:.2f}x "
                    f"(per-step {ratios[0]:.2f}-{ratios[-1]:.2f})"
                )
        for t in (i for i in impls if i.startswith("traced")):
            for ref in ("single", "single_compiled"):
                ratios = sorted(a / b for a, b in zip(fwd_bwd[t], fwd_bwd[ref], strict=True))
                print(
                    f"ratio {t}/{ref}: fwd+bwd {fb[t] / fb[ref]:.2f}x (per-step "
                    f"{ratios[0]:.2f}-{ratios[-1]:.2f}), step {med[t] / med[ref]:.2f}x"
                )
    dist.destroy_process_group()
    shutil.rmtree(caches, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--bucket-bytes", type=int, help="fsdp2: set_bucket_bytes(N) on the root")
    ap.add_argument("--baseline", help="a directory holding another fsdp2 package to compare")
    ap.add_argument(
        "--replicate-below",
        type=int,
        default=0,
        help="adds fsdp2_small: parameters under N elements placed Replicate() by "
        "shard_placement_fn, the rest sharded",
    )
    ap.add_argument("--replicate", action="store_true", help="adds fsdp2_replicate: replicate()")
    ap.add_argument(
        "--traced",
        action="store_true",
        help="adds single, single_compiled and traced (fully_shard_traced, compiled fullgraph)",
    )
    ap.add_argument(
        "--inductor-pass",
        action="append",
        default=[],
        metavar="PASS",
        help=f"adds traced+PASS (and --traced's three); PASS from {sorted(PASSES)}",
    )
    args = ap.parse_args()
    for name in args.inductor_pass:
        if any(n not in PASSES for n in name.split("+")):
            ap.error(
                f"--inductor-pass {name}: choose from {sorted(PASSES)} (joined with +); "
                f"{sorted(GPU_ONLY)} do not run on CPU (_inductor_passes.GPU_ONLY says why)"
            )
    mp.spawn(worker, args=(args,), nprocs=args.world_size)


if __name__ == "__main__":
    main()
