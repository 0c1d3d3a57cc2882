"""Bucketed collectives (``FSDPModule.set_bucket_bytes``, fsdp2 only): consecutive groups
all-gathered in one collective and reduced in one reduce-scatter, within a byte budget.

* Numbers: a bucketed fsdp2 model trains (3 AdamW steps; the first forward has no recorded
  order, so buckets start with its backward) exactly like torch's ``fully_shard`` (bitwise,
  every loss, gradient and parameter) and like an unsharded reference, on 2 ranks with
  budgets that bucket everything, about two groups, or nothing, for MLP / transformer /
  residual models; with ``reshard_after_forward=False`` and ``=2`` (4 ranks, those groups
  gather alone), bf16 mixed precision, HSDP 2x2, CPU offload, explicit prefetch lists, and
  gradient accumulation without sync; and FSDP + TP on a (2, 2) mesh (both TP plans).
* Counts: ``MLPStack`` with a head (4 groups) on 2 ranks, budget large: after the first step
  each step issues 1 all-gather in forward, 1 in backward and 1 reduce-scatter, where the
  default issues 4, 3 and 4; no collective's unsharded output (all-gather) or input
  (reduce-scatter) exceeds the budget unless a single group does; ``set_bucket_bytes(None)``
  restores the per-group counts.
* Errors: a non-int or non-positive budget raises ``TypeError`` / ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from comm_counter import Call, CommCounter, count_calls, shard_numel
from helpers import (
    ENGINES,
    expect_raises,
    hsdp_mesh,
    mine,
    set_all,
    train_and_compare,
    world_mesh,
)
from models import build, local_loss, make_batch, shard_model
from tp_models import build_tp_model, dp_rank_and_size, make_meshes, parallelize, tp_batch, tp_loss

import fsdp2

ALL, TINY = 1 << 30, 1
TWO = "two"  # the bytes of the two largest groups: buckets of about two groups


def _budget(model: nn.Module, budget: int | str) -> int:
    if budget != TWO:
        return int(budget)
    sizes = sorted(
        sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
        + sum(
            p.numel() * p.element_size()
            for c in m.children()
            if not isinstance(c, fsdp2.FSDPModule)
            for p in c.parameters()
        )
        for m in model.modules()
        if isinstance(m, fsdp2.FSDPModule)
    )
    return sizes[-1] + sizes[-2]


def _train(
    name: str,
    budget: int | str,
    mesh_shape: tuple[int, ...] = (),
    torch_too: bool = True,
    set_prefetch: bool = False,
    accumulate: bool = False,
    **kw: Any,
) -> None:
    mesh = hsdp_mesh(mesh_shape) if len(mesh_shape) == 2 else world_mesh()  # type: ignore[arg-type]
    ref = build(name)
    root_kw = {k: v for k, v in kw.items() if k != "reshard_after_forward"}
    if "mp_policy" in kw:  # a float32 loss, as the reference's
        root_kw["mp_policy"] = ROOT_BF16
    models = {"fsdp2": shard_model(build(name), fsdp2.fully_shard, mesh, root_kwargs=root_kw, **kw)}
    if torch_too:
        models["torch"] = shard_model(
            build(name), ENGINES["torch"], mesh, root_kwargs=root_kw, **kw
        )
    ours = models["fsdp2"]
    ours.set_bucket_bytes(_budget(ours, budget))
    if set_prefetch:
        for m in models.values():
            blocks = list(m.layers)
            m.set_modules_to_forward_prefetch(blocks[:1])
            blocks[-1].set_modules_to_backward_prefetch(blocks[-2:-1])
    rank, size = dist.get_rank(), dist.get_world_size()

    def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not accumulate or model is ref:
            loss = local_loss(model, name, x, y)
            loss.backward()
            return loss
        half = x.size(0) // 2
        set_all(model, "set_requires_gradient_sync", False)
        first = local_loss(model, name, x[:half], y[:half]) / 2
        first.backward()
        set_all(model, "set_requires_gradient_sync", True)
        second = local_loss(model, name, x[half:], y[half:]) / 2
        second.backward()
        return first + second

    train_and_compare(
        ref,
        models,
        batch=lambda step: make_batch(name, step),
        forward_backward=forward_backward,
        data_parallel=(rank, size),
        # bf16: against the fp32 reference loosely; against torch's engine bitwise
        tol={"atol": 5e-2, "rtol": 5e-2} if "mp_policy" in kw else {"atol": 1e-5, "rtol": 1e-5},
    )


@pytest.mark.parametrize("name", ["mlp_head", "transformer", "residual"])
@pytest.mark.parametrize("budget", [ALL, TWO, TINY], ids=["all", "two", "tiny"])
def test_parity(name: str, budget: int | str) -> None:
    run_on_ranks(2, _train, name, budget)


BF16 = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
ROOT_BF16 = fsdp2.MixedPrecisionPolicy(torch.bfloat16, torch.float32, output_dtype=torch.float32)


def _case(case: str) -> None:
    if case == "keep":
        _train("transformer", TWO, reshard_after_forward=False)
    elif case == "bf16":
        _train("transformer", ALL, mp_policy=BF16)
    elif case == "offload":
        _train("mlp_head", ALL, offload_policy=fsdp2.CPUOffloadPolicy(pin_memory=False))
    elif case == "prefetch_lists":
        _train("transformer", TWO, set_prefetch=True)
    elif case == "accumulate":
        _train("transformer", ALL, torch_too=False, accumulate=True)
    elif case == "hsdp":
        _train("transformer", TWO, mesh_shape=(2, 2))
    elif case == "raf2":
        _train("transformer", ALL, reshard_after_forward=2)


@pytest.mark.parametrize(
    "case, world_size",
    [
        ("keep", 2),
        ("bf16", 2),
        ("offload", 2),
        ("prefetch_lists", 2),
        ("accumulate", 2),
        ("hsdp", 4),
        ("raf2", 4),
    ],
)
def test_settings(case: str, world_size: int) -> None:
    run_on_ranks(world_size, _case, case)


def _tensor_parallel(plan: str) -> None:
    """FSDP + TP on a (2, 2) mesh: groups of TP-sharded parameters share buckets."""
    mesh, dp_mesh, tp_mesh = make_meshes("fsdp2x2")
    ref = build_tp_model()
    models = {
        engine: shard_model(parallelize(build_tp_model(), tp_mesh, plan), fn, dp_mesh)
        for engine, fn in ENGINES.items()
    }
    models["fsdp2"].set_bucket_bytes(ALL)
    train_and_compare(
        ref, models, batch=tp_batch, loss=tp_loss, data_parallel=dp_rank_and_size(mesh)
    )


@pytest.mark.parametrize("plan", ["tp", "tp_sp"])
def test_tensor_parallel(plan: str) -> None:
    run_on_ranks(4, _tensor_parallel, plan)


def _counts() -> None:
    name, ws = "mlp_head", dist.get_world_size()
    model = shard_model(build(name), fsdp2.fully_shard, world_mesh(), root_kwargs={})
    group_bytes = [  # unsharded, padded as sharded: what one group's collectives move
        ws * shard_numel([p for p in m.parameters() if _owner(model, p) is m], ws) * 4
        for m in model.modules()
        if isinstance(m, fsdp2.FSDPModule)
    ]

    def steps(n: int) -> list[list[Call]]:
        out = []
        with CommCounter() as counter:
            for step in range(n):
                x, y = make_batch(name, step)
                counter.phase = "forward"
                loss = local_loss(model, name, mine(x), mine(y))
                counter.phase = "backward"
                loss.backward()
                model.zero_grad()
                out.append(counter.take_calls())
        return out

    def summary(calls: list[Call]) -> dict[tuple[Any, ...], int]:
        return count_calls(calls, "phase", "kind")

    default = {("forward", "AG"): 4, ("backward", "AG"): 3, ("backward", "RS"): 4}
    assert summary(steps(2)[1]) == default
    for budget in (ALL, max(group_bytes) + 1):
        model.set_bucket_bytes(budget)
        seen = steps(3)
        if budget == ALL:
            want = {("forward", "AG"): 1, ("backward", "AG"): 1, ("backward", "RS"): 1}
            assert summary(seen[1]) == want == summary(seen[2]), [summary(s) for s in seen]
        for calls in seen:
            for c in calls:
                unsharded_bytes = c.numel * 4 * (ws if c.kind == "AG" else 1)
                assert unsharded_bytes <= max(budget, *group_bytes), (budget, group_bytes, c)
        if budget != ALL:
            assert len(seen[2]) < sum(default.values()), summary(seen[2])
    model.set_bucket_bytes(None)
    assert summary(steps(2)[1]) == default


def _owner(model: nn.Module, param: torch.Tensor) -> nn.Module:
    """The closest ``fully_shard`` module above ``param``."""
    owner = model
    for m in model.modules():
        if isinstance(m, fsdp2.FSDPModule) and any(p is param for p in m.parameters()):
            owner = m  # modules() goes top-down: the last match is the innermost
    return owner


def test_counts_and_budget() -> None:
    run_on_ranks(2, _counts)


def _errors() -> None:
    model = shard_model(build("mlp"), fsdp2.fully_shard, world_mesh(), root_kwargs={})
    for bad, exc in ((1.5, TypeError), (True, TypeError), ("1", TypeError), (0, ValueError)):
        with expect_raises(f"set_bucket_bytes({bad!r})", exc, match="max_bytes"):
            model.set_bucket_bytes(bad)  # type: ignore[arg-type]


def test_errors() -> None:
    run_on_ranks(1, _errors)
