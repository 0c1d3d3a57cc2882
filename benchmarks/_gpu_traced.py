"""The ``traced`` part of ``gpu_bench.py``: fsdp2's traced mode (``fsdp2.traced``, the
all-gathers and reduce-scatters in the compiled graph) against the unsharded model compiled
whole, eager fsdp2 and torch's FSDP2 with their blocks compiled.

(a) World size 1 (NCCL; gloo on ``--device cpu``), a Llama of 4 layers (half the ``step``
part's: inductor's compile time grows with the layers of a whole-model graph), dim 2048,
vocabulary 32000, 4 x 2048 tokens, AdamW; on CUDA bf16 mixed precision
(``param_dtype=bf16, reduce_dtype=fp32``; the unsharded model under ``torch.autocast``),
on the CPU fp32 (the tiny shapes of ``SHAPES["small"]``). Four implementations live side
by side and step in turn (interleaved, as ``step``):

* ``single_compiled``: the unsharded model, ``torch.compile(model, fullgraph=True)``;
* ``fsdp2_blocks``: ``block.compile()`` then ``fsdp2.fully_shard`` on each block, then the
  root (torchtitan's way, docs/compile.md: graphs per block, the hooks eager between them);
* ``traced``: ``fully_shard_traced`` on each block, then the root, then
  ``torch.compile(model, fullgraph=True)`` (one graph, the collectives in it: at one rank
  there are none, the local shard is the parameter);
* ``torch_blocks``: torch's FSDP2 the way of ``fsdp2_blocks``.

Each one's first step is compiled from a fresh inductor cache on CUDA
(``torch._inductor.utils.fresh_cache``; inductor's compile workers started before by a tiny
compile, as ``traced.py`` does), so ``first step s`` is a cold compile for each; on the CPU
the cache is the default one (CI checks the harness, not the numbers, and a warm cache
keeps it cheap). Reported: median step, the per-round ratios (traced against each of the
others, median and range), each one's step peak above resident (CUDA), first step, new
dynamo graphs in step 1, and new graphs, recompiles and graph breaks after it.

Targets: traced at most **1.10x** the unsharded compiled model's step. At one rank both run
the same compute in one graph (the traced mode casts each parameter to bf16 once, where
autocast casts it at each use, recomputed in backward with ``reshard_after_forward=True``);
what the traced mode adds is a hook per parameter landing its gradient as a DTensor and
AdamW's dispatch over DTensors (39 of them, a few microseconds each a step). On a ~40 ms
step (half the ``step`` part's 77 ms, estimated) that is a few percent; eager fsdp2 is
held to 1.03x the eager unsharded model (``step``), and a compiled step is shorter, so the
same overhead weighs more: 10% leaves room for noise, not for a slow path. Traced at most **1.0x**
``fsdp2_blocks`` and ``torch_blocks``: one graph with no hooks should not be slower than
graphs per block with eager hooks and copies between them (what the traced mode is for).

Checks (the part fails, after writing its JSON, when one does not hold): no new graph,
recompile or graph break after step 1, in any implementation; every step's loss within
``rtol`` of ``single_compiled``'s: 1e-4 in fp32 (inductor fuses, so sums round differently;
measured on the CPU: 7e-8), 2e-2 in bf16 (autocast and the mixed-precision policy cast in
other places; bf16 keeps 8 bits, ~4e-3 a rounding; measured on the CPU in bf16: 1.1e-4).
On random tokens the loss moves little in 13 steps, so this catches a broken step, not a
subtle one: ``test_traced_compiled_on_device`` (``tests/core/test_gpu.py``) holds the
traced mode to eager fsdp2 bitwise on the device.

(b) ``torch.cuda.max_memory_allocated`` of a steady-state step (the third) on rank 0 of 8
through torch's fake process group (collectives return at once, so one GPU holds one
rank's share), the same Llama built on the meta device and sharded, each engine in a fresh
process (as ``memory``): ``traced`` (compiled whole) against ``fsdp2_blocks`` (eager fsdp2,
its blocks compiled: the same per-block compiled compute as torchtitan runs, so the
difference is the engine's). On the CPU the peak is ``_memory.peak_step_bytes_compiled``'s
(the profiler's memory events: a dispatch mode would make dynamo skip compiled frames).
Torch's functional collectives run on the fake process group inside a compiled graph
(checked on the CPU with ``aot_eager`` and inductor, torch 2.13 and 2.11): it answers at once;
its all-gather fills every rank's rows with the input and its reduce-scatter returns the
input's first rows, so the values stay finite. Target: traced at most **1.0x** (the same
shards and optimizer state; with ``reshard_after_forward=True`` backward gathers again
rather than keeping the unsharded parameters, as eager fsdp2 does).

Time on one H200 (estimated: not yet run on a GPU): about 3 minutes, most of it compiling
cold: two whole-model graphs (~40 s each) and two block graphs in (a), a whole-model graph
(the collectives make it another) and a block graph in (b), 13 rounds of ~40 ms steps. On a
2-core CPU, tiny shapes: about 25 s with inductor's cache warm, about a minute cold.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from _gpu_harness import (
    SHAPES,
    MiB,
    init_fake_rank0,
    init_one_rank,
    materialize,
    measured,
    random_tokens,
    ratios,
    spread,
)

import fsdp2
from fsdp2.models import Llama

__all__ = ["IMPLS", "part_traced", "traced_memory_one", "traced_table"]

IMPLS = ("single_compiled", "fsdp2_blocks", "traced", "torch_blocks")
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2}
TARGETS = {
    "traced / single_compiled": 1.10,
    "traced / fsdp2_blocks": 1.0,
    "traced / torch_blocks": 1.0,
    "traced / fsdp2_blocks peak (rank 0 of 8)": 1.0,
}


def _mp(engine: str, bf16: bool) -> dict[str, Any]:
    if not bf16:
        return {}
    if engine == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy as cls
    else:
        cls = fsdp2.MixedPrecisionPolicy
    return {"mp_policy": cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


def wrap(impl: str, model: Llama, mesh: Any, bf16: bool) -> nn.Module:
    """Shard (all but ``single_compiled``) and compile ``model`` as ``impl`` does; returns
    what to call (the optimizer takes ``model.parameters()``)."""
    if impl == "single_compiled":
        return torch.compile(model, fullgraph=True)  # type: ignore[return-value]
    if impl == "traced":
        from fsdp2.traced import fully_shard_traced

        for block in model.layers:
            fully_shard_traced(block, mesh=mesh, **_mp("fsdp2", bf16))
        fully_shard_traced(model, mesh=mesh, **_mp("fsdp2", bf16))
        return torch.compile(model, fullgraph=True)  # type: ignore[return-value]
    engine = "torch" if impl == "torch_blocks" else "fsdp2"
    if engine == "torch":
        from torch.distributed.fsdp import fully_shard as fn
    else:
        fn = fsdp2.fully_shard
    for block in model.layers:
        block.compile()
        fn(block, mesh=mesh, **_mp(engine, bf16))
    fn(model, mesh=mesh, **_mp(engine, bf16))
    return model


def _dynamo_counts() -> tuple[int, int, int]:
    """dynamo's graphs compiled, recompiles and graph breaks so far (process totals)."""
    from torch._dynamo.utils import counters

    return (
        counters["stats"]["unique_graphs"],
        sum(counters["recompiles"].values()),
        sum(counters["graph_break"].values()),
    )


def _warm(device: str) -> None:
    """Inductor's one-time start (its compile workers, the toolchain checks) on no impl."""
    torch.compile(lambda x: (x.sin() + 1).sum())(torch.randn(8, device=device))


def part_traced(
    device: str,
    size: str,
    steps: int,
    warmup: int,
    cold: bool | None = None,
    bf16: bool | None = None,
) -> dict[str, Any]:
    """(a) world size 1, interleaved, then (b) rank 0 of 8 (one process per engine).
    ``cold``: each first step in a fresh inductor cache; ``bf16``: (a) in bf16 mixed
    precision ((b) is on CUDA); both default to whether ``device`` is CUDA."""
    from torch._inductor.utils import fresh_cache

    warmup = max(warmup, 1)  # the first round compiles
    bf16 = device == "cuda" if bf16 is None else bf16
    cold = device == "cuda" if cold is None else cold
    torch._dynamo.config.recompile_limit = 64  # the block impls compile the same code
    mesh = init_one_rank(device)
    cfg, batch, seq = SHAPES[size]["traced"]
    caches = tempfile.mkdtemp(prefix="gpu-bench-traced-")  # fresh_cache's, removed at the end
    _warm(device)
    models: dict[str, nn.Module] = {}
    optims: dict[str, torch.optim.Optimizer] = {}
    for impl in IMPLS:
        torch.manual_seed(0)
        with torch.device(device):
            model = Llama(cfg)
        models[impl] = wrap(impl, model, mesh, bf16)
        optims[impl] = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = random_tokens(cfg, batch, seq, steps + warmup)
    times: dict[str, list[float]] = {k: [] for k in IMPLS}
    peaks = dict.fromkeys(IMPLS, 0)
    losses: dict[str, list[float]] = {k: [] for k in IMPLS}
    first = dict.fromkeys(IMPLS, 0.0)
    graphs = {k: [0, 0, 0, 0] for k in IMPLS}  # step 1's graphs; later graphs, recompiles, breaks
    for i in range(data.size(0)):
        b = data[i].to(device)
        for impl in IMPLS:
            before = _dynamo_counts()
            first_cold = i == 0 and cold
            fresh = (
                fresh_cache(dir=caches, delete=False) if first_cold else contextlib.nullcontext()
            )
            with fresh, measured(device) as m:
                autocast = bf16 and impl == "single_compiled"
                with torch.autocast(device, torch.bfloat16, enabled=autocast):
                    loss = models[impl](b[:, :-1], b[:, 1:])
                loss.backward()
                optims[impl].step()
                optims[impl].zero_grad()
            after = _dynamo_counts()
            losses[impl].append(float(loss.item()))
            if i == 0:
                first[impl] = m.seconds
                graphs[impl][0] = after[0] - before[0]
            else:
                for k in range(3):
                    graphs[impl][k + 1] += after[k] - before[k]
            if i >= warmup:
                times[impl].append(m.seconds)
                if device == "cuda":
                    peaks[impl] = max(peaks[impl], m.peak)
    dist.destroy_process_group()
    shutil.rmtree(caches, ignore_errors=True)
    del models, optims
    if device == "cuda":
        torch.cuda.empty_cache()
    dtype = "bf16" if bf16 else "fp32"
    rtol = LOSS_RTOL[dtype]
    ref = losses["single_compiled"]
    checks = []
    for impl in IMPLS:
        later = graphs[impl][1:]
        checks.append(
            {
                "check": f"{impl}: no new graph, recompile or graph break after step 1",
                "ok": later == [0, 0, 0],
                "value": f"graphs/recompiles/breaks {later[0]}/{later[1]}/{later[2]}",
            }
        )
        if impl != "single_compiled":
            worst = max(abs(a - r) / abs(r) for a, r in zip(losses[impl], ref, strict=True))
            checks.append(
                {
                    "check": f"{impl}: every step's loss within rtol {rtol} of single_compiled's",
                    "ok": worst <= rtol,
                    "value": f"max relative difference {worst:.2e}",
                }
            )
    impls = {
        k: {
            "step_s": spread(times[k]),
            "peak_above_resident_mib": peaks[k] / MiB if device == "cuda" else None,
            "last_loss": losses[k][-1],
            "first_step_s": first[k],
            "graphs_step1": graphs[k][0],
            "after_step1": dict(
                zip(("graphs", "recompiles", "breaks"), graphs[k][1:], strict=True)
            ),
        }
        for k in IMPLS
    }
    memory = _traced_memory(device, size, 8)
    mem_ratio = memory["traced"]["peak_mib"] / memory["fsdp2_blocks"]["peak_mib"]
    return {
        "part": "traced",
        "what": f"world size 1, Llama {cfg.n_layers} layers dim {cfg.dim} vocab "
        f"{cfg.vocab_size}, {batch}x{seq} tokens, "
        f"{'bf16 mixed precision' if bf16 else 'fp32'}, AdamW; each first step compiles in "
        f"{'a fresh' if cold else 'the default'} inductor cache",
        "impls": impls,
        "ratios": {
            **{f"traced / {k}": ratios(times, "traced", k) for k in IMPLS if k != "traced"},
            "traced / fsdp2_blocks peak (rank 0 of 8)": {"median": mem_ratio},
        },
        "targets": TARGETS,
        "memory": {
            "what": f"rank 0 of 8 (fake process group), the same Llama, {batch}x{seq} tokens, "
            f"{'bf16 mixed precision' if device == 'cuda' else 'fp32'}, AdamW, steady-state "
            "step (the third), one process per engine",
            "impls": memory,
        },
        "checks": checks,
    }


# ---------------------------------------------------------------------------------------------
# (b): rank 0 of 8 through the fake process group, one engine per process


def traced_memory_one(device: str, size: str, impl: str, world: int) -> dict[str, Any]:
    """One engine's steady-state step peak on rank 0 of ``world`` (run in a fresh process)."""
    torch._dynamo.config.recompile_limit = 64
    mesh = init_fake_rank0(device, world)
    cfg, batch, seq = SHAPES[size]["traced"]
    with torch.device("meta"):
        model = Llama(cfg)
    run = wrap(impl, model, mesh, device == "cuda")
    materialize(model, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = random_tokens(cfg, batch, seq, 3)
    n_params = sum(p.numel() for p in model.parameters())
    autocast = device == "cuda" and impl == "single_compiled"

    def step(i: int) -> None:
        b = data[i].to(device)
        with torch.autocast(device, torch.bfloat16, enabled=autocast):
            loss = run(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()

    step(0)  # compiles
    step(1)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = int(torch.cuda.memory_allocated())
        step(2)
        torch.cuda.synchronize()
        peak = int(torch.cuda.max_memory_allocated())
    else:
        from _memory import peak_step_bytes_compiled, persistent_bytes

        resident = persistent_bytes(model, opt)
        peak = peak_step_bytes_compiled(lambda: step(2), model, opt)
    dist.destroy_process_group()
    return {"params": n_params, "resident_mib": resident / MiB, "peak_mib": peak / MiB}


def _traced_memory(device: str, size: str, world: int) -> dict[str, Any]:
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_bench.py")
    results = {}
    for impl in ("traced", "fsdp2_blocks"):
        cmd = [sys.executable, bench, "--part", "traced-memory-one", "--device", device]
        cmd += ["--size", size, "--engine", impl, "--world", str(world)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{impl} memory run failed:\n{proc.stdout}\n{proc.stderr}")
        results[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
    return results


# ---------------------------------------------------------------------------------------------


def traced_table(result: dict[str, Any]) -> list[str]:
    """The part's own rows: (a) with compile columns, (b), and the checks."""
    lines = [
        "| impl | step s (median) | min | max | step peak above resident MiB | last loss "
        "| first step s | graphs in step 1 | after step 1: graphs/recompiles/breaks |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for k, v in result["impls"].items():
        s, peak, later = v["step_s"], v["peak_above_resident_mib"], v["after_step1"]
        lines.append(
            f"| {k} | {s['median']:.4f} | {s['min']:.4f} | {s['max']:.4f} | "
            f"{'n/a' if peak is None else f'{peak:.0f}'} | {v['last_loss']:.4f} | "
            f"{v['first_step_s']:.1f} | {v['graphs_step1']} | "
            f"{later['graphs']}/{later['recompiles']}/{later['breaks']} |"
        )
    memory = result["memory"]
    lines += ["", f"memory: {memory['what']}", "", "| impl | peak MiB | resident MiB |"]
    lines.append("| --- | ---: | ---: |")
    for k, v in memory["impls"].items():
        lines.append(f"| {k} | {v['peak_mib']:.1f} | {v['resident_mib']:.1f} |")
    lines += ["", "| check | ok | value |", "| --- | --- | --- |"]
    for c in result["checks"]:
        lines.append(f"| {c['check']} | {'yes' if c['ok'] else '**NO**'} | {c['value']} |")
    return lines
