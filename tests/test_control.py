"""The ``FSDPModule`` levers: every run-time setter, the extra ``fully_shard`` arguments and
the helper functions, each checked for its numbers and for the communication it promises.

Each rank function builds, under one seed, a replicated reference (trained on the whole
global batch, or for per-rank behaviour a replica on the rank's slice, averaged by hand)
and the model sharded by ``fsdp2.fully_shard`` and, where torch 2.13 has the feature and
gloo can run it, by ``torch.distributed.fsdp.fully_shard``; the sharded models train on
their rank's slice. Full gradients (after backward) and parameters (after the optimizer
step) must match the reference in fp32 and, where both engines ran, each other.
Collectives are counted with ``CommCounter`` from ``test_comm_counts`` (``torch.distributed``
functions patched for the ``with`` block only) or, for the reduce op, a patched
``dist.reduce_scatter_single``.

The default model is ``MLPStack((7, 5, 3, 1), head_dim=2)``: 3 blocks and a root holding a
head, so 4 groups whose per-rank all-gather sizes differ (a recorded collective names its
group by its size). Cases run on 2 and 4 gloo ranks; error-only cases and HSDP meshes other
than ``(2, ws // 2)`` run on 2.

Where torch is left out, and why: gloo has no ``ReduceOp.PREMUL_SUM``, which torch uses for
a gradient divide factor other than the shard world size, so torch runs with
``set_force_sum_reduction_for_comms(True)`` there; torch's ``reset_iter_state`` keeps
gradients computed before the failure except when forward failed, so only that case
compares it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from models import (
    MLPBlock,
    MLPStack,
    build,
    full_grads,
    full_params,
    local_loss,
    make_batch,
    make_optimizer,
    mean_over_ranks,
    rank_slice,
    shard_model,
)
from test_comm_counts import Call, CommCounter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import register_fsdp_forward_method as torch_register_method
from torch.distributed.fsdp import share_comm_ctx as torch_share_comm_ctx
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

import fsdp2

WORLD_SIZES = [2, 4]
ENGINES = {"fsdp2": fsdp2.fully_shard, "torch": torch_fully_shard}
FSDP_CLASSES = (fsdp2.FSDPModule, TorchFSDPModule)
TOL = {"atol": 1e-5, "rtol": 1e-5}
NAME = "mlp_head"
N_BLOCKS = 3
GROUPS = N_BLOCKS + 1  # the blocks and the root's head
K = 3  # microbatches per step in the accumulation tests


# ---------------------------------------------------------------------------------------------
# Helpers


def _ws() -> int:
    return dist.get_world_size()


def _mesh() -> Any:
    return init_device_mesh("cpu", (_ws(),))


def _hsdp_mesh(shape: tuple[int, int]) -> Any:
    """A (replicate, shard) mesh; build it only in a ``_fresh_dtensor_cache`` function."""
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _fresh_dtensor_cache(fn: Callable[..., None]) -> Callable[..., None]:
    """Clear DTensor's sharding-propagation cache around a rank function that builds meshes
    with subgroups. The cache keys on mesh equality, which ignores process groups: an equal
    mesh from an earlier task, whose groups the harness destroyed, would come back in output
    specs ("Could not resolve the process group registered under the name ...")."""

    @functools.wraps(fn)
    def run(*args: Any) -> None:
        _clear_sharding_prop_cache()
        try:
            fn(*args)
        finally:
            _clear_sharding_prop_cache()

    return run


def _mine(t: torch.Tensor) -> torch.Tensor:
    return rank_slice(t, dist.get_rank(), _ws())


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, FSDP_CLASSES)]


def _sharded(engine: str, mesh: Any = None, name: str = NAME, **kw: Any) -> nn.Module:
    """``build(name)`` with every block sharded with ``kw`` and the root with the defaults."""
    mesh = _mesh() if mesh is None else mesh
    return shard_model(build(name), ENGINES[engine], mesh, root_kwargs={}, **kw)


def _check_close(got: torch.Tensor | None, want: torch.Tensor | None, what: str) -> None:
    assert (got is None) == (want is None), f"{what}: got {got}, want {want}"
    if got is not None:
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


def _grads_of(model: nn.Module, scale: float = 1.0) -> dict[str, torch.Tensor | None]:
    """Plain (reference) gradients by name, times ``scale``."""
    return {
        n: None if p.grad is None else p.grad.detach() * scale for n, p in model.named_parameters()
    }


def _check_grads(
    models: dict[str, nn.Module], want: dict[str, torch.Tensor | None], what: str
) -> dict[str, dict[str, torch.Tensor | None]]:
    """Full gradients of every sharded model against ``want`` (collective); returns them."""
    seen = {}
    for engine, model in models.items():
        grads = full_grads(model)
        assert grads.keys() == want.keys(), f"{engine}: names {list(grads)} != {list(want)}"
        for n, g in grads.items():
            _check_close(g, want[n], f"{engine} {what}: grad of {n}")
        seen[engine] = grads
    return seen


def _check_params(models: dict[str, nn.Module], ref: nn.Module, what: str) -> None:
    want = {n: p.detach() for n, p in ref.named_parameters()}
    for engine, model in models.items():
        for n, full in full_params(model).items():
            _check_close(full, want[n], f"{engine} {what}: param {n}")


def _check_same(a: dict[str, Any], b: dict[str, Any], what: str, bitwise: bool = False) -> None:
    for n, want in b.items():
        got = a[n]
        if bitwise and got is not None and want is not None:
            assert torch.equal(got, want), f"{what}: {n} differs bitwise"
        else:
            _check_close(got, want, f"{what}: {n}")


def _step_all(
    models: dict[str, nn.Module], ref: nn.Module, name: str, step: int, batch: int = 8
) -> None:
    """One forward/backward of the reference on the global batch and of every model on its
    slice, checking the rank-averaged losses."""
    x, y = make_batch(name, step, batch)
    ref_loss = local_loss(ref, name, x, y)
    ref_loss.backward()
    for engine, model in models.items():
        loss = local_loss(model, name, _mine(x), _mine(y))
        loss.backward()
        _check_close(mean_over_ranks(loss), ref_loss.detach(), f"{engine} step {step} loss")


def _summary(calls: list[Call]) -> dict[tuple[str, str], int]:
    """``(phase, kind) -> count``."""
    return dict(Counter((c.phase, c.kind) for c in calls))


def _calls(events: list[Any]) -> list[Call]:
    return [e for e in events if isinstance(e, Call)]


def _shard_numel(params: list[torch.Tensor], world_size: int) -> int:
    """Per-rank flat size of a group: each param padded to ceil(dim0 / world) rows."""
    return sum(-(-p.shape[0] // world_size) * math.prod(p.shape[1:]) for p in params)


def _assert_all_dtensors(model: nn.Module, what: str) -> None:
    for m in model.modules():
        for n, p in m._parameters.items():
            assert p is None or isinstance(p, DTensor), f"{what}: {n} is registered unsharded"


@contextlib.contextmanager
def _reduce_scatter_ops() -> Iterator[list[Any]]:
    """Record the ``op`` of every ``dist.reduce_scatter_single`` call in the block."""
    ops: list[Any] = []
    orig = dist.reduce_scatter_single

    def recorded(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        ops.append(op)
        return orig(output, input, op=op, group=group, async_op=async_op)

    with mock.patch.object(dist, "reduce_scatter_single", recorded):
        yield ops


# ---------------------------------------------------------------------------------------------
# set_requires_gradient_sync / set_reshard_after_backward: microbatch accumulation


def _no_sync(reshard_during_accum: bool) -> None:
    mesh = _mesh()
    ref = build(NAME)
    models = {engine: _sharded(engine, mesh) for engine in ENGINES}
    sharded = {e: list(m.parameters()) for e, m in models.items()}  # the DTensors
    ref_opt = make_optimizer("sgd", ref.parameters())
    opts = {e: make_optimizer("sgd", ps) for e, ps in sharded.items()}
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
                    loss = local_loss(model, NAME, _mine(xm), _mine(ym)) / K
                    counter.phase = "backward"
                    loss.backward()
                    counter.phase = "?"
                    calls = _calls(counter.take())
                    gathered = i == 0 or reshard_during_accum
                    want = {("backward", "AG"): N_BLOCKS}
                    if gathered:
                        want[("forward", "AG")] = GROUPS
                    if last:
                        want[("backward", "RS")] = GROUPS
                    what = f"{engine} step {step} microbatch {i}"
                    assert _summary(calls) == want, f"{what}: got {_summary(calls)}, want {want}"
                    assert all(c.group_size == _ws() for c in calls), f"{what}: {calls}"
                    if not last:  # (kept unsharded params are registered now, with grads)
                        assert all(p.grad is None for p in sharded[engine]), (
                            f"{what}: a backward without gradient sync landed sharded gradients"
                        )
            seen = _check_grads(models, _grads_of(ref), f"step {step}")
            _check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
            for opt in (ref_opt, *opts.values()):
                opt.step()
                opt.zero_grad()
            _check_params(models, ref, f"step {step}")
            for engine, model in models.items():
                _assert_all_dtensors(model, f"{engine} step {step}")


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


@_fresh_dtensor_cache
def _hsdp_parity(shape: tuple[int, int], raf: bool) -> None:
    mesh = _hsdp_mesh(shape)
    ref = build(NAME)
    models = {engine: _sharded(engine, mesh, reshard_after_forward=raf) for engine in ENGINES}
    for engine, model in models.items():
        for n, p in model.named_parameters():
            assert tuple(p.placements) == (Replicate(), Shard(0)), f"{engine} {n}: {p.placements}"
    ref_opt = make_optimizer("adamw", ref.parameters())
    opts = {e: make_optimizer("adamw", m.parameters()) for e, m in models.items()}
    for step in range(2):
        _step_all(models, ref, NAME, step)
        seen = _check_grads(models, _grads_of(ref), f"step {step}")
        _check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
        for opt in (ref_opt, *opts.values()):
            opt.step()
            opt.zero_grad()
        _check_params(models, ref, f"step {step}")


@pytest.mark.parametrize("raf", [True, False], ids=["rafTrue", "rafFalse"])
@pytest.mark.parametrize("world_size, shape", _hsdp_cases())
def test_hsdp_parity(world_size: int, shape: tuple[int, int], raf: bool) -> None:
    run_on_ranks(world_size, _hsdp_parity, shape, raf)


@_fresh_dtensor_cache
def _hsdp_accumulate(shape: tuple[int, int], setter: str) -> None:
    mesh = _hsdp_mesh(shape)
    replicate, shard = shape
    ref = build(NAME)
    models = {engine: _sharded(engine, mesh) for engine in ENGINES}
    sharded = {e: list(m.parameters()) for e, m in models.items()}
    x, y = make_batch(NAME, 0, 8 * K)
    local_loss(ref, NAME, x, y).backward()
    with CommCounter() as counter:
        for engine, model in models.items():
            for i, (xm, ym) in enumerate(zip(x.chunk(K), y.chunk(K), strict=True)):
                last = i == K - 1
                getattr(model, setter)(last)
                counter.phase = "step"
                (local_loss(model, NAME, _mine(xm), _mine(ym)) / K).backward()
                calls = [c for c in _calls(counter.take()) if c.kind != "AG"]
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
                    assert all(p.grad is None for p in sharded[engine]), (
                        f"{engine} microbatch {i}: gradients landed before the all-reduce"
                    )
    seen = _check_grads(models, _grads_of(ref), "accumulated")
    _check_same(seen["fsdp2"], seen["torch"], "fsdp2 vs torch")


@pytest.mark.parametrize("setter", ["set_requires_all_reduce", "set_requires_gradient_sync"])
@pytest.mark.parametrize("world_size, shape", _hsdp_cases())
def test_hsdp_accumulation_false_then_true(
    world_size: int, shape: tuple[int, int], setter: str
) -> None:
    run_on_ranks(world_size, _hsdp_accumulate, shape, setter)


# ---------------------------------------------------------------------------------------------
# Gradient divide factor, its deprecated alias, force-sum reductions


def _set_all(model: nn.Module, method: str, *args: Any) -> None:
    """Call a non-recursive setter on every FSDP module of ``model``."""
    for m in _fsdp_modules(model):
        getattr(m, method)(*args)


@_fresh_dtensor_cache
def _divide_factor(factor: float, hsdp: bool) -> None:
    ws = _ws()
    ref = build(NAME)
    mesh = _hsdp_mesh((2, ws // 2)) if hsdp else _mesh()
    models = {engine: _sharded(engine, mesh) for engine in ENGINES}
    for engine, model in models.items():
        _set_all(model, "set_gradient_divide_factor", factor)
        if engine == "torch":  # PREMUL_SUM(1 / factor) is not available on gloo
            _set_all(model, "set_force_sum_reduction_for_comms", True)
    for step in range(2):
        _step_all(models, ref, NAME, step)
        # Each rank's gradient is of its mean loss: the sum over ranks is ws * the average.
        seen = _check_grads(models, _grads_of(ref, ws / factor), f"step {step}")
        _check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
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
    ws = _ws()
    ref = build(NAME)
    model = _sharded("fsdp2")
    for m in _fsdp_modules(model):
        with pytest.warns(FutureWarning, match="set_gradient_divide_factor"):
            m.set_reduce_scatter_divide_factor(1.0)
    with pytest.raises(ValueError):
        model.set_gradient_divide_factor(0.0)
    _step_all({"fsdp2": model}, ref, NAME, 0)
    _check_grads({"fsdp2": model}, _grads_of(ref, float(ws)), "alias")


@pytest.mark.parametrize("world_size", [2])
def test_reduce_scatter_divide_factor_alias_warns(world_size: int) -> None:
    run_on_ranks(world_size, _deprecated_alias)


def _force_sum() -> None:
    ref = build(NAME)
    models = {
        "fsdp2-default": _sharded("fsdp2"),
        "fsdp2": _sharded("fsdp2"),
        "torch": _sharded("torch"),
    }
    for engine in ("fsdp2", "torch"):
        _set_all(models[engine], "set_force_sum_reduction_for_comms", True)
    ops = {}
    x, y = make_batch(NAME, 0)
    local_loss(ref, NAME, x, y).backward()
    for engine, model in models.items():
        with _reduce_scatter_ops() as seen_ops:
            local_loss(model, NAME, _mine(x), _mine(y)).backward()
        ops[engine] = seen_ops
    assert len(ops["fsdp2-default"]) == GROUPS, ops
    assert all(op == dist.ReduceOp.AVG for op in ops["fsdp2-default"]), ops["fsdp2-default"]
    for engine in ("fsdp2", "torch"):
        assert len(ops[engine]) == GROUPS, f"{engine}: {ops[engine]}"
        assert all(op == dist.ReduceOp.SUM for op in ops[engine]), f"{engine}: {ops[engine]}"
    seen = _check_grads(models, _grads_of(ref), "force sum")
    _check_same(seen["fsdp2"], seen["fsdp2-default"], "force sum vs default")
    _check_same(seen["fsdp2"], seen["torch"], "fsdp2 vs torch")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_force_sum_reduction_for_comms(world_size: int) -> None:
    run_on_ranks(world_size, _force_sum)


# ---------------------------------------------------------------------------------------------
# set_all_reduce_hook


def _group_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``module``'s own group (not of FSDP submodules)."""
    nested = {id(p) for m in _fsdp_modules(module) if m is not module for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in nested]


@_fresh_dtensor_cache
def _all_reduce_hook(kind: str) -> None:
    ws = _ws()
    ref = build(NAME)
    if kind == "replicate_all_reduce":
        # FSDP over the "shard" dim only; the hook averages over "replicate" itself.
        hsdp = _hsdp_mesh((2, ws // 2))
        mesh, replicate = hsdp["shard"], hsdp.get_group("replicate")
    elif kind == "hsdp_double":  # called after fsdp2's own all-reduce
        mesh, replicate = _hsdp_mesh((2, ws // 2)), None
    else:
        mesh, replicate = _mesh(), None
    models = {engine: _sharded(engine, mesh) for engine in ENGINES}
    records: dict[str, list[list[torch.Tensor]]] = {}
    for engine, model in models.items():
        records[engine] = []
        for m in _fsdp_modules(model):
            seen: list[torch.Tensor] = []
            records[engine].append(seen)

            def hook(t: torch.Tensor, seen: list[torch.Tensor] = seen) -> None:
                seen.append(t.detach().clone())
                if kind in ("double", "hsdp_double"):
                    t.mul_(2)
                elif kind == "replicate_all_reduce":
                    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=replicate)

            m.set_all_reduce_hook(hook)
    scale = 2.0 if kind in ("double", "hsdp_double") else 1.0
    shard_size = mesh.size(mesh.ndim - 1)
    for step in range(2):
        _step_all(models, ref, NAME, step)
        seen_grads = _check_grads(models, _grads_of(ref, scale), f"{kind} step {step}")
        _check_same(seen_grads["fsdp2"], seen_grads["torch"], f"step {step} fsdp2 vs torch")
        for engine, model in models.items():
            for m, seen in zip(_fsdp_modules(model), records[engine], strict=True):
                assert len(seen) == step + 1, (
                    f"{engine} {type(m).__name__}: hook called {len(seen)} times in {step + 1} "
                    "backwards, want once per backward"
                )
                want = _shard_numel(_group_params(m), shard_size)
                assert seen[-1].dim() == 1 and seen[-1].numel() == want, (
                    f"{engine} {type(m).__name__}: hook got shape {tuple(seen[-1].shape)}, "
                    f"want the flat reduced shard of {want} elements"
                )
        for a, b in zip(records["fsdp2"], records["torch"], strict=True):
            _check_close(a[-1], b[-1], f"step {step} hook input fsdp2 vs torch")
        for model in (ref, *models.values()):
            model.zero_grad()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("kind", ["record", "double", "replicate_all_reduce", "hsdp_double"])
def test_all_reduce_hook(world_size: int, kind: str) -> None:
    run_on_ranks(world_size, _all_reduce_hook, kind)


@_fresh_dtensor_cache
def _hook_stream_with_hsdp() -> None:
    mesh = _hsdp_mesh((2, _ws() // 2))
    for engine in ENGINES:
        model = _sharded(engine, mesh)
        with pytest.raises(ValueError):
            model.set_all_reduce_hook(lambda t: None, stream=object())
    with pytest.raises(TypeError):
        _sharded("fsdp2", mesh).set_all_reduce_hook("not callable")


@pytest.mark.parametrize("world_size", [2])
def test_all_reduce_hook_stream_with_hsdp_raises(world_size: int) -> None:
    run_on_ranks(world_size, _hook_stream_with_hsdp)


# ---------------------------------------------------------------------------------------------
# set_custom_all_gather / set_custom_reduce_scatter


class _CountingAllGather(fsdp2.AllGather):
    """``torch.empty`` buffers and ``dist.all_gather_single``, counting both."""

    def __init__(self) -> None:
        self.calls = 0
        self.allocs = 0

    def allocate(self, size, *, dtype, device):  # type: ignore[override]
        self.allocs += 1
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):  # type: ignore[override]
        self.calls += 1
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class _CountingReduceScatter(fsdp2.ReduceScatter):
    """``torch.empty`` buffers and ``dist.reduce_scatter_single``, counting both."""

    def __init__(self) -> None:
        self.calls = 0
        self.allocs = 0

    def allocate(self, size, *, dtype, device):  # type: ignore[override]
        self.allocs += 1
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[override]
        self.calls += 1
        return dist.reduce_scatter_single(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


def _custom_comm(which: str) -> None:
    ref = build(NAME)
    models = {engine: _sharded(engine) for engine in ENGINES}
    comms: dict[str, Any] = {}
    for engine, model in models.items():
        comm = _CountingAllGather() if which == "all_gather" else _CountingReduceScatter()
        comms[engine] = comm
        # torch checks no type and calls the comm with keywords: the same class serves both
        setter = "set_custom_all_gather" if which == "all_gather" else "set_custom_reduce_scatter"
        _set_all(model, setter, comm)
    kind = "AG" if which == "all_gather" else "RS"
    per_step = GROUPS + N_BLOCKS if which == "all_gather" else GROUPS
    allocs_per_call = 1 if which == "all_gather" else 2  # reduce-scatter: input and output
    with CommCounter() as counter:
        for step in range(2):
            _step_all(models, ref, NAME, step)
            # Both engines ran: every collective of that kind went through a custom comm.
            counted = [c for c in _calls(counter.take()) if c.kind == kind]
            assert len(counted) == 2 * per_step, f"step {step}: {len(counted)} {kind} in total"
            for engine, comm in comms.items():
                what = f"{engine} step {step}"
                assert comm.calls == per_step * (step + 1), f"{what}: {comm.calls} calls"
                assert comm.allocs == allocs_per_call * comm.calls, f"{what}: {comm.allocs}"
            seen = _check_grads(models, _grads_of(ref), f"step {step}")
            _check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
            for model in (ref, *models.values()):
                model.zero_grad()
    assert comms["fsdp2"].calls == comms["torch"].calls, {e: c.calls for e, c in comms.items()}
    assert comms["fsdp2"].allocs == comms["torch"].allocs, {e: c.allocs for e, c in comms.items()}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("which", ["all_gather", "reduce_scatter"])
def test_custom_comm(world_size: int, which: str) -> None:
    run_on_ranks(world_size, _custom_comm, which)


def _custom_comm_wrong_type() -> None:
    model = _sharded("fsdp2")
    with pytest.raises(TypeError):
        model.set_custom_all_gather(_CountingReduceScatter())
    with pytest.raises(TypeError):
        model.set_custom_reduce_scatter(_CountingAllGather())
    with pytest.raises(TypeError):
        model.set_custom_all_gather(dist.all_gather_single)


@pytest.mark.parametrize("world_size", [2])
def test_custom_comm_wrong_type_raises(world_size: int) -> None:
    run_on_ranks(world_size, _custom_comm_wrong_type)


# ---------------------------------------------------------------------------------------------
# set_reduce_scatter_unused_params


class _SpareBlock(MLPBlock):
    """An ``MLPBlock`` with a ``spare`` Linear that forward uses only while ``use_spare``."""

    use_spare = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.use_spare:
            y = y + self.spare(y)
        return F.relu(y) if self.relu else y


def _with_spare() -> nn.Module:
    model = build(NAME)
    torch.manual_seed(1)
    model.layers[1].spare = nn.Linear(3, 3)
    model.layers[1].__class__ = _SpareBlock
    return model


_SPARE = ("layers.1.spare.weight", "layers.1.spare.bias")


def _unused_params(case: str) -> None:
    """``default``: the spare is unused on every rank and reduce_scatter_unused_params is off;
    ``unused_everywhere``: the same with it on; ``used_on_rank0``: with it on, only rank 0
    uses the spare, so the other ranks reduce zeros for it in the same collective."""
    mesh = _mesh()
    rank = dist.get_rank()
    flag = case != "default"
    use = case == "used_on_rank0" and rank == 0
    local_ref = _with_spare()  # this rank's replica on its slice: average its grads by hand
    local_ref.layers[1].use_spare = use
    models = {}
    for engine, fn in ENGINES.items():
        models[engine] = shard_model(_with_spare(), fn, mesh, root_kwargs={})
        models[engine].layers[1].use_spare = use
        models[engine].set_reduce_scatter_unused_params(flag)
    for step in range(2):
        x, y = make_batch(NAME, step)
        for model in (local_ref, *models.values()):
            local_loss(model, NAME, _mine(x), _mine(y)).backward()
        want: dict[str, torch.Tensor | None] = {}
        for n, p in local_ref.named_parameters():
            if n in _SPARE and not flag:
                assert p.grad is None, n
                want[n] = None
            else:
                want[n] = mean_over_ranks(torch.zeros_like(p) if p.grad is None else p.grad)
        seen = _check_grads(models, want, f"step {step}")
        _check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
        spare = models["fsdp2"].layers[1].spare.weight
        assert (spare.grad is not None) == flag, f"step {step}: spare grad {spare.grad}"
        if flag:
            assert isinstance(spare.grad, DTensor), type(spare.grad)
        for model in (local_ref, *models.values()):
            model.zero_grad()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", ["default", "unused_everywhere", "used_on_rank0"])
def test_reduce_scatter_unused_params(world_size: int, case: str) -> None:
    run_on_ranks(world_size, _unused_params, case)


# ---------------------------------------------------------------------------------------------
# set_reduce_scatter_max_input_buffers


def _max_input_buffers() -> None:
    ref = build(NAME)
    models = {
        "fsdp2-default": _sharded("fsdp2"),
        "fsdp2": _sharded("fsdp2"),
        "torch": _sharded("torch"),
    }
    for engine in ("fsdp2", "torch"):
        models[engine].set_reduce_scatter_max_input_buffers(2)
    ref_opt = make_optimizer("adamw", ref.parameters())
    opts = {e: make_optimizer("adamw", m.parameters()) for e, m in models.items()}
    with CommCounter() as counter:
        for step in range(2):
            _step_all(models, ref, NAME, step)
            rs = [c for c in _calls(counter.take()) if c.kind == "RS"]
            assert len(rs) == len(models) * GROUPS, f"step {step}: {len(rs)} reduce-scatters"
            seen = _check_grads(models, _grads_of(ref), f"step {step}")
            _check_same(seen["fsdp2"], seen["fsdp2-default"], f"step {step} vs default", True)
            _check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
            for opt in (ref_opt, *opts.values()):
                opt.step()
                opt.zero_grad()
            _check_params(models, ref, f"step {step}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_max_input_buffers(world_size: int) -> None:
    run_on_ranks(world_size, _max_input_buffers)


def _max_input_buffers_errors() -> None:
    for engine in ENGINES:
        model = _sharded(engine)
        for bad, exc in ((True, TypeError), (2.0, TypeError), ("2", TypeError)):
            with pytest.raises(exc):
                model.set_reduce_scatter_max_input_buffers(bad)
        for bad in (0, -1):
            with pytest.raises(ValueError):
                model.set_reduce_scatter_max_input_buffers(bad)


@pytest.mark.parametrize("world_size", [2])
def test_reduce_scatter_max_input_buffers_bad_values(world_size: int) -> None:
    run_on_ranks(world_size, _max_input_buffers_errors)


# ---------------------------------------------------------------------------------------------
# Explicit prefetch lists


def _prefetch_model() -> nn.Module:
    # Per-rank group sizes differ on 2 and 4 ranks: B0 24/16, B1 14/7, B2 10/5, B3 4/4, R 3/3.
    torch.manual_seed(0)
    return MLPStack((7, 6, 4, 3, 2), head_dim=1)


def _record_prefetch(engine: str) -> None:
    ws = _ws()
    mesh = _mesh()
    ref = _prefetch_model()
    fn = ENGINES[engine]
    models = {
        "explicit": shard_model(_prefetch_model(), fn, mesh, root_kwargs={}),
        "default": shard_model(_prefetch_model(), fn, mesh, root_kwargs={}),
    }
    model = models["explicit"]
    b = list(model.layers)
    model.set_modules_to_forward_prefetch([b[0], b[1]])
    b[1].set_modules_to_forward_prefetch([b[2], b[3]])
    model.set_modules_to_backward_prefetch([b[3], b[2]])
    b[2].set_modules_to_backward_prefetch([b[1], b[0]])
    groups = {f"B{i}": list(blk.parameters()) for i, blk in enumerate(b)}
    groups["R"] = list(model.head.parameters())
    by_numel = {_shard_numel(ps, ws): g for g, ps in groups.items()}
    assert len(by_numel) == len(groups), f"ambiguous group sizes: {by_numel}"
    with CommCounter() as counter:
        computes = [(f"B{i}", blk.lin) for i, blk in enumerate(b)] + [("R", model.head)]
        for tag, mod in computes:
            mod.register_forward_pre_hook(lambda *_, t=tag: counter.mark(f"C({t})"))
            mod.register_full_backward_pre_hook(lambda *_, t=tag: counter.mark(f"Cb({t})"))
        for step in range(2):
            x, y = make_batch("mlp", step)
            local_loss(ref, "mlp", x, y).backward()
            counter.phase = "forward"
            loss = local_loss(model, "mlp", _mine(x), _mine(y))
            counter.phase = "backward"
            loss.backward()
            counter.phase = "?"
            events = counter.take()
            local_loss(models["default"], "mlp", _mine(x), _mine(y)).backward()
            counter.take()

            def order(phase: str, events: list[Any] = events) -> list[str]:
                out = []
                for e in events:
                    if isinstance(e, str):
                        if (phase == "forward") == e.startswith("C("):
                            out.append(e)
                    elif e.kind == "AG" and e.phase == phase:
                        out.append(f"AG({by_numel[e.numel]})")
                return out

            fwd = ["AG(R)", "AG(B0)", "AG(B1)", "C(B0)", "AG(B2)", "AG(B3)"]
            fwd += ["C(B1)", "C(B2)", "C(B3)", "C(R)"]
            bwd = ["AG(B3)", "AG(B2)", "Cb(R)", "Cb(B3)", "AG(B1)", "AG(B0)"]
            bwd += ["Cb(B2)", "Cb(B1)", "Cb(B0)"]
            assert order("forward") == fwd, f"step {step} forward: {order('forward')}"
            assert order("backward") == bwd, f"step {step} backward: {order('backward')}"
            seen = _check_grads(models, _grads_of(ref), f"step {step}")
            _check_same(seen["explicit"], seen["default"], f"step {step} vs default", True)
            for m in (ref, *models.values()):
                m.zero_grad()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_explicit_prefetch_lists(world_size: int, engine: str) -> None:
    run_on_ranks(world_size, _record_prefetch, engine)


# ---------------------------------------------------------------------------------------------
# unshard(async_op=True)


def _async_unshard(wait_after_step: bool) -> None:
    ref = build(NAME)
    models = {engine: _sharded(engine) for engine in ENGINES}
    handle_types = {"fsdp2": fsdp2.UnshardHandle, "torch": TorchUnshardHandle}
    with CommCounter() as counter:
        for step in range(2):
            x, y = make_batch(NAME, step)
            local_loss(ref, NAME, x, y).backward()
            for engine, model in models.items():
                counter.phase = "forward"
                handles = [blk.unshard(async_op=True) for blk in model.layers]
                assert all(isinstance(h, handle_types[engine]) for h in handles), handles
                handles[0].wait()
                handles[0].wait()  # idempotent
                loss = local_loss(model, NAME, _mine(x), _mine(y))  # waits for the others
                counter.phase = "backward"
                loss.backward()
                if wait_after_step:  # already waited by forward: nothing left to do
                    counter.phase = "after"
                    for h in handles:
                        h.wait()
                counter.phase = "?"
                got = _summary(_calls(counter.take()))
                want = {("forward", "AG"): GROUPS, ("backward", "AG"): N_BLOCKS}
                want[("backward", "RS")] = GROUPS
                assert got == want, f"{engine} step {step}: got {got}, want {want}"
                _assert_all_dtensors(model, f"{engine} step {step}")
            seen = _check_grads(models, _grads_of(ref), f"step {step}")
            _check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
            for m in (ref, *models.values()):
                m.zero_grad()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("wait_after_step", [False, True], ids=["forward_waits", "wait_after_step"])
def test_async_unshard_waited_by_forward(world_size: int, wait_after_step: bool) -> None:
    # wait_after_step: a handle that forward already waited is done; torch's wait() is then
    # a no-op, and fsdp2's docstring calls waiting optional.
    run_on_ranks(world_size, _async_unshard, wait_after_step)


# ---------------------------------------------------------------------------------------------
# set_unshard_in_backward


class _EmbNet(nn.Module):
    """Token embedding (own group; its backward needs only the ids), 2 blocks, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        self.layers = nn.ModuleList([MLPBlock(6, 5), MLPBlock(5, 3)])
        self.head = nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).flatten(0, 1)  # (batch * seq, dim): no output is a view
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _emb_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, 13, (8, 4), generator=g), torch.randn(8, 4, generator=g)


def _unshard_in_backward(flag: bool) -> None:
    mesh = _mesh()
    torch.manual_seed(0)
    ref = _EmbNet()
    models = {}
    for engine, fn in ENGINES.items():
        torch.manual_seed(0)
        model = _EmbNet()
        fn(model.emb, mesh=mesh, reshard_after_forward=True)
        models[engine] = shard_model(model, fn, mesh, root_kwargs={})
        model.emb.set_unshard_in_backward(flag)
    emb_numel = _shard_numel([ref.emb.weight], _ws())
    opts = {e: make_optimizer("adamw", m.parameters()) for e, m in models.items()}
    ref_opt = make_optimizer("adamw", ref.parameters())
    with CommCounter() as counter:
        for step in range(2):
            x, y = _emb_batch(step)
            F.mse_loss(ref(x), y.view(-1, 1)).backward()
            for engine, model in models.items():
                counter.phase = "forward"
                loss = F.mse_loss(model(_mine(x)), _mine(y).reshape(-1, 1))
                counter.phase = "backward"
                loss.backward()
                counter.phase = "?"
                calls = _calls(counter.take())
                bwd = [c.numel for c in calls if c.phase == "backward" and c.kind == "AG"]
                n_emb = bwd.count(emb_numel)
                assert n_emb == int(flag), (
                    f"{engine} step {step}: {n_emb} backward all-gathers of the embedding "
                    f"(unshard_in_backward={flag}); backward all-gather sizes {bwd}"
                )
                assert len(bwd) == 2 + int(flag), f"{engine} step {step}: {bwd}"
            seen = _check_grads(models, _grads_of(ref), f"step {step}")
            _check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
            for opt in (ref_opt, *opts.values()):
                opt.step()
                opt.zero_grad()
            _check_params(models, ref, f"step {step}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("flag", [False, True], ids=["no_unshard", "unshard"])
def test_unshard_in_backward(world_size: int, flag: bool) -> None:
    run_on_ranks(world_size, _unshard_in_backward, flag)


# ---------------------------------------------------------------------------------------------
# set_reshard_after_forward at run time, set_is_last_backward

_RAF_CASES = {
    # case: (how to change it, backward all-gathers per step afterwards)
    "all_false": (lambda m: m.set_reshard_after_forward(False), 0),
    "root_true_not_recursive": (
        lambda m: m.set_reshard_after_forward(True, recurse=False),
        N_BLOCKS + 1,
    ),
    "block_false_not_recursive": (
        lambda m: m.layers[0].set_reshard_after_forward(False, recurse=False),
        N_BLOCKS - 1,
    ),
}


def _runtime_reshard(case: str) -> None:
    change, bwd_ag = _RAF_CASES[case]
    ref = build(NAME)
    models = {engine: _sharded(engine) for engine in ENGINES}
    with CommCounter() as counter:
        for step in range(3):
            if step == 1:  # step 0 runs with the construction-time settings
                for model in models.values():
                    change(model)
            x, y = make_batch(NAME, step)
            local_loss(ref, NAME, x, y).backward()
            for engine, model in models.items():
                model.set_is_last_backward(True)
                counter.phase = "forward"
                loss = local_loss(model, NAME, _mine(x), _mine(y))
                counter.phase = "backward"
                loss.backward()
                counter.phase = "?"
                got = _summary(_calls(counter.take()))
                want = {("forward", "AG"): GROUPS, ("backward", "RS"): GROUPS}
                n = N_BLOCKS if step == 0 else bwd_ag
                if n:
                    want[("backward", "AG")] = n
                assert got == want, f"{engine} step {step}: got {got}, want {want}"
            seen = _check_grads(models, _grads_of(ref), f"step {step}")
            _check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
            for m in (ref, *models.values()):
                m.zero_grad()
    for model in models.values():
        with pytest.raises(ValueError):
            model.set_reshard_after_forward(2)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", list(_RAF_CASES))
def test_set_reshard_after_forward_at_runtime(world_size: int, case: str) -> None:
    run_on_ranks(world_size, _runtime_reshard, case)


def _is_last_backward_false() -> None:
    # fsdp2 documents that every backward finishes its reductions anyway.
    ref = build(NAME)
    model = _sharded("fsdp2")
    model.set_is_last_backward(False)
    _step_all({"fsdp2": model}, ref, NAME, 0)
    _check_grads({"fsdp2": model}, _grads_of(ref), "is_last_backward=False")
    _assert_all_dtensors(model, "after backward")


@pytest.mark.parametrize("world_size", [2])
def test_set_is_last_backward_false_accepted(world_size: int) -> None:
    run_on_ranks(world_size, _is_last_backward_false)


# ---------------------------------------------------------------------------------------------
# reset_iter_state


class _Boom(RuntimeError):
    pass


class _FailingBlock(MLPBlock):
    """An ``MLPBlock`` that raises in its forward or its backward while ``fail`` is set."""

    fail: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.fail == "forward":
            raise _Boom("forward")
        if self.fail == "backward":
            y.register_hook(_raise_boom)
        return F.relu(y) if self.relu else y


def _raise_boom(grad: torch.Tensor) -> None:
    raise _Boom("backward")


def _failing_model() -> nn.Module:
    model = build(NAME)
    model.layers[1].__class__ = _FailingBlock
    return model


def _reset_iter_state(where: str) -> None:
    mesh = _mesh()
    ref = build(NAME)
    # torch 2.13 is compared only for a failure in forward: its reset_iter_state keeps the
    # unsharded gradients computed before the failure (the root's after a failed backward,
    # the accumulated ones after a failed no-sync microbatch), which the retry then adds to.
    engines = ENGINES if where == "forward" else {"fsdp2": ENGINES["fsdp2"]}
    models = {
        e: shard_model(_failing_model(), fn, mesh, root_kwargs={}) for e, fn in engines.items()
    }
    ref_opt = make_optimizer("adamw", ref.parameters())
    opts = {e: make_optimizer("adamw", m.parameters()) for e, m in models.items()}
    want_step = {("step", "AG"): GROUPS + N_BLOCKS, ("step", "RS"): GROUPS}
    with CommCounter() as counter:
        for step in range(3):
            x, y = make_batch(NAME, step)
            if step == 1:  # the failed attempt: the reference skips it
                for engine, model in models.items():
                    if where == "no_sync":  # one microbatch accumulates, the next one fails
                        model.set_requires_gradient_sync(False)
                        xm, ym = _mine(x).chunk(2), _mine(y).chunk(2)
                        local_loss(model, NAME, xm[0], ym[0]).backward()
                    model.layers[1].fail = "forward" if where == "no_sync" else where
                    with pytest.raises(_Boom):
                        local_loss(model, NAME, _mine(x), _mine(y)).backward()
                    model.layers[1].fail = None
                    model.reset_iter_state()
                    model.set_requires_gradient_sync(True)
                    opts[engine].zero_grad()
                    _assert_all_dtensors(model, f"{engine} after reset_iter_state")
                counter.take()
            local_loss(ref, NAME, x, y).backward()
            for engine, model in models.items():
                counter.phase = "step"
                local_loss(model, NAME, _mine(x), _mine(y)).backward()
                counter.phase = "?"
                got = _summary(_calls(counter.take()))
                assert got == want_step, f"{engine} step {step}: got {got}, want {want_step}"
            seen = _check_grads(models, _grads_of(ref), f"step {step}")
            if "torch" in seen:
                _check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
            for opt in (ref_opt, *opts.values()):
                opt.step()
                opt.zero_grad()
            _check_params(models, ref, f"step {step}")
            for engine, model in models.items():
                _assert_all_dtensors(model, f"{engine} step {step}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("where", ["forward", "backward", "no_sync"])
def test_reset_iter_state_after_exception(world_size: int, where: str) -> None:
    run_on_ranks(world_size, _reset_iter_state, where)


def _reset_on_non_root() -> None:
    for engine in ENGINES:
        model = _sharded(engine)
        x, y = make_batch(NAME, 0)
        local_loss(model, NAME, _mine(x), _mine(y)).backward()
        with pytest.raises(RuntimeError, match="root"):
            model.layers[0].reset_iter_state()
        model.reset_iter_state()  # the root: fine between steps too


@pytest.mark.parametrize("world_size", [2])
def test_reset_iter_state_on_non_root_raises(world_size: int) -> None:
    run_on_ranks(world_size, _reset_on_non_root)


# ---------------------------------------------------------------------------------------------
# share_comm_ctx


def _share_comm_ctx() -> None:
    share = {"fsdp2": fsdp2.share_comm_ctx, "torch": torch_share_comm_ctx}
    ref = build(NAME)
    x, y = make_batch(NAME, 0)
    local_loss(ref, NAME, x, y).backward()
    for engine in ENGINES:
        first, second = _sharded(engine), _sharded(engine)
        share[engine]([first, second])
        with pytest.raises(ValueError):
            share[engine]([first, nn.Linear(2, 2)])
        with pytest.raises(ValueError):
            share[engine]([first, first.head])  # a plain submodule of an FSDP module
        models = {f"{engine} first": first, f"{engine} second": second}
        for model in models.values():
            local_loss(model, NAME, _mine(x), _mine(y)).backward()
        _check_grads(models, _grads_of(ref), "after share_comm_ctx")


@pytest.mark.parametrize("world_size", [2])
def test_share_comm_ctx(world_size: int) -> None:
    run_on_ranks(world_size, _share_comm_ctx)


# ---------------------------------------------------------------------------------------------
# shard_placement_fn


def _placement_model() -> nn.Module:
    # Weights (4, 8) and (3, 4): dim 1 divisible by 2 and 4; (1, 3) is not.
    torch.manual_seed(0)
    return MLPStack((8, 4, 3, 1))


def _placement_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)


def _shard_placement_fn() -> None:
    ws = _ws()
    mesh = _mesh()

    def placement(p: nn.Parameter) -> Shard | None:
        return Shard(1) if p.dim() == 2 and p.shape[1] % ws == 0 else None

    ref = _placement_model()
    models = {
        e: shard_model(_placement_model(), fn, mesh, shard_placement_fn=placement)
        for e, fn in ENGINES.items()
    }
    for engine, model in models.items():
        for (n, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
            dim = 1 if p_ref.dim() == 2 and p_ref.shape[1] % ws == 0 else 0
            assert tuple(p.placements) == (Shard(dim),), f"{engine} {n}: {p.placements}"
            if dim == 1:
                assert p.to_local().shape == (p_ref.shape[0], p_ref.shape[1] // ws), n
    ref_opt = make_optimizer("adamw", ref.parameters())
    opts = {e: make_optimizer("adamw", m.parameters()) for e, m in models.items()}
    for step in range(2):
        x, y = _placement_batch(step)
        F.mse_loss(ref(x), y).backward()
        for model in models.values():
            F.mse_loss(model(_mine(x)), _mine(y)).backward()
        for engine, model in models.items():
            for n, p in model.named_parameters():
                assert p.grad.placements == p.placements, f"{engine} {n}: {p.grad.placements}"
        seen = _check_grads(models, _grads_of(ref), f"step {step}")
        _check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
        for opt in (ref_opt, *opts.values()):
            opt.step()
            opt.zero_grad()
        _check_params(models, ref, f"step {step}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shard_placement_fn_dim1(world_size: int) -> None:
    run_on_ranks(world_size, _shard_placement_fn)


def _shard_placement_uneven() -> None:
    model = _placement_model()
    with pytest.raises(ValueError, match="layers.2|lin.weight"):
        fsdp2.fully_shard(
            model.layers[2], mesh=_mesh(), shard_placement_fn=lambda p: Shard(p.dim() - 1)
        )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shard_placement_fn_uneven_dim_raises(world_size: int) -> None:
    run_on_ranks(world_size, _shard_placement_uneven)


# ---------------------------------------------------------------------------------------------
# ignored_params


def _ignored_params() -> None:
    mesh = _mesh()
    ref, local_ref = build(NAME), build(NAME)  # the global batch; this rank's slice only
    models = {}
    ignored_name = "layers.1.lin.bias"
    for engine, fn in ENGINES.items():
        model = build(NAME)
        ignored = model.layers[1].lin.bias
        for i, block in enumerate(model.layers):
            fn(block, mesh=mesh, ignored_params={ignored} if i == 1 else None)
        fn(model, mesh=mesh)
        assert model.layers[1].lin.bias is ignored, f"{engine}: the ignored param was replaced"
        assert type(ignored) is nn.Parameter and not isinstance(ignored, DTensor), engine
        models[engine] = model
    x, y = make_batch(NAME, 0)
    local_loss(ref, NAME, x, y).backward()
    local_loss(local_ref, NAME, _mine(x), _mine(y)).backward()
    for model in models.values():
        local_loss(model, NAME, _mine(x), _mine(y)).backward()
    want = _grads_of(ref)
    want[ignored_name] = local_ref.layers[1].lin.bias.grad  # not reduced: this rank's own
    for engine, model in models.items():
        g = model.layers[1].lin.bias.grad
        assert g is not None and not isinstance(g, DTensor), f"{engine}: {type(g)}"
    seen = _check_grads(models, want, "ignored")
    _check_same(seen["fsdp2"], seen["torch"], "fsdp2 vs torch")
    local_grads = [torch.empty_like(want[ignored_name]) for _ in range(_ws())]
    dist.all_gather(local_grads, want[ignored_name])
    assert not all(torch.equal(local_grads[0], g) for g in local_grads[1:]), (
        "the ranks' local gradients coincide: the test cannot tell reduced from local"
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ignored_params(world_size: int) -> None:
    run_on_ranks(world_size, _ignored_params)


# ---------------------------------------------------------------------------------------------
# fully_shard([a, b]): one group for two modules


def _list_form() -> None:
    ws = _ws()
    mesh = _mesh()
    ref = build("mlp")
    models = {}
    for engine, fn in ENGINES.items():
        model = build("mlp")
        fn([model.layers[0], model.layers[1]], mesh=mesh)
        fn(model.layers[2], mesh=mesh)
        models[engine] = fn(model, mesh=mesh)
    pair = _shard_numel([*ref.layers[0].parameters(), *ref.layers[1].parameters()], ws)
    last = _shard_numel(list(ref.layers[2].parameters()), ws)
    ref_opt = make_optimizer("adamw", ref.parameters())
    opts = {e: make_optimizer("adamw", m.parameters()) for e, m in models.items()}
    with CommCounter() as counter:
        for step in range(2):
            x, y = make_batch("mlp", step)
            local_loss(ref, "mlp", x, y).backward()
            for engine, model in models.items():
                counter.phase = "forward"
                loss = local_loss(model, "mlp", _mine(x), _mine(y))
                counter.phase = "backward"
                loss.backward()
                counter.phase = "?"
                calls = _calls(counter.take())
                for phase in ("forward", "backward"):
                    ag = sorted(c.numel for c in calls if c.kind == "AG" and c.phase == phase)
                    want = sorted([pair, last])
                    assert ag == want, f"{engine} step {step} {phase}: all-gathers {ag}, {want}"
                rs = sorted(c.numel for c in calls if c.kind == "RS")
                assert rs == sorted([pair * ws, last * ws]), f"{engine} step {step}: RS {rs}"
            seen = _check_grads(models, _grads_of(ref), f"step {step}")
            _check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
            for opt in (ref_opt, *opts.values()):
                opt.step()
                opt.zero_grad()
            _check_params(models, ref, f"step {step}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_list_form_one_all_gather(world_size: int) -> None:
    run_on_ranks(world_size, _list_form)


class _Square(nn.Module):
    """``x * w * w``: its backward reads ``w`` even when ``x`` needs no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 2.0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w * self.w


class _SquareThenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = _Square()
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _list_form_params_in_backward() -> None:
    mesh = _mesh()
    torch.manual_seed(0)
    ref = _SquareThenLinear()
    models = {}
    for engine, fn in ENGINES.items():
        torch.manual_seed(0)
        model = _SquareThenLinear()
        fn([model.a, model.b], mesh=mesh)  # a's input (the data) needs no gradient
        models[engine] = fn(model, mesh=mesh)
    g = torch.Generator().manual_seed(4000)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    F.mse_loss(ref(x), y).backward()
    with CommCounter() as counter:
        rs = {}
        for engine, model in models.items():
            F.mse_loss(model(_mine(x)), _mine(y)).backward()
            rs[engine] = [c.numel for c in _calls(counter.take()) if c.kind == "RS"]
    for engine, numels in rs.items():
        assert len(numels) == 1, f"{engine}: reduce-scatters of sizes {numels} for one group"
    seen = _check_grads(models, _grads_of(ref), "list group")
    _check_same(seen["fsdp2"], seen["torch"], "fsdp2 vs torch")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_list_form_first_module_reads_params_in_backward(world_size: int) -> None:
    run_on_ranks(world_size, _list_form_params_in_backward)


# ---------------------------------------------------------------------------------------------
# register_fsdp_forward_method on a plain module


class _Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2


@pytest.mark.parametrize("register", [fsdp2.register_fsdp_forward_method, torch_register_method])
def test_register_forward_method_on_plain_module_is_noop(register: Callable[..., None]) -> None:
    torch.manual_seed(0)
    model = _Generator()
    x = torch.randn(2, 3)
    before = model.generate(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        register(model, "generate")
        register(model, "no_such_method")  # not even checked: a no-op on plain modules
    assert "generate" not in model.__dict__, "the method was patched on a plain module"
    assert type(model) is _Generator
    torch.testing.assert_close(model.generate(x), before, rtol=0, atol=0)
