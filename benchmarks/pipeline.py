"""Pipeline schedules over sharded stages: fsdp2 against torch's FSDP2, per schedule.

``--world-size`` CPU ranks (gloo) as a ``(pp=2, dp)`` mesh; a stack of ``--blocks``
tanh-linear blocks of width ``--dim`` split into 2 stages (4 for the looped and V-shaped
schedules), each block and each stage root sharded over the dp submesh
(``reshard_after_forward`` as ``--raf``), ``--microbatches`` micro-batches of ``--rows``
rows, AdamW. For each schedule three stage sets train side by side, in interleaved repeats
(the order rotates every repeat):

* ``torch``: torch's ``fully_shard`` (torch's schedules drive it);
* ``fsdp2``: fsdp2's ``fully_shard`` with ``fsdp2.integrations.pipelining`` enabled (what
  fsdp2 does by itself);
* ``fsdp2 unaware``: the same with the integration disabled: what the schedules did to
  fsdp2 stages before it (one gather and reduce per micro-batch). Not for the zero-bubble
  schedules with ``--raf false``: their weight step then finds no unsharded parameter
  (``KeyError`` in torch's ``stage_backward_weight``).

Printed for rank 0 (a first-stage rank): the data-parallel bytes per step (this rank's
all-gather inputs and reduce-scatter inputs, fsdp2's observed by the engine, torch's by
wrapping ``torch.distributed``), the median step time, and the per-repeat ratio to torch's
(median, range), as markdown rows for docs/benchmarks.md.

    python benchmarks/pipeline.py --world-size 4 --repeats 8
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the tests' pipeline stages

ENGINES = ("torch", "fsdp2", "fsdp2 unaware")
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def _bytes(counter: Any) -> int:
    return sum(c.numel * 4 for c in counter.calls if c.kind in ("AG", "RS"))


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    from comm_counter import CommCounter
    from pipeline_models import SCHEDULES, build_stages, pp_dp_mesh, run_step
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fsdp2
    from fsdp2.integrations import pipelining

    shard = {"torch": torch_fully_shard, "fsdp2": fsdp2.fully_shard}
    raf = {"true": True, "false": False}[args.raf]
    mesh = pp_dp_mesh(2)
    rows = args.rows * args.microbatches
    names = args.schedules.split(",") if args.schedules else list(SCHEDULES)
    for name in names:
        runs: dict[str, Any] = {}
        engines = ENGINES if raf or name not in SPLIT_BACKWARD else ENGINES[:2]
        for engine in engines:
            if engine == "fsdp2 unaware":
                pipelining.disable()
            sched, mods = build_stages(
                name,
                shard[engine.split()[0]],
                mesh,
                n_microbatches=args.microbatches,
                dim=args.dim,
                blocks=args.blocks,
                shard_kwargs={"reshard_after_forward": raf},
            )
            opt = torch.optim.AdamW([p for m in mods for p in m.parameters()], lr=1e-4)
            runs[engine] = {"sched": sched, "opt": opt, "times": [], "bytes": 0}
            pipelining.enable()

        def step(engine: str, i: int, measure: bool, runs: dict[str, Any] = runs) -> None:
            run = runs[engine]
            if engine == "fsdp2 unaware":
                pipelining.disable()
            dist.barrier()
            t0 = time.perf_counter()
            with CommCounter() as counter:
                run_step(run["sched"], mesh, i, rows, args.dim)
                run["opt"].step()
                run["opt"].zero_grad()
            dist.barrier()
            if measure:
                run["times"].append(time.perf_counter() - t0)
                run["bytes"] = _bytes(counter)
            pipelining.enable()

        for i in range(2):  # warm-up (the first step also infers the stages' shapes)
            for engine in engines:
                step(engine, i, False)
        for r in range(args.repeats):
            k = r % len(engines)
            for engine in engines[k:] + engines[:k]:
                step(engine, 2 + r, True)
        if rank == 0:
            base = runs["torch"]
            for engine in engines:
                run = runs[engine]
                ratios = [a / b for a, b in zip(run["times"], base["times"], strict=True)]
                print(
                    f"| {name} | {engine} | {run['bytes'] / 2**20:.2f} MiB "
                    f"({run['bytes'] / base['bytes']:.2f}x) | "
                    f"{statistics.median(run['times']) * 1e3:.1f} ms | "
                    f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |",
                    flush=True,
                )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16, help="rows per micro-batch")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--raf", choices=["true", "false"], default="true")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--schedules", default="", help="comma-separated (default: all)")
    args = parser.parse_args()
    print(f"$ python benchmarks/pipeline.py {' '.join(sys.argv[1:])}")
    print(
        f"{datetime.date.today()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {args.world_size} gloo ranks "
        f"(pp=2 x dp={args.world_size // 2}), dim {args.dim}, {args.blocks} blocks, "
        f"{args.microbatches} micro-batches of {args.rows} rows, "
        f"reshard_after_forward={args.raf}"
    )
    print("| schedule | stages | data-parallel bytes / step (rank 0) | step | vs torch |")
    print("| --- | --- | --- | --- | --- |")
    port = 29500 + os.getpid() % 1000
    mp.spawn(_worker, args=(args, port), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
