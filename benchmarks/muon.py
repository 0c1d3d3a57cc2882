"""Optimizer step time of ``fsdp2.optim.Muon`` on a sharded Llama, against the naive way
of running Muon on shards, an "ideal" bound, and AdamW; and the extra memory of each step.

The model: ``fsdp2.models.Llama`` (default: the config of docs/benchmarks.md's compare.py runs,
8 layers, dim 512, vocab 8192), every block and the root sharded with ``fsdp2.fully_shard``
over ``--world-size`` gloo ranks. The stepped parameters are ``muon_param_groups``' Muon
group (the attention and MLP matrices, 56 of them by default); their gradients come from one
forward/backward and are kept for every step. Each method steps its own copy of those
parameters (the same values, layouts and gradients):

* ``muon``: ``fsdp2.optim.Muon`` over the model's own sharded parameters (each matrix put
  together and orthogonalized on one owner rank, buckets of ``--bucket-mb``).
* ``naive``: the same momentum on the local shards, then, per matrix, every rank gathers the
  full update (``DTensor.full_tensor()`` of it, in bfloat16 like Muon's exchange), runs
  Newton-Schulz on it and keeps its shard of the result: every rank orthogonalizes every
  matrix. Its parameters must end bitwise equal to ``muon``'s (checked).
* ``ideal``: not a step; the time one process takes to run Newton-Schulz over all the full
  matrices (bfloat16, measured in every rank at the same time, as the step runs it: the
  mean over ranks), divided by the world size, plus the time to move the matrices once each
  way (two ``all_to_all_single`` of this rank's shards of all matrices in bfloat16, equal
  splits: the max over ranks). It leaves out the elementwise work (momentum, weight decay,
  the update) and any imbalance between owners.
* ``adamw``: ``torch.optim.AdamW(foreach=True)`` stepping the DTensors; ``adamw_local``:
  the same under ``fsdp2.optim.step_on_local_shards``.

Repeats interleave the methods (the order rotates each repeat); a step's time is the
slowest rank's, from a barrier to its end. The table gives medians with the min-max over
repeats, and per-repeat ratios (median and min-max). Afterwards one more step of each runs
under ``benchmarks/_memory.py``'s C-heap sampler (the heap in use after every aten op):
the extra memory is the peak during the step minus the heap before it (the momentum
buffers exist already), the max over ranks. For ``muon`` it is compared with the largest
bucket's full matrices in bfloat16 (what one owner may hold at once, by
``fsdp2.optim.Muon``'s docstring, next to the send/receive buffers). Two more steps of
``muon`` show where its time and memory go on each rank (``_Phases``: momentum and
packing, waits, assembling and splitting the full matrices, Newton-Schulz, the update),
and one of ``naive`` its Newton-Schulz time.

    python benchmarks/muon.py --world-size 2
    python benchmarks/muon.py --world-size 4 --repeats 5
    python benchmarks/muon.py --world-size 2 --layers 2 --dim 128 --vocab 512   # quick
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _memory import _PeakHeap, heap_in_use  # noqa: E402

import fsdp2  # noqa: E402
import fsdp2.muon._exchange as muon_exchange  # noqa: E402
from fsdp2.models import Llama, LlamaConfig  # noqa: E402
from fsdp2.optim import Muon, muon_param_groups, step_on_local_shards  # noqa: E402

STEPS = ("muon", "naive", "adamw", "adamw_local")
ROWS = ("muon", "naive", "ideal", "adamw", "adamw_local")
MiB = 2**20


class NaiveMuon(torch.optim.Optimizer):
    """Muon on sharded parameters the naive way: every rank gathers every full update and
    orthogonalizes it, then keeps its shard. ``fsdp2.optim.Muon``'s numbers (same momentum,
    the same bfloat16 full matrix into the same Newton-Schulz, the same update)."""

    def __init__(self, params: Any, lr: float = 1e-3, weight_decay: float = 0.1) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": 0.95,
            "nesterov": True,
            "ns_coefficients": fsdp2.muon.DEFAULT_NS_COEFFICIENTS,
            "eps": fsdp2.muon.DEFAULT_EPS,
            "ns_steps": fsdp2.muon.DEFAULT_NS_STEPS,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                local, grad = p._local_tensor, p.grad._local_tensor
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]._local_tensor
                buf.lerp_(grad, 1 - g["momentum"])
                update = grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
                full = DTensor.from_local(
                    update.bfloat16(),
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                ).full_tensor()
                ortho = muon_exchange._newton_schulz(
                    full, g["ns_coefficients"], g["ns_steps"], g["eps"]
                )
                dim = p.placements[0].dim  # (Shard(d),): fully_shard's 1D layout
                mine = ortho.chunk(p.device_mesh.size(), dim=dim)[p.device_mesh.get_local_rank()]
                rows, cols = p.shape
                local.mul_(1 - g["lr"] * g["weight_decay"])
                local.add_(mine, alpha=-muon_exchange._adjust_lr(g["lr"], None, rows, cols))


def build(args: argparse.Namespace, mesh: Any) -> nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=args.seq,
    )
    model = Llama(cfg)
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model


def copies(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Independent parameters with ``params``' values, layouts and gradients."""
    out = []
    for p in params:
        q = nn.Parameter(p.detach().clone())
        assert p.grad is not None
        q.grad = p.grad.detach().clone()
        out.append(q)
    return out


def timed(fn: Callable[[], object]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def ns_all(mats: list[torch.Tensor]) -> None:
    """Newton-Schulz over every full matrix, as ``fsdp2.optim.Muon`` runs it."""
    c, steps, eps = fsdp2.muon.DEFAULT_NS_COEFFICIENTS, fsdp2.muon.DEFAULT_NS_STEPS, 1e-7
    for m in mats:
        muon_exchange._newton_schulz(m, c, steps, eps)  # in place on bf16: same work


def move_once(flat: torch.Tensor, world: int) -> Callable[[], None]:
    """The matrices' shards to their owners and back: two ``all_to_all_single``."""
    other = torch.empty_like(flat)

    def run() -> None:
        dist.all_to_all_single(other, flat)
        dist.all_to_all_single(flat, other)

    return run


def peak_extra(step: Callable[[], object]) -> int:
    """Heap bytes above the level before ``step``, at its peak (``_memory._PeakHeap``)."""
    gc.collect()
    dist.barrier()
    base = heap_in_use()
    mode = _PeakHeap()
    with mode:
        step()
    return max(0, mode.peak - base)


class _Phases:
    """While entered, time (and sample the heap in) the parts of ``fsdp2.optim.Muon``'s step
    on this rank, by patching ``fsdp2.muon._exchange``: the momentum and packing of the
    shards (``_send_to_owners``), Newton-Schulz, the rest of ``_orthogonalize`` (assembling
    the full matrices, splitting and packing the results), waiting for the exchanges, and
    the update (``_apply`` less its wait). With ``heap=True`` the peak heap above the
    level at entry is kept per part (every aten op samples it, as ``_memory._PeakHeap``)."""

    NAMES = ("momentum+pack", "wait", "assemble+split", "newton-schulz", "update")

    def __init__(self, heap: bool = False) -> None:
        self.seconds = dict.fromkeys(self.NAMES, 0.0)
        self.peak = dict.fromkeys(self.NAMES, 0)
        self.heap = heap
        self.stack: list[str] = []

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **k: Any) -> Any:
            outer = self.stack[-1] if self.stack else None
            self.stack.append(name)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                self.stack.pop()
                self.seconds[name] += dt
                if outer is not None:  # inner time is not the outer part's
                    self.seconds[outer] -= dt

        return run

    def __enter__(self) -> _Phases:
        ex = muon_exchange
        self.saved = {
            k: getattr(ex, k)
            for k in ("_send_to_owners", "_orthogonalize", "_apply", "_newton_schulz")
        }
        self.wait = ex._Exchange.wait
        ex._send_to_owners = self._wrap("momentum+pack", ex._send_to_owners)  # type: ignore[assignment]
        ex._orthogonalize = self._wrap("assemble+split", ex._orthogonalize)  # type: ignore[assignment]
        ex._apply = self._wrap("update", ex._apply)  # type: ignore[assignment]
        ex._newton_schulz = self._wrap("newton-schulz", ex._newton_schulz)  # type: ignore[assignment]
        ex._Exchange.wait = self._wrap("wait", ex._Exchange.wait)  # type: ignore[method-assign]
        if self.heap:
            phases = self

            class Sampler(_PeakHeap):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                    out = func(*args, **(kwargs or {}))
                    if phases.stack:
                        name = phases.stack[-1]
                        used = heap_in_use() - phases.base
                        phases.peak[name] = max(phases.peak[name], used)
                    return out

            gc.collect()
            self.base = heap_in_use()
            self.mode = Sampler()
            self.mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.heap:
            self.mode.__exit__(*exc)
        for k, v in self.saved.items():
            setattr(muon_exchange, k, v)
        muon_exchange._Exchange.wait = self.wait  # type: ignore[method-assign]


def worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    torch.set_num_threads(args.threads)
    world = args.world_size
    mesh = init_device_mesh("cpu", (world,))
    model = build(args, mesh)
    gen = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=gen)
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    params = [p for p in muon_param_groups(model)[0][0]["params"]]
    sets = {"muon": params, **{k: copies(params) for k in STEPS[1:]}}
    muon = Muon(sets["muon"], bucket_bytes=args.bucket_mb * MiB)
    optims: dict[str, torch.optim.Optimizer] = {
        "muon": muon,
        "naive": NaiveMuon(sets["naive"]),
        "adamw": torch.optim.AdamW(sets["adamw"], foreach=True),
        "adamw_local": step_on_local_shards(torch.optim.AdamW(sets["adamw_local"], foreach=True)),
    }
    full = [torch.randn(p.shape, generator=gen).bfloat16() for p in params]
    local_numel = sum(p.to_local().numel() for p in params)
    flat = torch.randn(-(-local_numel // world) * world, generator=gen).bfloat16()
    jobs: dict[str, Callable[[], object]] = {k: o.step for k, o in optims.items()}
    jobs["ns_total"] = lambda: ns_all(full)
    jobs["move"] = move_once(flat, world)
    names = list(jobs)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.warmup + args.repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            dt = timed(jobs[name])
            if r >= args.warmup:
                times[name].append(dt)
    # the slowest rank per repeat (the mean over ranks for one process's Newton-Schulz)
    table = torch.tensor([times[k] for k in names], dtype=torch.float64)
    slowest, mean = table.clone(), table.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(mean)
    mean /= world
    per: dict[str, list[float]] = {k: slowest[i].tolist() for i, k in enumerate(names)}
    per["ns_total"] = mean[names.index("ns_total")].tolist()
    per["ideal"] = [n / world + m for n, m in zip(per["ns_total"], per["move"], strict=True)]

    # memory: one more step of each, under the heap sampler
    extra = torch.tensor([peak_extra(optims[k].step) for k in STEPS], dtype=torch.float64)
    dist.all_reduce(extra, op=dist.ReduceOp.MAX)
    # where Muon's step spends its time and memory on each rank, and naive's Newton-Schulz
    dist.barrier()
    t0 = time.perf_counter()
    with _Phases() as timing:
        muon.step()
    timing.seconds["total"] = time.perf_counter() - t0
    dist.barrier()
    with _Phases(heap=True) as heap:
        muon.step()
    with _Phases() as naive_timing:
        dist.barrier()
        optims["naive"].step()
    part = [timing.seconds[k] for k in (*_Phases.NAMES, "total")]
    part += [heap.peak[k] for k in _Phases.NAMES] + [naive_timing.seconds["newton-schulz"]]
    gathered = [torch.zeros(len(part), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor(part, dtype=torch.float64))
    # the same numbers: naive's parameters equal Muon's bitwise (each took as many steps)
    optims["naive"].step()  # (Muon took one more above, under the heap sampler)
    for a, b in zip(sets["muon"], sets["naive"], strict=True):
        assert torch.equal(a.to_local(), b.to_local()), "naive Muon differs from fsdp2's"
    # buckets as the step makes them
    routes = muon._collect()
    buckets = [b for route in routes for b in muon_exchange._buckets(route, muon.bucket_bytes)]
    bucket_bytes = [sum(2 * m.rows * m.cols for m in b.order) for b in buckets]
    owned_cost = [0] * world
    for b in buckets:
        for m in b.order:
            owned_cost[m.owner] += m.cost
    if rank == 0:
        report(args, per, extra.tolist(), gathered, bucket_bytes, owned_cost, params)
    dist.barrier()
    dist.destroy_process_group()


def _spread(xs: list[float], scale: float = 1.0, fmt: str = ".1f") -> str:
    return f"{min(xs) * scale:{fmt}}-{max(xs) * scale:{fmt}}"


def _ratio(per: dict[str, list[float]], a: str, b: str) -> str:
    rs = [x / y for x, y in zip(per[a], per[b], strict=True)]
    return f"{statistics.median(rs):.2f}x ({_spread(rs, fmt='.2f')})"


def report(
    args: argparse.Namespace,
    per: dict[str, list[float]],
    extra: list[float],
    parts: list[torch.Tensor],
    bucket_bytes: list[int],
    owned_cost: list[int],
    params: list[nn.Parameter],
) -> None:
    med = {k: statistics.median(v) for k, v in per.items()}
    n_params = sum(p.numel() for p in params)
    print(f"# python {' '.join(sys.argv)}")
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cpus, torch {torch.__version__}, "
        f"gloo, world {args.world_size}, {args.threads} thread(s)/rank; Llama {args.layers} "
        f"layers dim {args.dim} vocab {args.vocab}: {len(params)} Muon matrices, "
        f"{n_params / 1e6:.1f}M params; {args.repeats} repeats (+{args.warmup} warm-up), "
        f"interleaved; load {os.getloadavg()[0]:.2f}"
    )
    print()
    print("| step | median ms | min-max ms | vs naive | vs ideal | vs AdamW | extra MiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    labels = {
        "muon": "fsdp2.optim.Muon",
        "naive": "naive Muon (all gather all, NS everywhere)",
        "ideal": "ideal (NS/world + move once each way)",
        "adamw": "AdamW foreach (DTensors)",
        "adamw_local": "AdamW foreach (step_on_local_shards)",
    }
    for k in ROWS:
        cols = [
            f"{med[k] * 1e3:.1f}",
            _spread(per[k], 1e3),
            _ratio(per, k, "naive") if k != "naive" else "1",
            _ratio(per, k, "ideal") if k != "ideal" else "1",
            _ratio(per, k, "adamw") if k != "adamw" else "1",
            f"{extra[STEPS.index(k)] / MiB:.1f}" if k in STEPS else "",
        ]
        print(f"| {labels[k]} | " + " | ".join(cols) + " |")
    print()
    largest = max(bucket_bytes)
    print(
        f"- one process's Newton-Schulz over all {len(params)} full matrices: "
        f"{med['ns_total'] * 1e3:.1f} ms ({_spread(per['ns_total'], 1e3)}); moving this "
        f"rank's shards once each way: {med['move'] * 1e3:.1f} ms ({_spread(per['move'], 1e3)})"
    )
    print(
        f"- buckets (bucket_bytes {args.bucket_mb} MiB): {len(bucket_bytes)}, the largest "
        f"{largest / MiB:.1f} MiB of full bf16 matrices; Muon's extra memory "
        f"{extra[0] / MiB:.1f} MiB = {extra[0] / largest:.2f}x the largest bucket"
    )
    mean_cost = sum(owned_cost) / len(owned_cost)
    n = len(_Phases.NAMES)
    print(
        f"- owners' Newton-Schulz cost (m*n*min(m,n)) max/mean {max(owned_cost) / mean_cost:.3f}; "
        "Newton-Schulz ms inside one naive step, per rank: "
        + ", ".join(f"{t[-1].item() * 1e3:.0f}" for t in parts)
    )
    print()
    print("One fsdp2.optim.Muon step, per rank (ms; waits include the peers' lateness):")
    print()
    print("| rank | " + " | ".join(_Phases.NAMES) + " | other | total |")
    print("| ---: |" + " ---: |" * (n + 2))
    for r, t in enumerate(parts):
        ms = [x * 1e3 for x in t[: n + 1].tolist()]
        ms.insert(n, ms[n] - sum(ms[:n]))
        print(f"| {r} | " + " | ".join(f"{x:.1f}" for x in ms) + " |")
    print()
    print("Peak heap above the step's start, MiB, per rank and part of the step:")
    print()
    print("| rank | " + " | ".join(_Phases.NAMES) + " |")
    print("| ---: |" + " ---: |" * n)
    for r, t in enumerate(parts):
        peaks = t[n + 1 : 2 * n + 1].tolist()
        print(f"| {r} | " + " | ".join(f"{x / MiB:.1f}" for x in peaks) + " |")
    print()
    r_naive = statistics.median(m / n for m, n in zip(per["muon"], per["naive"], strict=True))
    r_ideal = statistics.median(m / n for m, n in zip(per["muon"], per["ideal"], strict=True))
    verdict = {True: "met", False: "MISSED"}
    print(
        f"- targets: Muon <= 0.6x naive: {r_naive:.2f}x, {verdict[r_naive <= 0.6]}; "
        f"<= 1.25x ideal: {r_ideal:.2f}x, {verdict[r_ideal <= 1.25]}; extra memory <= the "
        f"largest bucket: {extra[0] / largest:.2f}x, {verdict[extra[0] <= largest]}"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank (for the grads)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--bucket-mb", type=int, default=fsdp2.muon.DEFAULT_BUCKET_BYTES // MiB)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--port", type=int, default=29561)
    args = ap.parse_args(argv)
    mp.spawn(worker, args=(args,), nprocs=args.world_size)


if __name__ == "__main__":
    main()
