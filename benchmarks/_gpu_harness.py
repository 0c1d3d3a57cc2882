"""The harness of ``gpu_bench.py``: its model shapes, a process group of one rank (real or
rank 0 of a fake world), sharding with bf16 mixed precision (fsdp2 or torch's FSDP2), and the
interleaved loop that times each implementation's step and its peak memory.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fsdp2
from fsdp2.models import LlamaConfig

__all__ = [
    "SHAPES",
    "Measured",
    "MiB",
    "impl_rows",
    "init_fake_rank0",
    "init_one_rank",
    "interleaved",
    "measured",
    "random_tokens",
    "ratios",
    "shard",
    "spread",
]

MiB = 2**20


# name -> (config, batch, seq) per size; "small" is what --device cpu runs.
def _llama(vocab: int, dim: int, layers: int, heads: int, seq: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, max_seq_len=seq)


SHAPES: dict[str, dict[str, tuple[LlamaConfig, int, int]]] = {
    "full": {
        "step": (_llama(32000, 2048, 8, 16, 2048), 4, 2048),
        "memory": (_llama(32000, 2048, 18, 16, 2048), 2, 2048),
        "offload": (_llama(32000, 2048, 4, 16, 2048), 2, 2048),
        "sync": (_llama(32000, 2048, 8, 16, 2048), 0, 0),
        "traced": (_llama(32000, 2048, 4, 16, 2048), 4, 2048),
    },
    "small": {
        "step": (_llama(512, 64, 2, 4, 64), 2, 64),
        "memory": (_llama(512, 64, 3, 4, 64), 2, 64),
        "offload": (_llama(512, 64, 2, 4, 64), 2, 64),
        "sync": (_llama(512, 64, 2, 4, 64), 0, 0),
        "traced": (_llama(512, 64, 2, 4, 64), 2, 64),
    },
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_one_rank(device: str) -> DeviceMesh:
    """World size 1: NCCL on ``cuda`` (device 0), gloo on ``cpu``; its 1-rank mesh."""
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    return init_device_mesh(device, (1,))


def init_fake_rank0(device: str, world: int) -> DeviceMesh:
    """Rank 0 of ``world`` through torch's fake process group (collectives return at once,
    so one device holds one rank's share); its mesh."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world)
    if device == "cuda":
        torch.cuda.set_device(0)
    return init_device_mesh(device, (world,))


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@dataclass
class Measured:
    """What ``measured`` saw of its block."""

    seconds: float = 0.0
    """Wall time, between two device syncs."""
    peak: int = 0
    """CUDA: ``max_memory_allocated`` during the block above what was allocated before it
    (bytes); 0 on CPU."""


@contextlib.contextmanager
def measured(device: str) -> Iterator[Measured]:
    """Time the block between two syncs (``torch.cuda.synchronize`` on ``cuda``) and, on
    ``cuda``, its peak memory above what was allocated when it began; filled in on exit."""
    out = Measured()
    _synchronize(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = int(torch.cuda.memory_allocated()) if device == "cuda" else 0
    t0 = time.perf_counter()
    yield out
    _synchronize(device)
    out.seconds = time.perf_counter() - t0
    if device == "cuda":
        out.peak = int(torch.cuda.max_memory_allocated()) - before


def _policies(engine: str, offload: bool) -> dict[str, Any]:
    if engine == "fsdp2":
        mp_cls, off_cls = fsdp2.MixedPrecisionPolicy, fsdp2.CPUOffloadPolicy
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy as off_cls  # noqa: N813
        from torch.distributed.fsdp import MixedPrecisionPolicy as mp_cls  # noqa: N813
    kw: dict[str, Any] = {
        "mp_policy": mp_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    }
    if offload:
        kw["offload_policy"] = off_cls(pin_memory=torch.cuda.is_available())
    return kw


def shard(model: nn.Module, engine: str, mesh: Any, offload: bool = False) -> nn.Module:
    """``fully_shard`` each of ``model.layers``, then ``model``, with ``engine`` (``"fsdp2"`` or
    torch's), bf16 params / fp32 reduce and, with ``offload``, a ``CPUOffloadPolicy``."""
    if engine == "fsdp2":
        fn = fsdp2.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard as fn
    kw = _policies(engine, offload)
    for block in model.layers:  # type: ignore[union-attr]
        fn(block, mesh=mesh, **kw)
    fn(model, mesh=mesh, **kw)
    return model


def materialize(model: nn.Module, device: str) -> None:
    """A model sharded on the meta device, on ``device`` with seeded values (each rank its
    own shard's normal draws) and its RoPE buffer rebuilt (non-persistent)."""
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(std=0.02)
    model.rope = model._rope(torch.device(device))  # type: ignore[operator]


def random_tokens(cfg: LlamaConfig, batch: int, seq: int, n: int) -> torch.Tensor:
    """``n`` batches of ``batch`` x ``seq + 1`` tokens (inputs and shifted targets), seed 1234."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, cfg.vocab_size, (n, batch, seq + 1), generator=g)


def spread(xs: list[float]) -> dict[str, float]:
    """Median, min and max."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def interleaved(
    device: str,
    models: dict[str, nn.Module],
    optims: dict[str, torch.optim.Optimizer],
    data: torch.Tensor,
    warmup: int,
    autocast: set[str],
    micro: int = 1,
    scaled: set[str] = frozenset(),  # type: ignore[assignment]
) -> dict[str, Any]:
    """Step every model on each batch of ``data`` in turn, each step timed between two syncs;
    the first ``warmup`` rounds are not recorded. Those in ``autocast`` run under
    ``torch.autocast(bf16)``. ``micro`` > 1: each batch as that many micro-batches, synced on
    the last; the impls in ``scaled`` divide each micro-batch's loss by ``micro``. Returns
    ``times`` (per impl, per recorded round), ``peaks`` (bytes above what was allocated
    before the step, CUDA only) and ``losses`` (the last)."""
    times: dict[str, list[float]] = {k: [] for k in models}
    peaks: dict[str, int] = {k: 0 for k in models}
    losses: dict[str, float] = {}
    for i in range(data.size(0)):
        batch = data[i].to(device)
        for impl, model in models.items():
            with measured(device) as m:
                for j, mb in enumerate(batch.chunk(micro)):
                    if micro > 1:
                        model.set_requires_gradient_sync(j == micro - 1)  # type: ignore[operator]
                    with torch.autocast(device, torch.bfloat16, enabled=impl in autocast):
                        loss = model(mb[:, :-1], mb[:, 1:])
                    (loss / micro if impl in scaled else loss).backward()
                optims[impl].step()
                optims[impl].zero_grad()
            if i >= warmup:
                times[impl].append(m.seconds)
                if device == "cuda":
                    peaks[impl] = max(peaks[impl], m.peak)
            losses[impl] = float(loss.item())
    return {"times": times, "peaks": peaks, "losses": losses}


def impl_rows(run: dict[str, Any], device: str) -> dict[str, dict[str, Any]]:
    """Per implementation: step time spread, the step's peak above what was resident (CUDA),
    the last loss."""
    return {
        k: {
            "step_s": spread(v),
            "peak_above_resident_mib": run["peaks"][k] / MiB if device == "cuda" else None,
            "last_loss": run["losses"][k],
        }
        for k, v in run["times"].items()
    }


def ratios(times: dict[str, list[float]], num: str, den: str) -> dict[str, float]:
    """The spread of the per-round ratios ``times[num] / times[den]``."""
    return spread([a / b for a, b in zip(times[num], times[den], strict=True)])
