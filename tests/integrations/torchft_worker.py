"""One rank of one torchft replica group, for tests/integrations/test_torchft.py (a script,
not a test module): ``fully_shard`` over the group's own ranks, ``torchft.Manager`` across
the groups, a few steps of a tiny Llama (or an EP + FSDP MoE), one JSON line per step on
stdout: the step, the loss, the quorum's participants, and a digest of this rank's shards.

Environment (as ``torchrun`` sets it inside a group): ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``; and ``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torchft import Manager
from torchft.checkpointing.pg_transport import PGTransport
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

from fsdp2.integrations.torchft import wire
from fsdp2.models import Llama, LlamaConfig, MoEConfig, MoETransformer


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--engine", choices=("fsdp2", "torch"), default="fsdp2")
    ap.add_argument("--model", choices=("llama", "moe"), default="llama")
    ap.add_argument("--transport", choices=("http", "pg"), default="http")
    ap.add_argument("--sync-quorum", action="store_true", help="use_async_quorum=False")
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds after each step")
    ap.add_argument("--stop-file", default=None, help="stop early once this file exists")
    ap.add_argument("--local-sgd", type=int, default=0, help="LocalSGD, syncing every N steps")
    return ap.parse_args()


def _model(kind: str, engine: str) -> torch.nn.Module:
    world = dist.get_world_size()
    if engine == "fsdp2":
        from fsdp2 import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)  # every group and rank builds the same model
    if kind == "llama":
        model: Any = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4))
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from fsdp2.models import apply_expert_parallel, parallelize_moe

    model = MoETransformer(MoEConfig())
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("efsdp", "ep"))
    apply_expert_parallel(model, mesh["ep"])
    return parallelize_moe(
        model,
        fully_shard=fully_shard,
        dp_mesh=mesh._flatten("dp"),
        efsdp_mesh=mesh["efsdp"],
        ep_degree=world,
    )


def _wire_torch(
    manager: Manager, model: torch.nn.Module, optim: torch.optim.Optimizer, hook: bool
) -> None:
    """What torchft's own FSDP test does with torch's FSDP2 (the hook), and the same state
    as fsdp2's ``wire``: the local shards of the parameters and of the optimizer state."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if hook and isinstance(m, FSDPModule):
            m.set_all_reduce_hook(lambda t: manager.allreduce(t).wait())
    params = list(model.parameters())

    def state_dict() -> dict[str, Any]:
        # Read from torchft's quorum thread: with the asynchronous quorum, during a forward,
        # where torch's FSDP2 has the unsharded parameters registered (not DTensors):
        # then this fails, and the heal with it. Use the synchronous quorum with torch.
        return {
            "params": {n: p.to_local() for n, p in model.named_parameters()},
            "optim": {
                i: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in st.items()}
                for i, st in enumerate(optim.state[p] for p in params)
            },
        }

    def load(state: dict[str, Any]) -> None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.to_local().copy_(state["params"][n])
            for i, p in enumerate(params):
                st = optim.state[p]
                for k, v in state["optim"][i].items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        v = DTensor.from_local(
                            v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                        )
                    st[k] = v.clone() if isinstance(v, torch.Tensor) else v

    manager.register_state_dict_fn("torch", load, state_dict)


def _tokens(step: int, group: int, rank: int) -> torch.Tensor:
    """This step's batch of one rank of one group (every group and rank its own)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * group + rank)
    return torch.randint(0, 64, (2, 17), generator=g)


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        local = p._local_tensor if isinstance(p, DTensor) else p
        h.update(name.encode())
        h.update(local.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _local_sgd(
    args: argparse.Namespace,
    manager: Manager,
    model: torch.nn.Module,
    inner: torch.optim.Optimizer,
    scale: int,
    group: int,
    rank: int,
) -> None:
    """torchft's LocalSGD: local steps, the parameters averaged every ``--local-sgd``."""
    from torchft.local_sgd import LocalSGD

    if args.engine == "fsdp2":
        wire(manager, model, inner, average_gradients=False)
    else:
        _wire_torch(manager, model, inner, hook=False)
    local = 0
    with LocalSGD(manager, model, inner, sync_every=args.local_sgd):
        while manager.current_step() < args.steps:
            tokens = _tokens(local, group, rank)
            inner.zero_grad()
            loss = model(tokens[:, :-1], tokens[:, 1:])
            (loss / scale).backward()
            inner.step()  # every --local-sgd steps: the parameters averaged over the groups
            local += 1
            _report(group, rank, local, manager, loss, model)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def _report(
    group: int, rank: int, step: int, manager: Manager, loss: torch.Tensor, model: Any
) -> None:
    line = {
        "group": group,
        "rank": rank,
        "step": step,
        "after": manager.current_step(),
        "loss": float(loss.detach()),
        "participants": manager.num_participants(),
        "digest": _digest(model),
        "t": time.time(),
    }
    print(json.dumps(line), flush=True)


def main() -> None:
    args = _args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = int(os.environ["REPLICA_GROUP_ID"])
    model = _model(args.model, args.engine)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scale = world if args.model == "moe" else 1
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    transport = None
    if args.transport == "pg":
        # the manager's own process group, which it configures at every quorum
        transport = PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu"))
    manager = Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=args.min_replicas,
        use_async_quorum=not args.sync_quorum,
        replica_id=f"group{group}",
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
        checkpoint_transport=transport,
    )
    if args.local_sgd:
        _local_sgd(args, manager, model, inner, scale, group, rank)
        return
    if args.engine == "fsdp2":
        wire(manager, model, inner)  # fsdp2.integrations.torchft
    else:
        _wire_torch(manager, model, inner, hook=True)
    optim = OptimizerWrapper(manager, inner)  # zero_grad starts the quorum, step commits
    while manager.current_step() < args.steps:
        step = manager.current_step()
        tokens = _tokens(step, group, rank)
        optim.zero_grad()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        (loss / scale).backward()  # scale: 1, or the MoE's (see parallelize_moe)
        optim.step()  # skipped when the step cannot be committed
        _report(group, rank, step, manager, loss, model)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if args.stop_file and os.path.exists(args.stop_file):
            break
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
    # Exit without the interpreter's last collections over everything torch, torchft and the
    # model left (measured: a job's exit, 4 processes on 2 cores, 2.6 s -> 0.6 s). The output
    # is flushed and the groups destroyed; atexit handlers (fsdp2's exit drain) still run.
    gc.freeze()
