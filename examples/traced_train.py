"""The traced mode: the whole model in one compiled graph, all-gathers and reduce-scatters in it.

    torchrun --nproc-per-node 2 examples/traced_train.py --backend aot_eager

Each Llama block and then the root is sharded with ``fsdp2.traced.fully_shard_traced`` and the
model compiled whole with ``torch.compile(fullgraph=True)``: the forward graph all-gathers each
parameter, the backward graph reduce-scatters its gradient, and no Python hook runs per block.
The script trains a few steps beside the same model under eager ``fsdp2.fully_shard`` on the
same data and checks that losses and weights agree and that the graphs hold the collectives.
``--backend aot_eager`` (what CI runs) traces and partitions the graphs as inductor does but
runs them with eager kernels; leave it out for inductor (the first step then compiles C++ or
Triton kernels: tens of seconds on a CPU).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.models import Llama, LlamaConfig
from fsdp2.traced import fully_shard_traced

STEPS = 4


def build() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=32))


class CountCollectives:
    """A ``torch.compile`` backend: counts the collectives in each graph it is given, then
    hands the graph to ``backend``."""

    def __init__(self, backend: str) -> None:
        self.backend, self.collectives = backend, 0

    def __call__(self, gm: torch.fx.GraphModule, example: list[torch.Tensor]) -> object:
        from torch._dynamo import lookup_backend

        for sub in gm.modules():  # the gathers' forward and backward are subgraphs
            if isinstance(sub, torch.fx.GraphModule):
                ops = [str(n.target) for n in sub.graph.nodes]
                self.collectives += sum("c10d_functional" in t and "wait" not in t for t in ops)
        return lookup_backend(self.backend)(gm, example)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="inductor", help="torch.compile's backend")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    model = build()
    for block in model.layers:
        fully_shard_traced(block, mesh=mesh)
    fully_shard_traced(model, mesh=mesh)
    counted = CountCollectives(args.backend)
    compiled = torch.compile(model, backend=counted, fullgraph=True)

    eager = build()
    for block in eager.layers:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(eager, mesh=mesh)

    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, eager)]
    g = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        tokens = torch.randint(0, 256, (2, 33), generator=g)
        losses = []
        for run, opt in zip((compiled, eager), opts, strict=True):
            loss = run(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
        if rank == 0:
            print(f"step {step}: loss {losses[0]:.5f} (traced), {losses[1]:.5f} (eager)")

    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=1e-3, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip
    assert counted.collectives > 0, "no collective in the compiled graphs"
    if rank == 0:
        print(f"{counted.collectives} collectives in the compiled graphs")
        print("the traced mode trained like eager fully_shard")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
