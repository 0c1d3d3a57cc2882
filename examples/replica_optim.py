"""HSDP with the optimizer state sharded over the replicas: the same training, half the state.

    torchrun --nproc-per-node 4 examples/replica_optim.py

Four ranks form an HSDP mesh of 2 replicas of 2 shards. The same Llama trains twice from the
same initialization on the same batches: with AdamW as usual (each rank holds its shard's
gradient and AdamW state whole), and with AdamW wrapped by
``fsdp2.replica_optim.shard_over_replicas`` (each rank holds half of its shard's gradient and
state; the replicas' halves are all-gathered after each step). The script checks that the
losses and weights agree (to the last bits, which the clipping's norm may round otherwise)
and prints what each rank holds.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.models import Llama, LlamaConfig
from fsdp2.replica_optim import shard_over_replicas

STEPS = 3


def train(mesh, pieces: bool):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=32))
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if pieces:
        opt = shard_over_replicas(opt)  # in place of opt, from here on

    rank = dist.get_rank()
    losses = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 256, (dist.get_world_size(), 2, 33), generator=gen)[rank]
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        norm = (
            opt.clip_grad_norm_(1.0) if pieces else fsdp2.clip_grad_norm_(model.parameters(), 1.0)
        )
        opt.step()
        opt.zero_grad()
        losses.append((loss.item(), norm.item()))
    local = [getattr(v, "_local_tensor", v) for s in opt.state.values() for v in s.values()]
    state = sum(t.numel() for t in local if t.dim() > 0)  # this rank's elements
    weights = {n: p.full_tensor() for n, p in model.named_parameters()}
    return losses, weights, state


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    plain = train(mesh, pieces=False)
    ours = train(mesh, pieces=True)
    # the gradient norm is summed in another order (over pieces), so the clipped steps may
    # differ in the last bits; the gradients and AdamW's update are HSDP's bit for bit
    torch.testing.assert_close(ours[0], plain[0], rtol=1e-6, atol=0)
    for name, w in plain[1].items():
        torch.testing.assert_close(ours[1][name], w, rtol=1e-6, atol=1e-7)
    if dist.get_rank() == 0:
        for step, (loss, norm) in enumerate(ours[0]):
            print(f"step {step}: loss {loss:.5f}, gradient norm {norm:.5f}")
        print(f"AdamW state on rank 0: {plain[2]} elements on HSDP, {ours[2]} over the replicas")
        print("the optimizer sharded over the replicas trained like plain HSDP")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
