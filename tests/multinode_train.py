"""HSDP training launched by ``torchrun``: the worker script of ``tests/core/test_multinode.py``.

Usage: ``torchrun ... tests/multinode_train.py OUT_DIR``. Every rank trains a tiny seeded Llama,
each block and the root sharded by ``fsdp2.fully_shard`` over the 2D mesh ``(replicate=2,
shard=2)``, for ``STEPS`` AdamW steps. All ranks draw the same global batch from one seeded
generator and train their data-parallel slice, so the numbers depend only on the world size and
the mesh, not on how the ranks were launched (two torchrun agents or one).

What it writes under ``OUT_DIR``:

- ``rank<R>.json`` (every rank): the torchrun environment it saw (``RANK``, ``LOCAL_RANK``,
  ``GROUP_RANK``, ...), the ``FSDP2_TEST_AGENT`` tag the test gave its agent, and the global
  ranks and ``GROUP_RANK`` s of its shard and replicate groups;
- ``result.json`` (rank 0): the per-step losses averaged over all ranks;
- ``params.pt`` (rank 0): the final full parameters (``full_tensor()``), by name.

It asserts the layout before training: the ranks of a shard group are on one node (one torchrun
agent: the same ``GROUP_RANK``), and when there are several nodes the replicate group crosses
them (one rank per node). A worker exits when its torchrun agent is gone (torchrun starts each
worker in its own session, so killing the agent's process group does not reach them).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from fsdp2 import fully_shard
from fsdp2.models import Llama, LlamaConfig

STEPS = 5
GLOBAL_BATCH = 8  # sequences; 2 per rank on 4 ranks
SEQ_LEN = 16
MESH_SHAPE = (2, 2)  # (replicate, shard)
CONFIG = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=SEQ_LEN)


def _exit_with_agent(agent_pid: int) -> None:
    """Exit once the parent (the torchrun agent) is gone: no orphan left in a collective."""
    while os.getppid() == agent_pid:
        time.sleep(1.0)
    os._exit(1)


def _batch(gen: torch.Generator) -> torch.Tensor:
    """One global batch ``(GLOBAL_BATCH, SEQ_LEN + 1)``: arithmetic sequences mod 256 with a
    random start and stride each, so there is something to learn in a few steps."""
    start = torch.randint(0, 256, (GLOBAL_BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=gen)
    return (start + stride * torch.arange(SEQ_LEN + 1)) % 256


def _layout(mesh: DeviceMesh, group_rank: int, num_nodes: int) -> dict[str, list[int]]:
    """The global ranks and node numbers (``GROUP_RANK``) of this rank's shard and replicate
    groups; asserts that shard groups stay on one node and replicate groups cross nodes."""
    layout: dict[str, list[int]] = {}
    for dim in ("shard", "replicate"):
        group = mesh[dim].get_group()
        nodes: list[int] = [0] * dist.get_world_size(group)
        dist.all_gather_object(nodes, group_rank, group=group)
        layout[f"{dim}_ranks"] = dist.get_process_group_ranks(group)
        layout[f"{dim}_nodes"] = nodes
    rank = dist.get_rank()
    assert layout["shard_nodes"] == [group_rank] * MESH_SHAPE[1], (
        f"rank {rank}: shard group {layout['shard_ranks']} spans nodes {layout['shard_nodes']}"
    )
    if num_nodes > 1:
        assert sorted(layout["replicate_nodes"]) == list(range(num_nodes)), (
            f"rank {rank}: replicate group {layout['replicate_ranks']} is on nodes "
            f"{layout['replicate_nodes']}, want one rank on each of the {num_nodes} nodes"
        )
    return layout


def main(out_dir: str) -> None:
    threading.Thread(target=_exit_with_agent, args=(os.getppid(),), daemon=True).start()
    env = {
        key: int(os.environ[key])
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    }
    # A hung collective fails within a minute instead of gloo's default 30 min.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert (rank, world) == (env["RANK"], env["WORLD_SIZE"]) and world == 4, (rank, world, env)
    num_nodes = world // env["LOCAL_WORLD_SIZE"]
    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=("replicate", "shard"))
    layout = _layout(mesh, env["GROUP_RANK"], num_nodes)
    info = {"env": env, "agent": os.environ.get("FSDP2_TEST_AGENT"), "pid": os.getpid()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({**info, **layout}, f)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = Llama(CONFIG)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)

    gen = torch.Generator().manual_seed(0)  # the same global batches on every rank
    per_rank = GLOBAL_BATCH // world
    losses: list[float] = []
    for _ in range(STEPS):
        tokens = _batch(gen)[rank * per_rank : (rank + 1) * per_rank]
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append((mean / world).item())

    # full_tensor() is a collective: every rank calls it; rank 0 writes.
    params = {name: cast(DTensor, p).full_tensor() for name, p in model.named_parameters()}
    if rank == 0:
        torch.save(params, os.path.join(out_dir, "params.pt"))
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({"losses": losses, "world_size": world, "num_nodes": num_nodes}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: torchrun ... {sys.argv[0]} OUT_DIR")
    main(sys.argv[1])
    # Exit without the interpreter's last collections over everything torch left (about 0.5 s
    # a process, 4 on 2 cores); atexit handlers (fsdp2's exit drain) still run.
    gc.freeze()
