"""Gradient synchronization levers of ``FSDPModule``: microbatch accumulation without sync
(``set_requires_gradient_sync``, ``set_reshard_after_backward``), HSDP (parity, and
``set_requires_all_reduce`` during accumulation), the gradient divide factor (and its
deprecated alias), force-sum reductions and ``set_is_last_backward``.

Each rank function builds, under one seed, a replicated reference trained on the whole global
batch and the model sharded by ``fsdp2.fully_shard`` and by ``torch.distributed.fsdp.
fully_shard``; the sharded models train on their rank's slice. Full gradients (after backward)
and parameters (after the optimizer step) must match the reference in fp32 and each other
(``helpers.check_grads`` / ``check_params`` / ``check_same``). Collectives are counted with
``comm_counter.CommCounter`` or, for the reduce op, a patched ``dist.reduce_scatter_single``.

The model is ``MLPStack((7, 5, 3, 1), head_dim=2)``: 3 blocks and a root holding a head, so 4
groups. Cases run on 2 and 4 gloo ranks; fsdp2-only cases and HSDP meshes other than
``(2, ws // 2)`` run on 2.

Where torch differs: gloo has no ``ReduceOp.PREMUL_SUM``, which torch uses for a gradient
divide factor other than the shard world size, so torch runs with
``set_force_sum_reduction_for_comms(True)`` there.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist
from _harness import run_on_ranks
from comm_counter import CommCounter, count_calls, spy_reduce_scatters
from helpers import (
    ENGINES,
    GROUPS,
    N_BLOCKS,
    NAME,
    WORLD_SIZES,
    assert_all_dtensors,
    check_grads,
    check_params,
    check_same,
    fsdp_modules,
    grads_of,
    hsdp_mesh,
    mine,
    set_all,
    sharded,
    step_all,
    world_mesh,
)
from models import build, local_loss, make_batch, make_optimizer
from torch.distributed.tensor import Replicate, Shard

K = 3  # microbatches per step in the accumulation tests


# ---------------------------------------------------------------------------------------------
# set_requires_gradient_sync / set_reshard_after_backward: microbatch accumulation


def _no_sync(reshard_during_accum: bool) -> None:
    mesh = world_mesh()
    ref = build(NAME)
    models = {engine: sharded(engine, NAME, mesh) for engine in ENGINES}
    params = {e: list(m.parameters()) for e, m in models.items()}  # the DTensors
    ref_opt = make_optimizer("sgd", ref.parameters())
    opts = {e: make_optimizer("sgd", ps) for e, ps in params.items()}
    with CommCounter() as counter:
        for step in range(2):
            x, y = make_batch(NAME, step, 8 * K)
            local_loss(ref, NAME, x, y).backward()
            for engine, model in models.items():
                for i, (xm, ym) in enumerate(zip(x.chunk(K), y.chunk(K), strict=True)):
                    last = i == K - 1
                    model.set_requires_gradient_sync(last)
                    if not reshard_during_accum:
                        model.set_reshard_after_backward(last)
                    counter.phase = "forward"
                    loss = local_loss(model, NAME, mine(xm), mine(ym)) / K
                    counter.phase = "backward"
                    loss.backward()
                    counter.phase = "?"
                    calls = counter.take_calls()
                    gathered = i == 0 or reshard_during_accum
                    want = {("backward", "AG"): N_BLOCKS}
                    if gathered:
                        want[("forward", "AG")] = GROUPS
                    if last:
                        want[("backward", "RS")] = GROUPS
                    what = f"{engine} step {step} microbatch {i}"
                    got = count_calls(calls, "phase", "kind")
                    assert got == want, f"{what}: got {got}, want {want}"
                    assert all(c.group_size == dist.get_world_size() for c in calls), (
                        f"{what}: {calls}"
                    )
                    if not last:  # (kept unsharded params are registered now, with grads)
                        assert all(p.grad is None for p in params[engine]), (
                            f"{what}: a backward without gradient sync landed sharded gradients"
                        )
            seen = check_grads(models, grads_of(ref), f"step {step}")
            check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
            for opt in (ref_opt, *opts.values()):
                opt.step()
                opt.zero_grad()
            check_params(models, ref, f"step {step}")
            for engine, model in models.items():
                assert_all_dtensors(model, f"{engine} step {step}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(
    "reshard_during_accum", [True, False], ids=["reshard_after_backward", "keep_unsharded"]
)
def test_no_sync_microbatches_equal_big_batch(world_size: int, reshard_during_accum: bool) -> None:
    run_on_ranks(world_size, _no_sync, reshard_during_accum)


# ---------------------------------------------------------------------------------------------
# HSDP: parity, and set_requires_all_reduce during accumulation


def _hsdp_cases() -> list:
    return [
        pytest.param(4, (2, 2), id="ws4-mesh2x2"),
        pytest.param(2, (2, 1), id="ws2-mesh2x1"),
        pytest.param(2, (1, 2), id="ws2-mesh1x2"),
    ]


def _hsdp_parity(shape: tuple[int, int], raf: bool) -> None:
    mesh = hsdp_mesh(shape)
    ref = build(NAME)
    models = {engine: sharded(engine, NAME, mesh, reshard_after_forward=raf) for engine in ENGINES}
    for engine, model in models.items():
        for n, p in model.named_parameters():
            assert tuple(p.placements) == (Replicate(), Shard(0)), f"{engine} {n}: {p.placements}"
    ref_opt = make_optimizer("adamw", ref.parameters())
    opts = {e: make_optimizer("adamw", m.parameters()) for e, m in models.items()}
    for step in range(2):
        step_all(models, ref, NAME, step)
        seen = check_grads(models, grads_of(ref), f"step {step}")
        check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
        for opt in (ref_opt, *opts.values()):
            opt.step()
            opt.zero_grad()
        check_params(models, ref, f"step {step}")


@pytest.mark.parametrize("raf", [True, False], ids=["rafTrue", "rafFalse"])
@pytest.mark.parametrize("world_size, shape", _hsdp_cases())
def test_hsdp_parity(world_size: int, shape: tuple[int, int], raf: bool) -> None:
    run_on_ranks(world_size, _hsdp_parity, shape, raf)


def _hsdp_accumulate(shape: tuple[int, int], setter: str) -> None:
    mesh = hsdp_mesh(shape)
    replicate, shard = shape
    ref = build(NAME)
    models = {engine: sharded(engine, NAME, mesh) for engine in ENGINES}
    params = {e: list(m.parameters()) for e, m in models.items()}
    x, y = make_batch(NAME, 0, 8 * K)
    local_loss(ref, NAME, x, y).backward()
    with CommCounter() as counter:
        for engine, model in models.items():
            for i, (xm, ym) in enumerate(zip(x.chunk(K), y.chunk(K), strict=True)):
                last = i == K - 1
                getattr(model, setter)(last)
                counter.phase = "step"
                (local_loss(model, NAME, mine(xm), mine(ym)) / K).backward()
                calls = [c for c in counter.take_calls() if c.kind != "AG"]
                want = Counter()
                # A 1-rank reduce-scatter is a copy, not a collective; without gradient
                # sync nothing is reduced before the last microbatch.
                if shard > 1 and (last or setter == "set_requires_all_reduce"):
                    want[("RS", shard)] = GROUPS
                if last:
                    want[("AR", replicate)] = GROUPS
                got = Counter((c.kind, c.group_size) for c in calls)
                assert got == want, f"{engine} microbatch {i}: got {got}, want {want}"
                if not last:  # (kept unsharded params are registered now, with grads)
                    assert all(p.grad is None for p in params[engine]), (
                        f"{engine} microbatch {i}: gradients landed before the all-reduce"
                    )
    seen = check_grads(models, grads_of(ref), "accumulated")
    check_same(seen["fsdp2"], seen["torch"], "fsdp2 vs torch")


@pytest.mark.parametrize("setter", ["set_requires_all_reduce", "set_requires_gradient_sync"])
@pytest.mark.parametrize("world_size, shape", _hsdp_cases())
def test_hsdp_accumulation_false_then_true(
    world_size: int, shape: tuple[int, int], setter: str
) -> None:
    run_on_ranks(world_size, _hsdp_accumulate, shape, setter)


# ---------------------------------------------------------------------------------------------
# Gradient divide factor, its deprecated alias, force-sum reductions


def _divide_factor(factor: float, hsdp: bool) -> None:
    ws = dist.get_world_size()
    ref = build(NAME)
    mesh = hsdp_mesh((2, ws // 2)) if hsdp else world_mesh()
    models = {engine: sharded(engine, NAME, mesh) for engine in ENGINES}
    for engine, model in models.items():
        set_all(model, "set_gradient_divide_factor", factor)
        if engine == "torch":  # PREMUL_SUM(1 / factor) is not available on gloo
            set_all(model, "set_force_sum_reduction_for_comms", True)
    for step in range(2):
        step_all(models, ref, NAME, step)
        # Each rank's gradient is of its mean loss: the sum over ranks is ws * the average.
        seen = check_grads(models, grads_of(ref, ws / factor), f"step {step}")
        check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
        for model in (ref, *models.values()):
            model.zero_grad()


@pytest.mark.parametrize("factor", [1.0, 3.0])
@pytest.mark.parametrize(
    "world_size, hsdp",
    [
        pytest.param(2, False, id="ws2-fsdp"),
        pytest.param(4, False, id="ws4-fsdp"),
        pytest.param(4, True, id="ws4-hsdp2x2"),
    ],
)
def test_gradient_divide_factor(world_size: int, hsdp: bool, factor: float) -> None:
    run_on_ranks(world_size, _divide_factor, factor, hsdp)


def _deprecated_alias() -> None:
    ws = dist.get_world_size()
    ref = build(NAME)
    model = sharded("fsdp2", NAME)
    for m in fsdp_modules(model):
        with pytest.warns(FutureWarning, match="set_gradient_divide_factor"):
            m.set_reduce_scatter_divide_factor(1.0)
    with pytest.raises(ValueError):
        model.set_gradient_divide_factor(0.0)
    step_all({"fsdp2": model}, ref, NAME, 0)
    check_grads({"fsdp2": model}, grads_of(ref, float(ws)), "alias")


@pytest.mark.parametrize("world_size", [2])
def test_reduce_scatter_divide_factor_alias_warns(world_size: int) -> None:
    run_on_ranks(world_size, _deprecated_alias)


@contextlib.contextmanager
def _reduce_scatter_ops() -> Iterator[list[Any]]:
    """Record the ``op`` of every reduce-scatter in the block (``spy_reduce_scatters``)."""
    ops: list[Any] = []
    with spy_reduce_scatters(lambda t, op, group: ops.append(op)):
        yield ops


def _force_sum() -> None:
    ref = build(NAME)
    models = {
        "fsdp2-default": sharded("fsdp2", NAME),
        "fsdp2": sharded("fsdp2", NAME),
        "torch": sharded("torch", NAME),
    }
    for engine in ("fsdp2", "torch"):
        set_all(models[engine], "set_force_sum_reduction_for_comms", True)
    ops = {}
    x, y = make_batch(NAME, 0)
    local_loss(ref, NAME, x, y).backward()
    for engine, model in models.items():
        with _reduce_scatter_ops() as seen_ops:
            local_loss(model, NAME, mine(x), mine(y)).backward()
        ops[engine] = seen_ops
    avg, sum_ = dist.ReduceOp.AVG, dist.ReduceOp.SUM
    for engine, want_op in (("fsdp2-default", avg), ("fsdp2", sum_), ("torch", sum_)):
        assert len(ops[engine]) == GROUPS, f"{engine}: {ops[engine]}"
        assert all(op == want_op for op in ops[engine]), f"{engine}: {ops[engine]}, want {want_op}"
    seen = check_grads(models, grads_of(ref), "force sum")
    check_same(seen["fsdp2"], seen["fsdp2-default"], "force sum vs default")
    check_same(seen["fsdp2"], seen["torch"], "fsdp2 vs torch")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_force_sum_reduction_for_comms(world_size: int) -> None:
    run_on_ranks(world_size, _force_sum)


# ---------------------------------------------------------------------------------------------
# set_is_last_backward


def _is_last_backward_false() -> None:
    # fsdp2 documents that every backward finishes its reductions anyway.
    ref = build(NAME)
    model = sharded("fsdp2", NAME)
    model.set_is_last_backward(False)
    step_all({"fsdp2": model}, ref, NAME, 0)
    check_grads({"fsdp2": model}, grads_of(ref), "is_last_backward=False")
    assert_all_dtensors(model, "after backward")


@pytest.mark.parametrize("world_size", [2])
def test_set_is_last_backward_false_accepted(world_size: int) -> None:
    run_on_ranks(world_size, _is_last_backward_false)
