"""Weight sync: a sharded model's full tensors, per tensor vs ``iter_full_tensors``.

A Qwen2-shaped Hugging Face model (random init; 24 layers, q/k/v biases, tied embeddings:
290 tensors, 136M parameters) sharded on ``--world-size`` CPU ranks (gloo), once with
torch's FSDP2 and once with fsdp2's ``fully_shard`` (same weights). Interleaved repeats of:

* ``torch loop`` / ``fsdp2 loop``: what RL trainers write today, ``{name: t.full_tensor()
  for name, t in model.state_dict().items()}`` (one all-gather per sharded tensor);
* ``iter fp32`` / ``iter bf16``: ``iter_full_tensors(model)`` and with
  ``dtype=torch.bfloat16`` (the cast before the gather).

With ``--lora`` both models are PEFT LoRA models (r=16 on every linear) and the engine
wants merged weights: the loops gather every tensor and merge ``W + scale * B @ A`` by hand
(as trainers do without ``merge_lora``), the iterator runs with ``merge_lora=True``.

Each way is consumed as an engine would (every tensor dropped once handed on). Printed
for rank 0: median wall time, the per-repeat ratio to ``torch loop`` (median, range), the
all-gathers issued, the bytes yielded, and the peak of the memory the way allocates on top
of the model (every new storage followed by a dispatch mode, in a run of its own).

    python benchmarks/weight_sync.py --world-size 2 --repeats 5 [--lora]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(args: argparse.Namespace, shard: Callable[..., Any]) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

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
    model: Any = Qwen2ForCausalLM(config)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=16, lora_alpha=32, target_modules=LINEARS, init_lora_weights=False)
        model = get_peft_model(model, lora)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    layers = model.base_model.model.model.layers if args.lora else model.model.layers
    for layer in layers:
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _loop(model: Any, lora: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The per-tensor loop; with LoRA, everything gathered and then merged by hand."""
    if not lora:
        for name, t in model.state_dict().items():
            yield name, t.full_tensor()
        return
    full = {name: t.full_tensor() for name, t in model.state_dict().items()}
    for name, t in full.items():
        if "lora_" in name:
            continue
        if name.endswith(".base_layer.weight"):
            prefix = name[: -len("base_layer.weight")]
            a, b = full[prefix + "lora_A.default.weight"], full[prefix + "lora_B.default.weight"]
            t = t + (b @ a) * 2.0  # lora_alpha / r
            name = prefix + "weight"
        yield name.replace("base_model.model.", "").replace(".base_layer.", "."), t


class _Live(TorchDispatchMode):
    """The bytes of the storages created inside the block that are still alive, and their
    peak (ops writing into or viewing existing storages create none)."""

    def __init__(self) -> None:
        super().__init__()
        # storage -> (its weak reference, the tensor that made it (weakly), bytes counted)
        self.live: dict[int, tuple[StorageWeakRef, weakref.ref[torch.Tensor], int]] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        if not schema.is_mutable and not func.is_view:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                    s = t.untyped_storage()
                    if s._cdata not in self.live:
                        self.live[s._cdata] = (StorageWeakRef(s), weakref.ref(t), s.nbytes())
                        self.now += s.nbytes()
        for key, (ref, maker, n) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.now -= n
                continue
            t = maker()  # a storage freed in place (resized to 0 bytes) counts as freed
            if t is not None and t.untyped_storage().nbytes() != n:
                m = t.untyped_storage().nbytes()
                self.live[key] = (ref, maker, m)
                self.now += m - n
        self.peak = max(self.peak, self.now)
        return out


def _all_gathers(fn: Callable[[], Any]) -> int:
    """fsdp2's all-gathers (its observer) plus DTensor's (functional collectives)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from fsdp2._core.support.observe import HUB, Collective, Observer

    class Count(Observer):
        n = 0

        def collective(self, c: Collective) -> None:
            self.n += c.kind == "all-gather"

    count = Count()
    with HUB.observing(count), CommDebugMode() as comm:
        fn()
    counts = comm.get_comm_counts()
    return count.n + sum(n for op, n in counts.items() if "all_gather" in str(op))


def _worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp2 import fully_shard
    from fsdp2.checkpoint import iter_full_tensors

    theirs = _model(args, torch_fully_shard)
    ours = _model(args, fully_shard)
    n_params = sum(p.numel() for p in ours.parameters())
    bucket = args.bucket_mb << 20
    merge = {"merge_lora": True} if args.lora else {}
    ways: dict[str, Callable[[], Iterator[tuple[str, torch.Tensor]]]] = {
        "torch loop": lambda: _loop(theirs, args.lora),
        "fsdp2 loop": lambda: _loop(ours, args.lora),
        "iter fp32": lambda: iter_full_tensors(ours, bucket_bytes=bucket, **merge),
        "iter bf16": lambda: iter_full_tensors(
            ours, dtype=torch.bfloat16, bucket_bytes=bucket, **merge
        ),
    }
    nbytes: dict[str, int] = {}
    gathers: dict[str, int] = {}
    peaks: dict[str, int] = {}
    names: dict[str, list[str]] = {}
    for way, make in ways.items():  # warm-up, counts, bytes, names
        seen: list[tuple[str, int]] = []

        def drain(
            make: Callable[[], Iterator[tuple[str, torch.Tensor]]] = make,
            seen: list[tuple[str, int]] = seen,
        ) -> None:
            seen.extend((name, t.numel() * t.element_size()) for name, t in make())

        gathers[way] = _all_gathers(drain)
        nbytes[way] = sum(n for _, n in seen)
        names[way] = [name for name, _ in seen]
        live = _Live()
        with live:
            for _ in make():
                pass
        peaks[way] = live.peak
    assert all(sorted(n) == sorted(names["torch loop"]) for n in names.values()), "names differ"
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.repeats):
        for way, make in ways.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in make():
                pass
            times[way].append(time.perf_counter() - start)
    if rank == 0:
        what = "LoRA r=16 on every linear, merged" if args.lora else "no LoRA"
        print(
            f"{n_params / 1e6:.1f}M parameters, {len(names['iter fp32'])} tensors yielded, "
            f"{what}, {args.world_size} ranks, buckets {args.bucket_mb} MiB, "
            f"{args.repeats} interleaved repeats"
        )
        print(
            "| way | median s | x torch loop (range) | all-gathers | MiB yielded | peak extra MiB |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        base = times["torch loop"]
        for way, ts in times.items():
            ratios = [t / b for t, b in zip(ts, base, strict=True)]
            print(
                f"| {way} | {statistics.median(ts):.3f} | {statistics.median(ratios):.2f} "
                f"({min(ratios):.2f}-{max(ratios):.2f}) | {gathers[way]} | "
                f"{nbytes[way] / 2**20:.0f} | {peaks[way] / 2**20:.0f} |"
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--bucket-mb", type=int, default=64)
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
