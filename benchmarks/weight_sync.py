"""Weight sync: a sharded model's full tensors, per tensor vs ``iter_full_tensors``.

A Qwen2-shaped Hugging Face model (random init; 24 layers, q/k/v biases, tied embeddings:
290 tensors) sharded with fsdp2's ``fully_shard`` on ``--world-size`` CPU ranks (gloo).
Interleaved repeats of: the per-tensor loop RL trainers write today (``{name:
t.full_tensor() for name, t in model.state_dict().items()}``: one all-gather per sharded
tensor), ``iter_full_tensors(model)`` (fp32), and ``iter_full_tensors(model,
dtype=torch.bfloat16)``. Prints rank 0's median wall time of each, the per-repeat ratio to
the loop (median, range) and the all-gathers each issues.

    python benchmarks/weight_sync.py --world-size 2 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fsdp2 import fully_shard

    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    from fsdp2.checkpoint import _stream, iter_full_tensors

    model = _model(args)
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(model.state_dict())
    n_sharded = sum(1 for t in model.state_dict().values() if t.placements[0].is_shard())
    items = _stream.plan([(n, t, t.dtype, []) for n, t in model.state_dict().items()])
    buckets = sum(isinstance(s, _stream._Bucket) for s in _stream._segments(items, 64 << 20))

    def loop() -> None:
        for _, t in model.state_dict().items():
            t.full_tensor()

    def fp32() -> None:
        for _ in iter_full_tensors(model):
            pass

    def bf16() -> None:
        for _ in iter_full_tensors(model, dtype=torch.bfloat16):
            pass

    ways = {"per-tensor full_tensor()": loop, "iter_full_tensors": fp32, "iter bf16": bf16}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in ways.values():
        _()  # warm-up
    for _ in range(args.repeats):
        for name, fn in ways.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        print(
            f"{n_params / 1e6:.1f}M parameters, {n_tensors} tensors ({n_sharded} sharded), "
            f"{args.world_size} ranks, {args.repeats} interleaved repeats"
        )
        gathers = dict(zip(ways, [n_sharded, buckets, buckets], strict=True))
        base = times["per-tensor full_tensor()"]
        for name, ts in times.items():
            ratios = [t / b for t, b in zip(ts, base, strict=True)]
            print(
                f"{name:26s} median {statistics.median(ts):.3f} s  "
                f"x{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})  "
                f"all-gathers {gathers[name]}"
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--port", type=int, default=29517)
    args = parser.parse_args()
    mp.spawn(_worker, args=(args,), nprocs=args.world_size)


if __name__ == "__main__":
    main()
