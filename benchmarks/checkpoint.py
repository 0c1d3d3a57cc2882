"""Full checkpoints in and out of a sharded model: peak RSS per rank and wall time.

Loading a full safetensors checkpoint (Hugging Face layout: two files + index) into a
Llama sharded over ``--world-size`` gloo ranks, three ways:

* ``fsdp2``: the model built on the meta device and sharded with fsdp2, then
  ``fsdp2.checkpoint.load_full_checkpoint`` (each rank reads its own shards' bytes);
* ``every-rank``: the same fsdp2 model materialised, every rank reads the whole checkpoint
  (``safetensors.torch.load_file``) and calls ``model.load_state_dict`` on it;
* ``torch-bcast``: torch's ``fully_shard`` model materialised, rank 0 reads the checkpoint
  and ``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)``.

Saving it back, two ways: ``fsdp2`` (``save_full_checkpoint``: streamed, files spread over
the ranks, fsync'ed before the rename) and ``torch-full`` (torch's ``fully_shard``:
``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` then rank 0
``safetensors.torch.save_file``, no fsync).

Every case runs in fresh processes, after the source checkpoint was read once (so it
comes from the page cache: the numbers are the methods' cost, not the disk's), from a
model on the meta device (materialised with ``to_empty`` inside the measured load; before
the measured save). The peak is the kernel's
RSS high-water mark of the operation alone (reset through ``/proc/self/clear_refs`` right
before it), minus the RSS before it. The target is each rank's own shard plus the largest
``fully_shard`` group's unsharded size. Cases are interleaved over ``--repeats`` rounds;
the table gives the median time and the largest peak. The checkpoint is written once into
``--dir`` (about 4 GiB for the default ~1B-parameter shape) and reused.

    python benchmarks/checkpoint.py                    # ~1B parameters, 2 ranks
    python benchmarks/checkpoint.py --dim 256 --layers 2 --vocab 1000   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fsdp2.models import Llama, LlamaConfig  # noqa: E402

LOADS = ("fsdp2", "every-rank", "torch-bcast")
SAVES = ("fsdp2", "torch-full")


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def warm(folder: str) -> None:
    """Read every file of ``folder`` once, so each case reads the checkpoint from the page
    cache (what a method costs, not how warm the disk cache happened to be)."""
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads
    )


def prepare(args: argparse.Namespace) -> str:
    """Write the source checkpoint once (one process, streamed by save_full_checkpoint)."""
    from fsdp2.checkpoint import save_full_checkpoint

    src = os.path.join(args.dir, "src")
    stamp = os.path.join(src, "shape.json")
    shape = json.dumps(vars(config(args)), default=str)
    if os.path.isfile(stamp) and open(stamp).read() == shape:
        return src
    shutil.rmtree(src, ignore_errors=True)
    with torch.device("meta"):
        model = Llama(config(args))
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    save_full_checkpoint(model, src, max_shard_size=(total + 1) // 2)
    with open(stamp, "w") as f:
        f.write(shape)
    return src


def build(engine: str, cfg: LlamaConfig):  # type: ignore[no-untyped-def]
    """The sharded model on the meta device (its rotary table real)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if engine == "fsdp2":
        from fsdp2 import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard  # type: ignore[no-redef]
    with torch.device("meta"):
        model = Llama(cfg)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.rope = model._rope(torch.device("cpu"))
    return model


def materialise(model) -> None:  # type: ignore[no-untyped-def]
    rope = model.rope
    model.to_empty(device="cpu")
    model.rope = rope


def run_case(rank: int, args: argparse.Namespace, op: str, case: str, src: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    torch.set_num_threads(1)
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from fsdp2.checkpoint import load_full_checkpoint, save_full_checkpoint

    cfg = config(args)
    files = sorted(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".safetensors"))
    engine = "torch" if case.startswith("torch") else "fsdp2"
    model = build(engine, cfg)
    if op == "save":  # load first (not measured), then measure the save
        materialise(model)
        if engine == "fsdp2":
            load_full_checkpoint(model, src)
        else:
            sd = {}
            for f in files:
                sd.update(load_file(f))
            set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True))
            del sd
    out = os.path.join(args.dir, f"out-{case}")
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
    dist.barrier()
    before = rss_bytes()
    reset_peak()
    t0 = time.perf_counter()
    if op == "load" and case == "fsdp2":
        load_full_checkpoint(model, src)
    elif op == "load" and case == "every-rank":
        materialise(model)
        sd = {}
        for f in files:
            sd.update(load_file(f))
        model.load_state_dict(sd)
        del sd
    elif op == "load":  # torch-bcast
        materialise(model)
        sd = {}
        if rank == 0:
            for f in files:
                sd.update(load_file(f))
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, sd, options=options)
        del sd
    elif case == "fsdp2":
        save_full_checkpoint(model, out)
    else:  # torch-full
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = get_model_state_dict(model, options=options)
        if rank == 0:
            os.makedirs(out, exist_ok=True)
            save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        del sd
    seconds = time.perf_counter() - t0
    peak = rss_bytes("VmHWM")
    checksum = sum(float(p.detach().to_local().double().sum()) for p in model.parameters())
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    result = {"seconds": seconds, "peak": peak - before, "before": before, "local": local}
    result["checksum"] = checksum
    with open(os.path.join(args.dir, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def largest_group_bytes(cfg: LlamaConfig) -> int:
    with torch.device("meta"):
        model = Llama(cfg)
    block = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    root = sum(p.numel() * p.element_size() for p in model.parameters()) - cfg.n_layers * block
    return max(block, root)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ops", default="load,save")
    ap.add_argument("--dir", default="/tmp/fsdp2-checkpoint-bench")
    ap.add_argument("--port", type=int, default=29561)
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=prepare, args=(args,))
    proc.start()
    proc.join()
    assert proc.exitcode == 0, "writing the source checkpoint failed"
    src = os.path.join(args.dir, "src")
    cases = [(op, c) for op in args.ops.split(",") for c in (LOADS if op == "load" else SAVES)]
    results: dict[tuple[str, str], list[list[dict]]] = {c: [] for c in cases}
    for _ in range(args.repeats):
        for op, case in cases:
            warm(src)
            mp.spawn(run_case, args=(args, op, case, src), nprocs=args.world_size)
            per_rank = []
            for r in range(args.world_size):
                with open(os.path.join(args.dir, f"result-{r}.json")) as f:
                    per_rank.append(json.load(f))
            results[(op, case)].append(per_rank)
            print(op, case, [round(x["seconds"], 2) for x in per_rank], flush=True)
    report(args, cases, results)


def report(args, cases, results) -> None:  # type: ignore[no-untyped-def]
    cfg = config(args)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Llama(cfg).parameters())
    group = largest_group_bytes(cfg)
    mib = 2**20
    print(f"# python {' '.join(sys.argv)}")
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()}, {os.cpu_count()} cpus, "
        f"torch {torch.__version__}, gloo, world {args.world_size}, Llama dim {args.dim} x "
        f"{args.layers} layers, vocab {args.vocab}: {n_params / 1e9:.2f}B params fp32 "
        f"({n_params * 4 / 2**30:.2f} GiB); largest group {group / mib:.0f} MiB; "
        f"{args.repeats} rounds (time: median of the slowest rank; peak: largest)"
    )
    print(
        "| op | method | seconds | rounds (s) | peak RSS MiB/rank (max) | own shard MiB | "
        "target MiB | peak vs target | checksum |"
    )
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for op, case in cases:
        rounds = results[(op, case)]
        times = [max(r["seconds"] for r in per_rank) for per_rank in rounds]
        peak = max(r["peak"] for per_rank in rounds for r in per_rank)
        local = max(r["local"] for per_rank in rounds for r in per_rank)
        target = local + group
        checksum = sum(r["checksum"] for r in rounds[-1])
        print(
            f"| {op} | {case} | {statistics.median(times):.2f} | "
            f"{', '.join(f'{t:.2f}' for t in times)} | {peak / mib:.0f} | {local / mib:.0f} | "
            f"{target / mib:.0f} | {peak / target:.2f}x | {checksum:.6e} |"
        )


if __name__ == "__main__":
    main()
