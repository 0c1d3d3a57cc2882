"""Pipeline parallelism with fsdp2 stages: torch's schedules, fsdp2's fully_shard.

    torchrun --standalone --nproc_per_node 4 examples/pipeline_train.py

A small Llama is split into two pipeline stages, as torchtitan splits it: the first keeps
the token embedding and the first half of the blocks, the second the other half, the final
norm and the output head, all under their names in the whole model. The 4 ranks form a
``(pp=2, dp=2)`` mesh: each stage's blocks and the stage itself are sharded with
``fsdp2.fully_shard`` over its two data-parallel ranks, with ``reshard_after_forward=False``
(torchtitan's setting under PP: the parameters are gathered once per step, not once per
micro-batch). torch's ``PipelineStage`` and ``Schedule1F1B`` run them; nothing else is
needed: fsdp2 teaches torch's schedules its modules by itself (``fsdp2.integrations.
pipelining``). Every rank also trains the unsharded model on the global batch, and the
script checks that losses and weights agree.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import fsdp2
from fsdp2.models import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, max_seq_len=64)


class Stage(nn.Module):
    """Blocks ``first..last - 1`` of ``model`` (and its embedding / head at the ends)."""

    def __init__(self, model: Llama, first: int, last: int) -> None:
        super().__init__()
        n = len(model.layers)
        self.tok_embeddings = model.tok_embeddings if first == 0 else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(first, last)})
        self.norm = model.norm if last == n else None
        self.output = model.output if last == n else None
        self.register_buffer("rope", model.rope, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build() -> Llama:
    torch.manual_seed(0)
    return Llama(CFG)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"]

    half = CFG.n_layers // 2
    stage_module = Stage(build(), *((0, half) if pp == 0 else (half, CFG.n_layers)))
    for block in stage_module.layers.values():
        fsdp2.fully_shard(block, mesh=dp, reshard_after_forward=False)
    fsdp2.fully_shard(stage_module, mesh=dp, reshard_after_forward=False)
    stage = PipelineStage(stage_module, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    optim = torch.optim.AdamW(stage_module.parameters(), lr=1e-3)

    replica = build()  # the unsharded model, on the whole global batch
    replica_optim = torch.optim.AdamW(replica.parameters(), lr=1e-3)
    rows = 2 * args.microbatches  # per data-parallel rank
    for step in range(args.steps):
        tokens = torch.randint(
            0, 256, (rows * dp.size(), 33), generator=torch.Generator().manual_seed(step)
        )
        mine = tokens[dp.get_local_rank() * rows :][:rows]
        losses: list[torch.Tensor] = []
        schedule.step(mine[:, :-1], target=mine[:, 1:], losses=losses)
        optim.step()
        optim.zero_grad()
        want = replica(tokens[:, :-1], tokens[:, 1:])
        want.backward()
        replica_optim.step()
        replica_optim.zero_grad()
        if losses:  # the last stage: its micro-batches' mean, averaged over dp
            loss = torch.stack(losses).mean()
            dist.all_reduce(loss, group=dp.get_group())
            loss /= dp.size()
            torch.testing.assert_close(loss, want.detach(), rtol=1e-4, atol=1e-5)
            if dp.get_local_rank() == 0:
                print(f"step {step}: loss {loss.item():.4f}", flush=True)

    mine_params = {n: p.full_tensor() for n, p in stage_module.named_parameters()}
    theirs = dict(replica.named_parameters())
    for name, value in mine_params.items():
        torch.testing.assert_close(value, theirs[name].detach(), rtol=1e-4, atol=1e-5)
    dist.barrier()
    if dist.get_rank() == 0:
        print("pipeline stages trained like the unsharded model", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
