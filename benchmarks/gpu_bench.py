"""The GPU numbers of ``make gpu-check``: fsdp2 against torch's FSDP2 and the unsharded model.

Six parts, each printed as a table and written as JSON (``--json``):

* ``step``: world size 1 (NCCL), a Llama (8 layers, dim 2048, vocabulary 32000, 4 x 2048
  tokens), bf16 mixed precision (``param_dtype=bf16, reduce_dtype=fp32``; the unsharded model
  under ``torch.autocast(bf16)``), AdamW. The unsharded model, fsdp2, fsdp2 with
  ``fsdp2.optim.step_on_local_shards`` and torch's FSDP2 live side by side and step in turn
  (interleaved), each step timed between two ``torch.cuda.synchronize()``. Reported: median
  step time, the per-round ratios' median and range, the step's peak memory above what was
  allocated before it, and the last loss of each (they must agree).
  Targets: fsdp2 at most 1.03x the unsharded model, at most torch's.
* ``memory``: ``torch.cuda.max_memory_allocated`` of a steady-state step (the third) of a
  ~1B-parameter Llama (18 layers, dim 2048) on rank 0 of 8, through torch's fake process
  group (collectives return at once, so one GPU holds one rank's share), built on the meta
  device and sharded, bf16 mixed precision, AdamW; each engine in a fresh process.
  Target: at most torch's.
* ``offload``: ``CPUOffloadPolicy()`` (pinned) at world size 1, a 4-layer Llama dim 2048:
  interleaved step time and the step's GPU peak, fsdp2 against torch's FSDP2.
* ``sync``: RL weight sync on rank 0 of 8 through the fake process group (collectives
  return at once: what remains is dispatch, packing, casts and copies), the step's Llama in
  fp32: the per-tensor ``full_tensor()`` loop over ``state_dict()`` (torch's FSDP2 and
  fsdp2) against ``fsdp2.checkpoint.iter_full_tensors`` (fp32 and bf16), interleaved; time
  and the GPU peak above what was allocated before. Target: the iterator at most half the
  loop's time.

* ``deterministic``: world size 1, the step's Llama, each batch as 4 micro-batches of one
  sequence accumulated with ``set_requires_gradient_sync(False)`` but the last: fsdp2's
  default against ``fsdp2.reduction.set_deterministic`` (fp32 trees of partial sums), both
  with the loss divided by 4, interleaved. Target: at most 1.10x (at world size 1 this is
  the cost of the trees; the exchange needs more GPUs).
* ``traced``: fsdp2's traced mode (``fsdp2.traced.fully_shard_traced``, compiled whole with
  ``fullgraph=True``) at world size 1, a 4-layer Llama, against the unsharded model compiled
  whole, eager fsdp2 and torch's FSDP2 with their blocks compiled (interleaved; compile time,
  recompiles), and its memory on rank 0 of 8 through the fake process group against eager
  fsdp2's. Targets and checks: ``benchmarks/_gpu_traced.py``. A part whose ``checks`` (no
  recompile after step 1, losses agreeing) fail exits 1 after writing its JSON.

``--device cpu`` runs the same code on a tiny model with gloo (what CI checks: the harness,
not the numbers); memory there is the live tensor bytes of ``benchmarks/_memory.py``.

    python benchmarks/gpu_bench.py --part step --json runs/gpu/step.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

from _gpu_harness import (  # noqa: E402
    SHAPES,
    MiB,
    impl_rows,
    init_fake_rank0,
    init_one_rank,
    interleaved,
    materialize,
    measured,
    random_tokens,
    ratios,
    shard,
    spread,
)
from _gpu_traced import part_traced, traced_memory_one, traced_table  # noqa: E402

import fsdp2  # noqa: E402
from fsdp2.models import Llama  # noqa: E402

PARTS = ("step", "memory", "offload", "sync", "deterministic", "traced")


# ---------------------------------------------------------------------------------------------
# step: world size 1, interleaved


def part_step(device: str, size: str, steps: int, warmup: int) -> dict[str, Any]:
    mesh = init_one_rank(device)
    cfg, batch, seq = SHAPES[size]["step"]
    models: dict[str, nn.Module] = {}
    optims: dict[str, torch.optim.Optimizer] = {}
    for impl in ("single", "fsdp2", "fsdp2_local_step", "torch_fsdp2"):
        torch.manual_seed(0)
        with torch.device(device):
            model = Llama(cfg)
        if impl != "single":
            shard(model, "torch" if impl == "torch_fsdp2" else "fsdp2", mesh)
        models[impl] = model
        optims[impl] = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if impl == "fsdp2_local_step":
            fsdp2.optim.step_on_local_shards(optims[impl])
    data = random_tokens(cfg, batch, seq, steps + warmup)
    run = interleaved(device, models, optims, data, warmup, autocast={"single"})
    times = run["times"]
    out = {
        "part": "step",
        "what": f"world size 1, Llama {cfg.n_layers} layers dim {cfg.dim} vocab "
        f"{cfg.vocab_size}, {batch}x{seq} tokens, bf16 mixed precision, AdamW",
        "impls": impl_rows(run, device),
        "ratios": {
            "fsdp2 / single": ratios(times, "fsdp2", "single"),
            "fsdp2_local_step / single": ratios(times, "fsdp2_local_step", "single"),
            "fsdp2 / torch_fsdp2": ratios(times, "fsdp2", "torch_fsdp2"),
            "torch_fsdp2 / single": ratios(times, "torch_fsdp2", "single"),
        },
        "targets": {"fsdp2 / single": 1.03, "fsdp2 / torch_fsdp2": 1.0},
    }
    dist.destroy_process_group()
    return out


def part_deterministic(device: str, size: str, steps: int, warmup: int) -> dict[str, Any]:
    from fsdp2.reduction import set_deterministic

    mesh = init_one_rank(device)
    cfg, batch, seq = SHAPES[size]["step"]
    models: dict[str, nn.Module] = {}
    optims: dict[str, torch.optim.Optimizer] = {}
    for impl in ("fsdp2", "fsdp2_deterministic"):
        torch.manual_seed(0)
        with torch.device(device):
            model = shard(Llama(cfg), "fsdp2", mesh)
        if impl == "fsdp2_deterministic":
            set_deterministic(model)
        models[impl] = model
        optims[impl] = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = random_tokens(cfg, batch, seq, steps + warmup)
    run = interleaved(
        device,
        models,
        optims,
        data,
        warmup,
        set(),
        micro=batch,
        scaled={"fsdp2", "fsdp2_deterministic"},
    )
    out = {
        "part": "deterministic",
        "what": f"world size 1, Llama {cfg.n_layers} layers dim {cfg.dim} vocab "
        f"{cfg.vocab_size}, {batch} micro-batches of 1x{seq} tokens, bf16 mixed precision, AdamW",
        "impls": impl_rows(run, device),
        "ratios": {
            "fsdp2_deterministic / fsdp2": ratios(run["times"], "fsdp2_deterministic", "fsdp2")
        },
        "targets": {"fsdp2_deterministic / fsdp2": 1.10},
    }
    dist.destroy_process_group()
    return out


# ---------------------------------------------------------------------------------------------
# memory: rank 0 of 8 through the fake process group, one engine per process


def _memory_one(device: str, size: str, engine: str, world: int) -> dict[str, Any]:
    mesh = init_fake_rank0(device, world)
    cfg, batch, seq = SHAPES[size]["memory"]
    with torch.device("meta"):
        model = Llama(cfg)
    shard(model, engine, mesh)
    materialize(model, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = random_tokens(cfg, batch, seq, 3)
    n_params = sum(p.numel() for p in model.parameters())

    def step(i: int) -> None:
        b = data[i].to(device)
        model(b[:, :-1], b[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    step(0)
    step(1)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = int(torch.cuda.memory_allocated())
        step(2)
        torch.cuda.synchronize()
        peak = int(torch.cuda.max_memory_allocated())
    else:
        from _memory import peak_step_bytes

        resident = 0
        peak = int(peak_step_bytes(lambda: step(2), model, opt))
    dist.destroy_process_group()
    return {
        "engine": engine,
        "params": n_params,
        "resident_mib": resident / MiB,
        "peak_mib": peak / MiB,
    }


def part_memory(device: str, size: str, world: int) -> dict[str, Any]:
    cfg = SHAPES[size]["memory"][0]
    results = {}
    for engine in ("fsdp2", "torch_fsdp2"):
        cmd = [sys.executable, os.path.abspath(__file__), "--part", "memory-one"]
        cmd += ["--device", device, "--size", size, "--engine", engine, "--world", str(world)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{engine} memory run failed:\n{proc.stdout}\n{proc.stderr}")
        results[engine] = json.loads(proc.stdout.strip().splitlines()[-1])
    ours, theirs = results["fsdp2"]["peak_mib"], results["torch_fsdp2"]["peak_mib"]
    return {
        "part": "memory",
        "what": f"rank 0 of {world} (fake process group), Llama {cfg.n_layers} layers dim "
        f"{cfg.dim} vocab {cfg.vocab_size} ({results['fsdp2']['params'] / 1e9:.2f}B "
        "parameters), bf16 mixed precision, AdamW, steady-state step",
        "impls": results,
        "ratios": {"fsdp2 / torch_fsdp2 peak": {"median": ours / theirs}},
        "targets": {"fsdp2 / torch_fsdp2 peak": 1.0},
    }


# ---------------------------------------------------------------------------------------------
# offload: CPUOffloadPolicy at world size 1


def part_offload(device: str, size: str, steps: int, warmup: int) -> dict[str, Any]:
    mesh = init_one_rank(device)
    cfg, batch, seq = SHAPES[size]["offload"]
    models: dict[str, nn.Module] = {}
    optims: dict[str, torch.optim.Optimizer] = {}
    for impl in ("fsdp2", "torch_fsdp2"):
        torch.manual_seed(0)
        with torch.device(device):
            model = Llama(cfg)
        models[impl] = shard(model, "torch" if impl == "torch_fsdp2" else "fsdp2", mesh, True)
        optims[impl] = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if device == "cuda":
        torch.cuda.empty_cache()
    data = random_tokens(cfg, batch, seq, steps + warmup)
    run = interleaved(device, models, optims, data, warmup, autocast=set())
    times = run["times"]
    out = {
        "part": "offload",
        "what": f"world size 1, CPUOffloadPolicy(), Llama {cfg.n_layers} layers dim {cfg.dim} "
        f"vocab {cfg.vocab_size}, {batch}x{seq} tokens, bf16 mixed precision, AdamW",
        "impls": impl_rows(run, device),
        "ratios": {"fsdp2 / torch_fsdp2": ratios(times, "fsdp2", "torch_fsdp2")},
        "targets": {"fsdp2 / torch_fsdp2": 1.0},
    }
    if device == "cuda":
        ours = run["peaks"]["fsdp2"] / max(run["peaks"]["torch_fsdp2"], 1)
        out["ratios"]["fsdp2 / torch_fsdp2 peak"] = {"median": ours}
    dist.destroy_process_group()
    return out


# ---------------------------------------------------------------------------------------------
# sync: RL weight sync, rank 0 of 8 through the fake process group


def part_sync(device: str, size: str, repeats: int, world: int) -> dict[str, Any]:
    from fsdp2.checkpoint import iter_full_tensors

    mesh = init_fake_rank0(device, world)
    cfg = SHAPES[size]["sync"][0]
    models = {}
    for engine in ("torch", "fsdp2"):
        torch.manual_seed(0)
        with torch.device(device):
            model = Llama(cfg)
        fn: Any = fsdp2.fully_shard
        if engine == "torch":
            from torch.distributed.fsdp import fully_shard as fn
        for block in model.layers:
            fn(block, mesh=mesh)
        models[engine] = fn(model, mesh=mesh)

    def loop(model: nn.Module) -> Any:
        return ((n, t.full_tensor()) for n, t in model.state_dict().items())

    ways = {
        "torch loop": lambda: loop(models["torch"]),
        "fsdp2 loop": lambda: loop(models["fsdp2"]),
        "iter fp32": lambda: iter_full_tensors(models["fsdp2"]),
        "iter bf16": lambda: iter_full_tensors(models["fsdp2"], dtype=torch.bfloat16),
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    peaks: dict[str, int] = {k: 0 for k in ways}
    for i in range(repeats + 1):  # the first round warms up
        for way, make in ways.items():
            with measured(device) as m:
                for _ in make():
                    pass
            if i:
                times[way].append(m.seconds)
                if device == "cuda":
                    peaks[way] = max(peaks[way], m.peak)
    dist.destroy_process_group()
    n_params = sum(p.numel() for p in models["fsdp2"].parameters())
    return {
        "part": "sync",
        "what": f"rank 0 of {world} (fake process group: collectives return at once), Llama "
        f"{cfg.n_layers} layers dim {cfg.dim} vocab {cfg.vocab_size} ({n_params / 1e6:.1f}M "
        f"parameters, {len(models['fsdp2'].state_dict())} tensors), fp32",
        "impls": {
            k: {
                "step_s": spread(v),
                "peak_above_resident_mib": peaks[k] / MiB if device == "cuda" else None,
            }
            for k, v in times.items()
        },
        "ratios": {
            f"{k} / torch loop": ratios(times, k, "torch loop")
            for k in ("fsdp2 loop", "iter fp32", "iter bf16")
        },
        "targets": {"iter fp32 / torch loop": 0.5, "iter bf16 / torch loop": 0.5},
    }


# ---------------------------------------------------------------------------------------------


def table(result: dict[str, Any]) -> str:
    """A markdown table of one part's result."""
    lines = [f"**{result['part']}**: {result['what']}", ""]
    impls = result["impls"]
    if result["part"] == "memory":
        lines += ["| impl | peak MiB | resident MiB |", "| --- | ---: | ---: |"]
        for k, v in impls.items():
            lines.append(f"| {k} | {v['peak_mib']:.0f} | {v['resident_mib']:.0f} |")
    elif result["part"] == "traced":
        lines += traced_table(result)
    else:
        sync = result["part"] == "sync"  # no loss: a weight sync is not a step
        head = "| impl | step s (median) | min | max | step peak above resident MiB |"
        lines += [
            head if sync else head + " last loss |",
            "| --- | ---: | ---: | ---: | ---: |" + ("" if sync else " ---: |"),
        ]
        for k, v in impls.items():
            s, peak = v["step_s"], v["peak_above_resident_mib"]
            peak_s = "n/a" if peak is None else f"{peak:.0f}"
            loss = "" if sync else f" {v['last_loss']:.4f} |"
            lines.append(
                f"| {k} | {s['median']:.4f} | {s['min']:.4f} | {s['max']:.4f} | {peak_s} |{loss}"
            )
    lines += ["", "| ratio | median | min | max | target |", "| --- | ---: | ---: | ---: | ---: |"]
    for k, v in result["ratios"].items():
        target = result.get("targets", {}).get(k)
        lo, hi = v.get("min"), v.get("max")
        lines.append(
            f"| {k} | {v['median']:.3f} | {'' if lo is None else f'{lo:.3f}'} | "
            f"{'' if hi is None else f'{hi:.3f}'} | {'' if target is None else f'<= {target}'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=(*PARTS, "memory-one", "traced-memory-one"), required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--size", choices=tuple(SHAPES), default=None, help="default: by device")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default by part)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--world", type=int, default=8, help="memory: the simulated world size")
    ap.add_argument(
        "--engine",
        default="fsdp2",
        help="memory-one: fsdp2 or torch_fsdp2; traced-memory-one: traced or fsdp2_blocks",
    )
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False (use --device cpu)")
    size = args.size or ("full" if args.device == "cuda" else "small")
    if args.part == "memory-one":
        engine = "torch" if args.engine == "torch_fsdp2" else "fsdp2"
        print(json.dumps(_memory_one(args.device, size, engine, args.world)))
        return
    if args.part == "traced-memory-one":
        print(json.dumps(traced_memory_one(args.device, size, args.engine, args.world)))
        return
    if args.part == "step":
        result = part_step(args.device, size, args.steps or 20, args.warmup)
    elif args.part == "memory":
        result = part_memory(args.device, size, args.world)
    elif args.part == "sync":
        result = part_sync(args.device, size, args.steps or 5, args.world)
    elif args.part == "deterministic":
        result = part_deterministic(args.device, size, args.steps or 10, args.warmup)
    elif args.part == "traced":
        steps = args.steps or (10 if args.device == "cuda" else 3)
        result = part_traced(args.device, size, steps, min(args.warmup, 2))
    else:
        result = part_offload(args.device, size, args.steps or 6, min(args.warmup, 2))
    result.update(device=args.device, size=size, torch=torch.__version__)
    print(table(result))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    failed = [c for c in result.get("checks", []) if not c["ok"]]
    if failed:
        sys.exit("checks failed: " + "; ".join(f"{c['check']} ({c['value']})" for c in failed))


if __name__ == "__main__":
    main()
