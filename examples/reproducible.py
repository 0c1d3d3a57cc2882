"""The same bits at every world size: one global batch, trained on 2 ranks and on 1.

    torchrun --nproc-per-node 2 examples/reproducible.py

Each step's global batch is 4 micro-batches. On the 2-rank mesh each rank takes 2
consecutive ones (rank 0 the first two), accumulating with
``set_requires_gradient_sync(False)`` but the last; then rank 0 alone trains a fresh copy of
the model on a 1-rank mesh with all 4. With ``fsdp2.reduction.set_deterministic`` the
gradients are summed in one canonical order in both runs, so the losses and the trained
weights agree bit for bit.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import fsdp2
from fsdp2.models import Llama, LlamaConfig
from fsdp2.reduction import set_deterministic

MICRO_BATCHES = 4  # per global batch
STEPS = 3


def train(mesh: DeviceMesh) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=32))
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    set_deterministic(model)  # every fully_shard module of it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    rank, world = mesh.get_local_rank(), mesh.size()
    per_rank = MICRO_BATCHES // world  # a power of two
    losses = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)  # the global batch, the same everywhere
        batch = torch.randint(0, 256, (MICRO_BATCHES, 2, 33), generator=gen)
        for j in range(per_rank):
            tokens = batch[rank * per_rank + j]
            model.set_requires_gradient_sync(j == per_rank - 1)
            loss = model(tokens[:, :-1], tokens[:, 1:])  # the micro-batch's own mean
            (loss / per_rank).backward()  # the usual loop: over the accumulation steps
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    weights = {n: p.full_tensor() for n, p in model.named_parameters()}
    return losses, weights


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    both = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    losses, weights = train(both)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, losses)

    alone = dist.new_group([0])  # every rank creates it; rank 0 trains on it alone
    if rank == 0:
        solo_losses, solo_weights = train(DeviceMesh.from_group(alone, "cpu"))
        two_rank_losses = [x for step in range(STEPS) for r in gathered for x in _of(r, step)]
        for step in range(STEPS):
            mine = two_rank_losses[step * MICRO_BATCHES : (step + 1) * MICRO_BATCHES]
            print(f"step {step}: loss {sum(mine) / len(mine):.5f} (micro-batch means {mine})")
        assert two_rank_losses == solo_losses, (two_rank_losses, solo_losses)
        for name, w in weights.items():
            assert torch.equal(w, solo_weights[name]), name
        print("2 ranks and 1 rank trained to the same bits")
    dist.barrier()
    dist.destroy_process_group()


def _of(losses: list[float], step: int) -> list[float]:
    per_rank = len(losses) // STEPS
    return losses[step * per_rank : (step + 1) * per_rank]


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
