"""``fsdp2 convert``'s peak memory on a ~1B-parameter checkpoint: does it stay near one tensor?

Writes a Llama-3.2-1B-shaped state dict (Hugging Face names, 1.24B parameters, random fp32:
4.9 GB) as a ``torch.distributed.checkpoint`` folder into ``--dir`` (with ``--ranks 2``,
as 2 ranks of an FSDP run save it: each tensor in 2 row chunks, written by 2 gloo processes),
then runs, each in a fresh process:

* ``dcp->safetensors``: ``fsdp2 convert DCP HF --max-shard-size 1GB``;
* ``safetensors->dcp``: ``fsdp2 convert HF DCP2`` (back again);

and checks that DCP2 holds the first checkpoint's tensors bit for bit (tensor by tensor).
For each conversion: the process's peak RSS (the kernel's high-water mark, ``VmHWM``, reset
through ``/proc/self/clear_refs`` once the modules are imported) minus its RSS before the
conversion, next to the largest tensor, the largest file written and the whole model. The
files are deleted at the end (``--keep`` keeps them). Needs ~15 GB free in ``--dir``.

    python benchmarks/convert_memory.py --dir /tmp/convert-bench
    python benchmarks/convert_memory.py --dir /tmp/cb --layers 2 --vocab 32000  # quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def shapes(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    """Llama-3.2-1B's tensors (tied embeddings), Hugging Face names."""
    h, i, kv = args.hidden, args.intermediate, args.hidden // 32 * 8  # 32 heads, 8 KV heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (args.vocab, h)}
    for n in range(args.layers):
        p = f"model.layers.{n}."
        out |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    out["model.norm.weight"] = (h,)
    return out


def _make_rank(rank: int, world: int, folder: str, args: argparse.Namespace, port: int) -> None:
    """One rank's rows of every tensor (random, seeded per tensor), saved with dcp.save."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for k, (name, shape) in enumerate(shapes(args).items()):
        g = torch.Generator().manual_seed(k)
        full = torch.randn(shape, generator=g)  # the same full tensor on every rank
        rows = full.chunk(world)[rank].clone()
        del full
        stride = torch.empty(shape, device="meta").stride()
        state[name] = DTensor.from_local(
            rows, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
        )
    dcp.save({"model": state}, checkpoint_id=folder)
    dist.destroy_process_group()


def make(folder: str, args: argparse.Namespace) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_make_rank, args=(args.ranks, folder, args, port), nprocs=args.ranks)


def child(argv: list[str]) -> None:
    """Run ``fsdp2 argv`` in this process; print its peak RSS above the RSS before it."""
    import fsdp2.checkpoint._convert  # noqa: F401  (imported before the baseline)
    import fsdp2.checkpoint._inspect  # noqa: F401
    from fsdp2.cli import main

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    start = time.perf_counter()
    code = main(argv)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    print(json.dumps({"code": code, "before": before, "peak": peak, "seconds": seconds}))


def measure(argv: list[str]) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(argv)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    if proc.returncode != 0:
        raise SystemExit(f"{argv} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["code"] != 0:
        raise SystemExit(f"{argv} exited {out['code']}:\n{proc.stderr[-3000:]}")
    return dict(out)


def same(a: str, b: str) -> int:
    """Compare two checkpoints tensor by tensor, bit for bit; the number compared."""
    import torch

    from fsdp2.checkpoint._inspect import open_checkpoint, select

    with open_checkpoint(a) as x, open_checkpoint(b) as y:
        kept, _ = select(x, None)
        assert sorted(kept) == sorted(y.tensors), (sorted(kept)[:3], sorted(y.tensors)[:3])
        for out, name in kept.items():
            ((_, t),) = x.read([name])
            ((_, u),) = y.read([out])
            assert t.dtype == u.dtype and torch.equal(
                t.view(-1).view(torch.uint8), u.view(-1).view(torch.uint8)
            ), out
        return len(kept)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def run(args: argparse.Namespace) -> None:
    import torch

    os.makedirs(args.dir, exist_ok=True)
    src, hf, back = (os.path.join(args.dir, n) for n in ("dcp", "hf", "dcp2"))
    for path in (src, hf, back):
        shutil.rmtree(path, ignore_errors=True)
    table = shapes(args)
    numel = {name: int(torch.Size(s).numel()) for name, s in table.items()}
    start = time.perf_counter()
    make(src, args)
    made = time.perf_counter() - start
    size = sum(numel.values()) * 4
    largest = max(numel.values()) * 4
    print(f"command: python benchmarks/convert_memory.py {' '.join(sys.argv[1:])}")
    print(
        f"date: {datetime.date.today()}, {platform.node()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}"
    )
    print(
        f"checkpoint: {sum(numel.values()):,} parameters in {len(table)} tensors, fp32, "
        f"{gib(size)}, DCP saved by {args.ranks} ranks in {made:.0f} s; largest tensor "
        f"{gib(largest)}"
    )
    results = []
    for what, argv in (
        ("dcp->safetensors", ["convert", src, hf, "--max-shard-size", args.max_shard_size]),
        ("safetensors->dcp", ["convert", hf, back]),
    ):
        r = measure(argv)
        out = argv[2]
        files = [os.path.join(out, f) for f in os.listdir(out)]
        biggest = max(os.path.getsize(f) for f in files)
        results.append((what, r, biggest, len(files)))
    n = same(src, back)
    print(f"bitwise: {n} tensors of dcp2 equal dcp's")
    print()
    print(
        "| conversion | peak RSS above start | RSS at start | largest tensor | largest file "
        "written | model | time |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for what, r, biggest, count in results:
        print(
            f"| {what} | {gib(r['peak'] - r['before'])} | {gib(r['before'])} | "
            f"{gib(largest)} | {gib(biggest)} ({count} files) | {gib(size)} | "
            f"{r['seconds']:.0f} s |"
        )
    if not args.keep:
        for path in (src, hf, back):
            shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/fsdp2-convert-bench")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=2, help="ranks that save the DCP checkpoint")
    ap.add_argument("--max-shard-size", default="1GB")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
    else:
        run(args)


if __name__ == "__main__":
    main()
