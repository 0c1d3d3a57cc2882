"""Gradients sent in bf16, summed in fp32: half the reduce-scatter bytes of an fp32 reduce.

    torchrun --nproc-per-node 2 examples/low_precision_wire.py

A Llama trains with bf16 compute and fp32 gradient reduction (``reduce_dtype``) twice, on the
same data: once with the usual reduce-scatter, once with ``set_exchange_reduce(model,
torch.bfloat16)``, which sends each rank's gradient slices in bf16 (``all_to_all_single``)
and sums them in fp32 where they land. The script checks that the two runs' losses agree
to bf16's precision and that the wire carried half the bytes.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.models import Llama, LlamaConfig
from fsdp2.reduction import set_exchange_reduce

STEPS = 4


def build(mesh: object) -> Llama:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, max_seq_len=64))
    mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh, mp_policy=mp)
    fsdp2.fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    plain, wired = build(mesh), build(mesh)
    comm = set_exchange_reduce(wired, torch.bfloat16)  # every fully_shard module of it

    optims = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, wired)]
    gen = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        tokens = torch.randint(0, 256, (4, 33), generator=gen)
        losses = []
        for m, opt in zip((plain, wired), optims, strict=True):
            loss = m(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if rank == 0:
            print(f"step {step}: loss {losses[1]:.5f} (fp32 reduce-scatter {losses[0]:.5f})")
        assert abs(losses[0] - losses[1]) < 2e-2 * abs(losses[0]), losses

    # fp32 would have sent 4 bytes per gradient element; the wire sent 2
    elements = sum(p.numel() for p in wired.parameters())  # unsharded: every rank's rows
    per_step = comm.bytes_sent / STEPS
    if rank == 0:
        print(f"bytes sent per step: {per_step:,.0f} ({per_step / elements:.2f} per element)")
    assert per_step <= 2 * elements * 1.01, (per_step, elements)  # padding rows at most
    if rank == 0:
        print("the bf16 wire trained like the fp32 reduce-scatter, at half its bytes")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
