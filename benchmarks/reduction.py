"""The low-precision wire's error and bytes (``fsdp2.reduction.ExchangeReduceScatter``).

For world sizes 2, 4 and 8 (gloo ranks on this machine), every rank packs gradient-like
inputs (normal values, magnitudes spread over six decades) for every other rank and the
reduce-scatter is run each way; each rank compares its slice with the exact sum (fp64) and
reports the error per element relative to the sum of the pieces' magnitudes (the scale of a
sum's rounding, which does not blow up where the pieces cancel). Ways:

* ``fp32 exchange``: ``ExchangeReduceScatter()`` on fp32 inputs (one rounding per add);
* ``bf16 wire``: ``ExchangeReduceScatter(torch.bfloat16)``: pieces rounded to bf16 once,
  summed in fp32;
* ``fp8 e4m3`` / ``fp8 e5m2 wire``: pieces scaled per 128-element block, summed in fp32;
* ``bf16 reduce``: the sum computed in bf16 by the collective (gloo's all-reduce), what
  ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` runs; its result is bf16.

    python benchmarks/reduction.py            # a markdown table (docs/mixed_precision.md)
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fsdp2.reduction import ExchangeReduceScatter  # noqa: E402

WAYS = {
    "fp32 exchange": torch.float32,
    "bf16 wire, fp32 sum": torch.bfloat16,
    "fp8 e4m3 wire, fp32 sum": torch.float8_e4m3fn,
    "fp8 e5m2 wire, fp32 sum": torch.float8_e5m2,
}


def _inputs(rank: int, world: int, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(world, numel, generator=gen) * torch.logspace(-3, 3, numel)


def _worker(rank: int, world: int, port: int, numel: int, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    pieces = [_inputs(r, world, numel)[rank].double() for r in range(world)]
    exact = sum(pieces)
    scale = sum(p.abs() for p in pieces)
    mine = _inputs(rank, world, numel)
    got: dict[str, torch.Tensor] = {}
    sent: dict[str, int] = {}
    for way, wire in WAYS.items():
        comm = ExchangeReduceScatter(wire)
        out = torch.empty(numel)
        comm(out, mine.view(-1), dist.group.WORLD, dist.ReduceOp.SUM, True).wait()
        got[way], sent[way] = out, comm.bytes_sent
    bf16 = mine.to(torch.bfloat16)
    dist.all_reduce(bf16)
    got["bf16 reduce"], sent["bf16 reduce"] = bf16[rank], mine.numel() * 2
    errs = {k: ((v.double() - exact).abs() / scale) for k, v in got.items()}
    queue.put((rank, {k: (e.median().item(), e.max().item(), sent[k]) for k, e in errs.items()}))
    dist.destroy_process_group()


def measure(world: int, numel: int) -> dict[str, tuple[float, float, int]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, numel, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    # over every rank's elements: the median of medians, the max of maxima
    out = {}
    for way in results[0]:
        meds = sorted(results[r][way][0] for r in results)
        out[way] = (
            meds[len(meds) // 2],
            max(results[r][way][1] for r in results),
            results[0][way][2],
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--numel", type=int, default=1 << 16, help="elements per rank's slice")
    args = ap.parse_args()
    print("| world | way | median error | max error | bytes sent per rank / fp32's |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for world in map(int, args.worlds.split(",")):
        res = measure(world, args.numel)
        fp32 = res["fp32 exchange"][2]
        for way, (med, mx, sent) in res.items():
            print(f"| {world} | {way} | {med:.2e} | {mx:.2e} | {sent / fp32:.3f} |")


if __name__ == "__main__":
    main()
