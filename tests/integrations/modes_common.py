"""What the tests of fsdp2's modes through the frameworks (``test_modes_*.py``) share: the
global batch, the plain-script run each framework run is held to, and the comparison.

A step's global batch is ``M`` micro-batches of ``SEQS`` sequences; on ``W`` data-parallel
ranks each rank takes ``k = M / W`` consecutive ones (rank ``r`` the micro-batches ``r*k`` to
``r*k + k - 1``), accumulating all but the last without gradient sync, each micro-batch's loss
divided by ``k`` (the usual loop, what the frameworks do), the gradients clipped to
``MAX_NORM`` before the optimizer step. ``plain`` is that loop in a script of its own, on
fsdp2 with the mode set by hand: the frameworks' runs must equal it bitwise (the mode's own
numbers), and for the deterministic mode at every world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from frameworks_common import VOCAB, tiny_llama
from models import full_params

M = 4  # micro-batches per optimizer step (the global batch)
SEQS, SEQ = 2, 16  # sequences per micro-batch, tokens per sequence
STEPS = 2  # optimizer steps
MAX_NORM = 0.5  # below the tiny Llama's gradient norms here: clipping acts


def micro_batch(step: int, i: int) -> torch.Tensor:
    """Micro-batch ``i`` of step ``step``'s global batch (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 * step + i)
    return torch.randint(0, VOCAB, (SEQS, SEQ), generator=g)


def mine(step: int, dp_rank: int, dp_world: int) -> list[tuple[int, torch.Tensor]]:
    """This data-parallel rank's micro-batches of step ``step``: ``(global index, tokens)``."""
    k = M // dp_world
    return [(i, micro_batch(step, i)) for i in range(dp_rank * k, dp_rank * k + k)]


def gather_losses(losses: dict[int, float]) -> list[float]:
    """Every rank's per-micro-batch losses, by global index (each written by one rank)."""
    t = torch.zeros(M * STEPS, dtype=torch.float64)
    for i, v in losses.items():
        t[i] = v
    dist.all_reduce(t)
    return t.tolist()


def as_float(norm: Any) -> float:
    """A norm a clipping function returned (a DTensor from torch's over DTensors)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def result(losses: dict[int, float], model: nn.Module, norms: list[float]) -> dict[str, Any]:
    return {"losses": gather_losses(losses), "params": full_params(model), "norms": norms}


def plain(mode: str, mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    """The loop in a plain script, on fsdp2 with ``mode`` set by hand: ``"deterministic"``,
    ``"wire"`` (bf16) or ``"shard_over_replicas"`` (needs an HSDP ``mesh_shape``)."""
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2
    from fsdp2 import reduction
    from fsdp2.replica_optim import shard_over_replicas

    names = ("dp_replicate", "dp_shard") if len(mesh_shape) == 2 else ("dp_shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = tiny_llama()
    for layer in model.model.layers:
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    if mode == "deterministic":
        reduction.set_deterministic(model)
    elif mode == "wire":
        reduction.set_exchange_reduce(model, torch.bfloat16)
    opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if mode == "shard_over_replicas":
        opt = shard_over_replicas(opt)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses: dict[int, float] = {}
    norms = []
    for step in range(STEPS):
        batch = mine(step, rank, world)
        for j, (i, ids) in enumerate(batch):
            model.set_requires_gradient_sync(j == len(batch) - 1)
            loss = model(input_ids=ids, labels=ids).loss
            (loss / len(batch)).backward()
            losses[step * M + i] = loss.item()
        exact = mode == "deterministic"
        clip = reduction.clip_grad_norm_ if exact else torch.nn.utils.clip_grad_norm_
        norms.append(as_float(clip(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return result(losses, model, norms)


def check_same(ours: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """Bitwise: every micro-batch's loss, every step's gradient norm, every parameter."""
    assert ours["losses"] == want["losses"], f"{what}: losses {ours['losses']} vs {want['losses']}"
    assert ours["norms"] == want["norms"], f"{what}: norms {ours['norms']} vs {want['norms']}"
    assert want["norms"][0] > MAX_NORM, f"{what}: clipping did not act"
    for name, p in want["params"].items():
        assert torch.equal(ours["params"][name], p), f"{what}: {name}"
