"""HSDP with the optimizer sharded over the replicas (``fsdp2.replica_optim``) against plain
HSDP: per-rank gradient, optimizer-state and peak memory (measured and estimated), the
bytes across replicas per step, and step time, on a ``(R, S)`` CPU mesh of gloo ranks.

Every implementation trains the same Llama (same init, same data) in the same process
group; steps are interleaved (one step of each in turn, ``--repeats`` times) so machine
noise hits all alike. Implementations:

* ``hsdp``: ``fully_shard`` on the ``(R, S)`` mesh, AdamW (the reference);
* ``pieces``: the same, AdamW wrapped with ``shard_over_replicas``;
* ``torch_hsdp``: torch's FSDP2 on the same mesh (step time only).

Memory per rank: gradients (``.grad`` local shards, or the pieces) and optimizer state
right before ``step()``; peak: ``benchmarks/_memory.py``'s (persistent state + the step's
heap high-water mark); estimated: ``fsdp2.estimate_memory`` on the same model and mesh.
Bytes across replicas: what this rank sends over the replicate group in one step, as a ring
sends it: ``(R-1)/R`` of a reduce-scatter's packed input or an all-gather's output, twice
that of an all-reduce's tensor.

    python benchmarks/replica_optim.py                  # (2, 2), 4 ranks, fp32
    python benchmarks/replica_optim.py --dtype bf16     # bf16 compute, fp32 reduce
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _memory import peak_step_bytes, storage_bytes  # noqa: E402

import fsdp2  # noqa: E402
from fsdp2._core.support.observe import HUB, Collective, Observer  # noqa: E402
from fsdp2.models import Llama, LlamaConfig  # noqa: E402
from fsdp2.replica_optim import ReplicaShardedOptimizer, shard_over_replicas  # noqa: E402

IMPLS = ("hsdp", "pieces", "torch_hsdp")


class _Across(Observer):
    """Bytes this rank sends into fsdp2's collectives over groups of ``size`` ranks that are
    not the shard group (the replicate group)."""

    def __init__(self, shard_group: dist.ProcessGroup) -> None:
        self.shard_group = shard_group
        self.sent: dict[str, int] = {}

    def collective(self, c: Collective) -> None:
        if c.group is self.shard_group:
            return
        # what a ring sends per rank: (n-1)/n of the tensor for a reduce-scatter (of its
        # packed input) or an all-gather (of its output), twice that for an all-reduce
        share = (c.group_size - 1) / c.group_size * (2 if c.kind == "all-reduce" else 1)
        self.sent[c.kind] = self.sent.get(c.kind, 0) + int(share * c.numel * c.dtype.itemsize)


def _config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
        max_seq_len=args.seq,
    )  # fmt: skip


def _shard(impl: str, model: torch.nn.Module, mesh, bf16: bool):  # type: ignore[no-untyped-def]
    if impl == "torch_hsdp":
        import torch.distributed.fsdp as api
    else:
        api = fsdp2  # type: ignore[assignment]
    mp_policy = api.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32 if bf16 else None
    )
    for block in model.layers:
        api.fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    api.fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def _held(model: torch.nn.Module, optim: torch.optim.Optimizer) -> tuple[int, int]:
    """Gradient and optimizer-state bytes this rank holds."""
    if isinstance(optim, ReplicaShardedOptimizer):
        grads = storage_bytes(optim.piece_grads())  # whole buffers, if pieces view one
    else:
        grads = storage_bytes([p.grad for p in model.parameters() if p.grad is not None])
    state = [
        v for st in optim.state.values() for k, v in st.items() if torch.is_tensor(v) and v.dim()
    ]
    return grads, storage_bytes(state)


def worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    world = args.replicas * args.shards
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh(
        "cpu", (args.replicas, args.shards), mesh_dim_names=("replicate", "shard")
    )
    cfg = _config(args)
    bf16 = args.dtype == "bf16"
    impls = args.impls.split(",")
    models, optims = {}, {}
    for impl in impls:
        torch.manual_seed(0)
        models[impl] = _shard(impl, Llama(cfg), mesh, bf16)
        optim = torch.optim.AdamW(models[impl].parameters(), lr=1e-3, foreach=True)
        optims[impl] = shard_over_replicas(optim) if impl == "pieces" else optim
    gen = torch.Generator().manual_seed(1234)
    total = args.repeats + args.warmup
    data = torch.randint(
        0, cfg.vocab_size, (total + 1, world * args.batch, args.seq + 1), generator=gen
    )
    held: dict[str, tuple[int, int]] = {}

    def step(impl: str, i: int) -> float:
        batch = data[i, rank * args.batch : (rank + 1) * args.batch]
        loss = models[impl](batch[:, :-1], batch[:, 1:])
        loss.backward()
        held[impl] = _held(models[impl], optims[impl])
        optims[impl].step()
        optims[impl].zero_grad()
        return loss.item()

    times: dict[str, list[float]] = {i: [] for i in impls}
    losses: dict[str, float] = {}
    for i in range(total):
        for impl in impls:
            dist.barrier()
            t0 = time.perf_counter()
            losses[impl] = step(impl, i)
            if i >= args.warmup:
                times[impl].append(time.perf_counter() - t0)
    across = {}
    for impl in ("hsdp", "pieces"):
        if impl in impls:
            seen = _Across(mesh.get_group(1))
            with HUB.observing(seen):
                step(impl, total)
            across[impl] = seen.sent
    peaks = {}
    for impl in ("hsdp", "pieces"):
        if impl in impls:
            dist.barrier()
            peaks[impl] = peak_step_bytes(
                functools.partial(step, impl, total), models[impl], optims[impl]
            )
    stats = torch.tensor(
        [[peaks.get(i, 0), *held.get(i, (0, 0))] for i in impls], dtype=torch.float64
    )
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    loss_t = torch.tensor([losses[i] for i in impls])
    dist.all_reduce(loss_t)
    if rank == 0:
        _report(args, impls, times, stats, (loss_t / world).tolist(), across, args.estimates)
    dist.destroy_process_group()


def _estimates(args: argparse.Namespace) -> dict[str, float]:
    """``fsdp2.estimate_memory``'s peak for each way (simulated rank 0, in this process)."""
    out = {}
    with torch.device("meta"):
        model = Llama(_config(args))
    batch = (
        torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta"),
        torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta"),
    )
    mp_policy = (
        fsdp2.MixedPrecisionPolicy(torch.bfloat16, torch.float32) if args.dtype == "bf16" else None
    )
    for impl, flag in (("hsdp", False), ("pieces", True)):
        est = fsdp2.estimate_memory(
            model, batch, mesh_shape=(args.replicas, args.shards), device="cpu",
            mp_policy=mp_policy, shard_over_replicas=flag,
            step_fn=lambda m, b: m(*b),
        )  # fmt: skip
        out[impl] = est.peak_bytes
    return out


def _report(args, impls, times, stats, losses, across, estimates) -> None:  # type: ignore[no-untyped-def]
    mib = 2**20
    med = {i: statistics.median(times[i]) for i in impls}
    print(
        f"\n(R, S) = ({args.replicas}, {args.shards}), {args.dtype}, Llama {args.layers} x "
        f"{args.dim}, batch {args.batch} x {args.seq} per rank, {args.repeats} repeats\n"
    )
    print("| impl | step s (median) | step vs hsdp (median, range) | grads MiB | optim state MiB "
          "| peak MiB | estimated peak MiB | sent across replicas MiB/step | loss |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for k, i in enumerate(impls):
        ratios = [a / b for a, b in zip(times[i], times["hsdp"], strict=True)]
        peak, grads, state = (stats[k] / mib).tolist()
        sent = across.get(i, {})
        sent_s = " + ".join(f"{kind} {b / mib:.2f}" for kind, b in sorted(sent.items())) or "-"
        est = f"{estimates[i] / mib:.0f}" if i in estimates else "-"
        mem = f"{grads:.1f} | {state:.1f} | {peak:.0f}" if i != "torch_hsdp" else "- | - | -"
        print(
            f"| {i} | {med[i]:.3f} | {med[i] / med['hsdp']:.3f}x ({min(ratios):.3f}-"
            f"{max(ratios):.3f}) | {mem} | {est} | {sent_s} | {losses[k]:.5f} |"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-estimate", dest="estimate", action="store_false")
    ap.add_argument("--port", type=int, default=29571)
    args = ap.parse_args(argv)
    if "hsdp" not in args.impls.split(","):
        ap.error("--impls must include hsdp (the reference)")
    # estimate_memory simulates on a fake process group of its own: before any real one
    args.estimates = _estimates(args) if args.estimate else {}
    mp.spawn(worker, args=(args,), nprocs=args.replicas * args.shards)


if __name__ == "__main__":
    main()
