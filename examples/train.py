"""Train a tiny MLP stack with fsdp2 on CPU ranks (placeholder example).

Run with ``make train``, i.e.
``torchrun --standalone --nproc_per_node 2 examples/train.py [--steps N]``.
Each rank draws its own batch of a fixed regression task; rank 0 prints the loss every step.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp2 import fully_shard


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class MLPStack(nn.Module):
    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))

    torch.manual_seed(0)  # same initial weights on every rank
    model = MLPStack(args.dim, args.depth)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)

    target = torch.randn(args.dim, 1, generator=torch.Generator().manual_seed(1))
    data_gen = torch.Generator().manual_seed(100 + rank)  # a different batch on each rank
    for step in range(args.steps):
        x = torch.randn(args.batch_size, args.dim, generator=data_gen)
        loss = nn.functional.mse_loss(model(x), x @ target)
        loss.backward()
        optim.step()
        optim.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # gloo has no ReduceOp.AVG
        mean_loss /= world_size
        if rank == 0:
            print(f"step {step:3d}  loss {mean_loss.item():.4f}", flush=True)

    dist.destroy_process_group()
    if rank == 0:
        print(f"done: {args.steps} steps on {world_size} ranks")


if __name__ == "__main__":
    main()
