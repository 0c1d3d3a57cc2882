"""``fsdp2.reduction.set_deterministic``: the same bits at every world size.

One global batch of ``M`` micro-batches per step; on ``W`` ranks each rank takes ``M / W``
consecutive ones and accumulates them with ``set_requires_gradient_sync(False)`` but the
last. With the deterministic reduction the per-micro-batch losses, the full gradients
before each optimizer step, the parameters and AdamW's state after it are bitwise equal on
1, 2 and 4 ranks and on HSDP 2x2 in fp32, and on 1 and 4 ranks and HSDP 2x2 with bf16
compute; with the default reduction (the loss divided by the accumulation steps, averaged
over ranks: the same mathematics) they are not. A rank summing a number of micro-batches that is not a power of two raises
on every rank before any collective.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2.models import Llama, LlamaConfig
from fsdp2.reduction import set_deterministic

CFG = LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, max_seq_len=16)
M = 4  # micro-batches per global batch
STEPS = 3


def _full(t: Any) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(shape: tuple[int, ...], mp: str, deterministic: bool, micro: int = M) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(shape) == 2:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", shape)
    torch.manual_seed(0)
    model = Llama(CFG)
    policy = fsdp2.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if mp == "bf16" else None, reduce_dtype=None
    )
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh, mp_policy=policy)
    fsdp2.fully_shard(model, mesh=mesh, mp_policy=policy)
    if deterministic:
        set_deterministic(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    k = micro // world
    out: dict[str, Any] = {"losses": [], "grads": [], "params": None, "state": None}
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, CFG.vocab_size, (micro, 2, 17), generator=gen)
        mine = torch.zeros(micro)
        for j in range(k):
            i = rank * k + j
            model.set_requires_gradient_sync(j == k - 1)
            loss = model(tokens[i, :, :-1], tokens[i, :, 1:])
            mine[i] = loss.detach().float()
            (loss if deterministic else loss / k).backward()
        dist.all_reduce(mine)  # one rank wrote each entry: exact
        out["losses"].append(mine)
        out["grads"].append({n: _full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    out["params"] = {n: _full(p) for n, p in model.named_parameters()}
    out["state"] = {
        n: {k: _full(v) for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
        for n, p in model.named_parameters()
    }
    return out


def _same(a: dict, b: dict) -> list[str]:
    """What differs between two runs' results (bitwise)."""
    bad = []
    for step, (x, y) in enumerate(zip(a["losses"], b["losses"], strict=True)):
        if not torch.equal(x, y):
            bad.append(f"step {step} losses {x.tolist()} vs {y.tolist()}")
    for step, (x, y) in enumerate(zip(a["grads"], b["grads"], strict=True)):
        bad += [f"step {step} grad {n}" for n in x if not torch.equal(x[n], y[n])]
    bad += [f"param {n}" for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])]
    for n, st in a["state"].items():
        bad += [f"state {n}.{k}" for k in st if not torch.equal(st[k], b["state"][n][k])]
    return bad


MESHES = {"fp32": [(2,), (4,), (2, 2)], "bf16": [(4,), (2, 2)]}  # against 1 rank


@pytest.mark.parametrize("mp", ["fp32", "bf16"])
def test_same_bits_at_world_sizes_1_2_4_and_hsdp(mp: str) -> None:
    one = run_on_ranks(1, _train, (1,), mp, True)[0]
    for shape in MESHES[mp]:
        world, what = shape[0] * (shape[1] if len(shape) == 2 else 1), f"mesh {shape}"
        other = run_on_ranks(world, _train, shape, mp, True)[0]
        bad = _same(one, other)
        assert not bad, f"{mp}, {what} vs 1 rank: {bad[:8]}"


def test_the_default_reduction_differs() -> None:
    """The control: today's reduce (sum order by world size and algorithm) changes the bits."""
    one = run_on_ranks(1, _train, (1,), "fp32", False)[0]
    four = run_on_ranks(4, _train, (4,), "fp32", False)[0]
    assert _same(one, four), "the default reduction gave the same bits at 1 and 4 ranks"


def _three_micro_batches() -> str:
    try:
        _train((2,), "fp32", True, micro=6)  # 3 per rank
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_micro_batches_not_a_power_of_two_raise() -> None:
    for msg in run_on_ranks(2, _three_micro_batches):
        assert "3 micro-batches" in msg and "power of two" in msg, msg
