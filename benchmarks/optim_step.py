"""Optimizer step time over sharded parameters: torch's optimizer stepping DTensors
(fsdp2's and torch's FSDP2 parameters) against ``fsdp2.optim.step_on_local_shards``
and against the same optimizer on the unsharded model's plain tensors.

Many tiny layers (``Linear(dim, dim)`` + ReLU each, ``fully_shard`` per layer and
root), one forward/backward per round, then each implementation's ``optimizer.step()``
timed alone; implementations interleaved round by round. Prints the median step time
per implementation and its ratio to the plain-tensor step, and checks that the local
step's parameters equal the DTensor step's bitwise.

    python benchmarks/optim_step.py --world-size 1
    python benchmarks/optim_step.py --world-size 2 --optim adamw --foreach
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

IMPLS = ("plain", "fsdp2", "torch_fsdp2", "fsdp2_local")


def build(layers: int, dim: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(layers)])


def make_optim(params, args: argparse.Namespace) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    foreach = True if args.foreach else None
    if args.optim == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach)


def worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (args.world_size,))
    import fsdp2
    from fsdp2.optim import step_on_local_shards

    models, optims = {}, {}
    for impl in IMPLS:
        model = build(args.layers, args.dim)
        if impl != "plain":
            if impl == "torch_fsdp2":
                from torch.distributed.fsdp import fully_shard
            else:
                fully_shard = fsdp2.fully_shard
            for layer in model:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        models[impl] = model
        optims[impl] = make_optim(model.parameters(), args)
    step_on_local_shards(optims["fsdp2_local"])
    x = torch.randn(8, args.dim)
    times: dict[str, list[float]] = {i: [] for i in IMPLS}
    for it in range(args.warmup + args.steps):
        for impl in IMPLS:
            models[impl](x).sum().backward()
            dist.barrier()
            t0 = time.perf_counter()
            optims[impl].step()
            dt = time.perf_counter() - t0
            optims[impl].zero_grad()
            if it >= args.warmup:
                times[impl].append(dt)
    for (_, a), (_, b) in zip(
        models["fsdp2_local"].named_parameters(), models["fsdp2"].named_parameters(), strict=True
    ):
        assert torch.equal(a.to_local(), b.to_local()), "local step differs from DTensor step"
    med = torch.tensor([statistics.median(times[i]) for i in IMPLS], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"# python {' '.join(sys.argv)}")
        print(
            f"# {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cpus, torch "
            f"{torch.__version__}, world {args.world_size}, {args.layers} x Linear({args.dim}, "
            f"{args.dim}), {args.optim} foreach={args.foreach or 'default'}, "
            f"{args.steps} steps (median, max over ranks), load {os.getloadavg()[0]:.2f}"
        )
        print("| impl | step ms | vs plain |")
        print("| --- | ---: | ---: |")
        for i, impl in enumerate(IMPLS):
            print(f"| {impl} | {med[i] * 1e3:.2f} | {med[i] / med[0]:.2f}x |")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--optim", choices=("adamw", "sgd"), default="adamw")
    ap.add_argument("--foreach", action="store_true", help="foreach=True (default: torch's)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--port", type=int, default=29541)
    args = ap.parse_args()
    mp.spawn(worker, args=(args,), nprocs=args.world_size)


if __name__ == "__main__":
    main()
