"""Sharded blocks, replicated small parameters, a replicated root: and the same numbers as DDP.

    torchrun --nproc-per-node 2 examples/replicate_mixed.py

Each transformer block is sharded with ``fully_shard``, except its RMSNorm weights, which
``shard_placement_fn`` keeps whole on every rank (``Replicate()``): they are tiny, so sharding
them saves nothing and costs a piece of every all-gather. The root (token embedding, final
norm and output head) is ``replicate``d: no all-gather at all, its gradients all-reduced as
DDP does. The script trains a few steps beside torch's ``DistributedDataParallel`` on the
same data and checks that losses and weights agree.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.nn.parallel import DistributedDataParallel

import fsdp2
from fsdp2.models import Llama, LlamaConfig

STEPS = 4


def build() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, max_seq_len=64))


def keep_norms_whole(param: torch.nn.Parameter) -> Replicate | None:
    return Replicate() if param.ndim == 1 else None  # None: shard on dim 0


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    model = build()
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh, shard_placement_fn=keep_norms_whole)
    fsdp2.replicate(model, mesh=mesh)

    ddp = DistributedDataParallel(build())
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ddp)]
    gen = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        tokens = torch.randint(0, 256, (4, 33), generator=gen)
        losses = []
        for m, opt in zip((model, ddp), optims, strict=True):
            loss = m(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if rank == 0:
            print(f"step {step}: loss {losses[0]:.5f} (DDP {losses[1]:.5f})")
        assert abs(losses[0] - losses[1]) < 1e-4, losses

    block = model.layers[0]
    if rank == 0:
        print(
            f"placements: block weights {block.attention.wq.weight.placements}, "
            f"block norms {block.attention_norm.weight.placements}, "
            f"root {model.output.weight.placements}"
        )
    ref = dict(ddp.module.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref[name].detach(), atol=1e-5, rtol=1e-5)
    if rank == 0:
        print("sharded and replicated modules trained like DDP")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
