"""How close ``fsdp2.estimate_memory`` comes to the measured peak of a training step.

For each configuration (model, dtype, ``reshard_after_forward``, mesh, activation
checkpointing) the real step runs on CPU with gloo, one process per rank, and its peak is
measured with the project's sampler (``_memory.peak_step_bytes``: persistent state plus
the C heap's high-water mark during the step, after every aten op); the estimate is
simulated in the parent process (fake tensors, fake process group). The step is the same
on both sides: forward + loss, backward, ``AdamW.step()``, ``zero_grad()``, measured after
two warm-up steps. Rank 0 holds the largest shards; the estimate is for rank 0 and is
compared with rank 0's measurement (the max over ranks is printed too).

    python benchmarks/estimate.py                 # the table in docs/benchmarks.md
    python benchmarks/estimate.py --only llama    # one model
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _memory import peak_step_bytes  # noqa: E402

import fsdp2  # noqa: E402
from fsdp2.models import Llama, LlamaConfig  # noqa: E402

MiB = 2**20


@dataclass(frozen=True)
class Config:
    model: str  # "llama" or "mlp"
    dtype: str  # "fp32" or "bf16"
    reshard: bool | int
    mesh: tuple[int, ...]
    ac: bool = False

    @property
    def name(self) -> str:
        mesh = "x".join(map(str, self.mesh)) + (" HSDP" if len(self.mesh) == 2 else "")
        ac = " +AC" if self.ac else ""
        return f"{self.model} {self.dtype} reshard={self.reshard} mesh {mesh}{ac}"

    @property
    def world(self) -> int:
        return int(torch.tensor(self.mesh).prod())


CONFIGS = [
    Config("llama", "fp32", True, (2,)),
    Config("llama", "fp32", False, (2,)),
    Config("llama", "bf16", True, (2,)),
    Config("llama", "fp32", True, (2,), ac=True),
    Config("llama", "fp32", True, (4,)),
    Config("llama", "fp32", 2, (4,)),
    Config("llama", "bf16", False, (4,)),
    Config("llama", "fp32", True, (2, 2)),
    Config("mlp", "fp32", True, (2,)),
    Config("mlp", "fp32", False, (2,)),
    Config("mlp", "bf16", True, (2,)),
    Config("mlp", "fp32", True, (2,), ac=True),
    Config("mlp", "fp32", True, (4,)),
    Config("mlp", "fp32", 2, (4,)),
    Config("mlp", "bf16", True, (2, 2)),
    Config("mlp", "fp32", True, (2, 2), ac=True),
]

LLAMA = LlamaConfig(vocab_size=256, dim=512, n_layers=8, n_heads=8, max_seq_len=256)
SEQ, LLAMA_BATCH = 256, 8
MLP_DIM, MLP_LAYERS, MLP_BATCH = 1024, 8, 512


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class MLP(nn.Module):
    """A stack of residual MLP blocks and a linear head: the "MLP stack"."""

    def __init__(self, dim: int = MLP_DIM, layers: int = MLP_LAYERS) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def build(cfg: Config) -> nn.Module:
    model = Llama(LLAMA) if cfg.model == "llama" else MLP()
    if cfg.ac:
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    return model


def batch(cfg: Config, device: str | None = None) -> tuple[torch.Tensor, ...]:
    if cfg.model == "llama":
        tok = torch.randint(0, LLAMA.vocab_size, (LLAMA_BATCH, SEQ), device=device)
        return tok, tok
    return (torch.randn(MLP_BATCH, MLP_DIM, device=device),)


def mp_policy(cfg: Config) -> fsdp2.MixedPrecisionPolicy:
    if cfg.dtype == "bf16":
        return fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return fsdp2.MixedPrecisionPolicy()


def step_fn(model: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(*b)


def estimate(cfg: Config) -> fsdp2.MemoryEstimate:
    with torch.device("meta"):
        model = build(cfg)
    return fsdp2.estimate_memory(
        model,
        batch(cfg, "meta"),
        mesh_shape=cfg.mesh,
        device="cpu",
        reshard_after_forward=cfg.reshard,
        mp_policy=mp_policy(cfg),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        step_fn=step_fn,
        compare=False,
    )


def measure(cfg: Config) -> int:
    """This rank's measured peak of one steady-state step."""
    torch.manual_seed(0)
    names = ("shard",) if len(cfg.mesh) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", cfg.mesh, mesh_dim_names=names)
    model = build(cfg)
    for block in model.layers:
        fsdp2.fully_shard(
            block, mesh=mesh, reshard_after_forward=cfg.reshard, mp_policy=mp_policy(cfg)
        )
    fsdp2.fully_shard(model, mesh=mesh, mp_policy=mp_policy(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        loss = step_fn(model, batch(cfg))
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    dist.barrier()
    return peak_step_bytes(step, model, opt)


def worker(rank: int, world: int, port: int, configs: list[Config], out: dict) -> None:  # type: ignore[type-arg]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    for cfg in configs:
        peak = torch.tensor([measure(cfg)], dtype=torch.float64)
        every = [torch.zeros_like(peak) for _ in range(world)]
        dist.all_gather(every, peak)
        if rank == 0:
            out[cfg.name] = [int(t.item()) for t in every]
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=("llama", "mlp"))
    ap.add_argument("--port", type=int, default=29571)
    args = ap.parse_args()
    configs = [c for c in CONFIGS if args.only in (None, c.model)]
    print(f"# {' '.join(sys.argv)}  ({time.strftime('%Y-%m-%d')}, {platform.node()}, "
          f"torch {torch.__version__}, {os.cpu_count()} cores)")  # fmt: skip
    estimates = {}
    for cfg in configs:
        t0 = time.perf_counter()
        estimates[cfg.name] = (estimate(cfg), time.perf_counter() - t0)
    measured: dict[str, list[int]] = {}
    manager = mp.Manager()
    for world in sorted({c.world for c in configs}):
        out = manager.dict()
        group = [c for c in configs if c.world == world]
        mp.spawn(worker, args=(world, args.port + world, group, out), nprocs=world)
        measured.update(out)
    print(
        "| configuration | measured rank 0 (MiB) | max over ranks | estimate (MiB) | error "
        "| peak at | estimate time (s) |"
    )
    print("|---|---:|---:|---:|---:|---|---:|")
    errors = []
    for cfg in configs:
        est, secs = estimates[cfg.name]
        m = measured[cfg.name]
        err = (est.peak_bytes - m[0]) / m[0]
        errors.append(abs(err))
        print(
            f"| {cfg.name} | {m[0] / MiB:.1f} | {max(m) / MiB:.1f} | "
            f"{est.peak_bytes / MiB:.1f} | {err:+.1%} | {est.when} | {secs:.1f} |"
        )
    print(f"\nlargest |error| {max(errors):.1%}, mean {sum(errors) / len(errors):.1%}")


if __name__ == "__main__":
    main()
