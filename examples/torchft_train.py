"""fsdp2 under torchft: replica groups that survive each other's failures.

    torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 \\
        --heartbeat_timeout_ms 1000
    # one torchrun per replica group, each in its own shell:
    TORCHFT_LIGHTHOUSE=http://localhost:29510 REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 \\
        torchrun --standalone --nproc_per_node 2 examples/torchft_train.py
    TORCHFT_LIGHTHOUSE=http://localhost:29510 REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 \\
        torchrun --standalone --nproc_per_node 2 examples/torchft_train.py

Each replica group (one ``torchrun``) shards a small Llama with ``fsdp2.fully_shard`` over its
own ranks. A ``torchft.Manager`` per rank agrees on a quorum of groups with the lighthouse at
every step, and ``fsdp2.integrations.torchft.wire`` averages the gradient shards over the
groups in the quorum and registers the state a restarted group heals from. Stop one group
(Ctrl-C in its shell; ``--sleep 0.5`` leaves time for it) and the other goes on alone; start
it again with the same command and it heals from the survivor and rejoins. See
docs/fault_tolerance.md.

Rank 0 of each group prints ``step N: loss X (replica groups: G)`` after every step (N: the
steps the job has committed; G: the groups whose gradients the step averaged), a line when
the group healed from a live one, and at the end a digest of the trained parameters: the
groups that finish together print the same one.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torchft import Manager
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

import fsdp2
from fsdp2.integrations.torchft import wire
from fsdp2.models import Llama, LlamaConfig

VOCAB = 64
SEQ_LEN = 32
BATCH = 4  # sequences per rank and step


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="steps to train (committed ones)")
    ap.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        help="the fewest replica groups a step commits with (torchft's min_replica_size)",
    )
    ap.add_argument(
        "--replica-group-id",
        type=int,
        default=int(os.environ.get("REPLICA_GROUP_ID", "0")),
        help="this group's id, 0.. (default: $REPLICA_GROUP_ID, else 0)",
    )
    ap.add_argument(
        "--num-replica-groups",
        type=int,
        default=int(os.environ.get("NUM_REPLICA_GROUPS", "2")),
        help="groups the data is split over (default: $NUM_REPLICA_GROUPS, else 2)",
    )
    ap.add_argument(
        "--lighthouse",
        default=os.environ.get("TORCHFT_LIGHTHOUSE", "http://localhost:29510"),
        help="the lighthouse's address (default: $TORCHFT_LIGHTHOUSE)",
    )
    ap.add_argument(
        "--sleep",
        type=float,
        default=0.0,
        help="seconds to pause after each step, to watch a group being killed and healing",
    )
    args = ap.parse_args()
    if not 0 <= args.replica_group_id < args.num_replica_groups:
        ap.error(f"--replica-group-id must be in 0..{args.num_replica_groups - 1}")
    return args


def batch(step: int, group: int, groups: int, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of the step's global batch: sequences that count up by a stride
    (learnable), each rank of each group its own."""
    index = (step * groups + group) * world + rank
    g = torch.Generator().manual_seed(index)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ_LEN + 1)) % VOCAB


def digest(model: torch.nn.Module) -> str:
    """A digest of the full parameters (a collective: every rank of the group calls it)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        full = p.full_tensor().detach()
        h.update(name.encode())
        h.update(full.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")  # this group's own ranks (torchrun's environment)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = args.replica_group_id

    # Inside the group: fully_shard over the group's ranks, as without torchft.
    torch.manual_seed(0)  # every group builds the same model
    model = Llama(LlamaConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)

    # Across the groups: a Manager over a process group torchft rebuilds at every quorum
    # (ProcessGroupNCCL on GPUs), wire, and torchft's optimizer wrapper.
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=None,  # wire registers the model's and optimizer's state
        state_dict=None,
        min_replica_size=args.min_replicas,
        replica_id=f"group{group}",
        lighthouse_addr=args.lighthouse,
        timeout=timedelta(seconds=10),
    )
    wire(manager, model, inner)
    optim = OptimizerWrapper(manager, inner)  # zero_grad starts the quorum, step commits

    first = True
    while manager.current_step() < args.steps:
        tokens = batch(manager.current_step(), group, args.num_replica_groups, rank, world)
        optim.zero_grad()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()  # the all-reduce hook averages each gradient shard over the groups
        optim.step()  # skipped when the step cannot be committed (a group died in it)
        step, groups = manager.current_step(), manager.num_participants()
        if rank == 0:
            if first and step > 1:  # started at a live group's step, not at 0
                print(f"healed from a live replica group: joined at step {step}", flush=True)
            print(f"step {step}: loss {loss.item():.4f} (replica groups: {groups})", flush=True)
        first = False
        if args.sleep:
            time.sleep(args.sleep)

    final = digest(model)
    if rank == 0:
        print(
            f"replica group {group}: trained {manager.current_step()} steps with torchft "
            f"replica groups, parameters {final}",
            flush=True,
        )
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
