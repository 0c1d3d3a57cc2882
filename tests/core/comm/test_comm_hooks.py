"""How ``FSDPModule`` reduces and communicates, as the user customizes it: the all-reduce hook
(``set_all_reduce_hook``), custom collectives (``set_custom_all_gather`` /
``set_custom_reduce_scatter``), ``set_reduce_scatter_unused_params``,
``set_reduce_scatter_max_input_buffers`` and ``share_comm_ctx``.

Each rank function builds, under one seed, a replicated reference (trained on the whole global
batch, or for per-rank behaviour a replica on the rank's slice, averaged by hand) and the model
sharded by ``fsdp2.fully_shard`` and by ``torch.distributed.fsdp.fully_shard``; the sharded
models train on their rank's slice. Full gradients (after backward) and, where the optimizer
steps, parameters must match the reference in fp32 and each other (``helpers.check_grads`` /
``check_params`` / ``check_same``). Collectives are counted with ``comm_counter.CommCounter``.
Argument checks run once per engine (the ``engine`` parameter) where torch has the same check.

The model is ``MLPStack((7, 5, 3, 1), head_dim=2)``: 3 blocks and a root holding a head, so 4
groups. Cases run on 2 and 4 gloo ranks; error-only cases run on 2.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from comm_counter import AG_API, RS_API, CommCounter, shard_numel
from helpers import (
    ENGINES,
    GROUPS,
    N_BLOCKS,
    NAME,
    WORLD_SIZES,
    check_close,
    check_grads,
    check_params,
    check_same,
    engines_with,
    fsdp_modules,
    grads_of,
    hsdp_mesh,
    mine,
    set_all,
    sharded,
    step_all,
    world_mesh,
)
from models import (
    MLPBlock,
    build,
    local_loss,
    make_batch,
    make_optimizer,
    mean_over_ranks,
    shard_model,
)
from torch.distributed.fsdp import share_comm_ctx as torch_share_comm_ctx
from torch.distributed.tensor import DTensor

import fsdp2

# ---------------------------------------------------------------------------------------------
# set_all_reduce_hook


def _group_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``module``'s own group (not of FSDP submodules)."""
    nested = {id(p) for m in fsdp_modules(module) if m is not module for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in nested]


def _all_reduce_hook(kind: str) -> None:
    ws = dist.get_world_size()
    ref = build(NAME)
    if kind == "replicate_all_reduce":
        # FSDP over the "shard" dim only; the hook averages over "replicate" itself.
        hsdp = hsdp_mesh((2, ws // 2))
        mesh, replicate = hsdp["shard"], hsdp.get_group("replicate")
    elif kind == "hsdp_double":  # called after fsdp2's own all-reduce
        mesh, replicate = hsdp_mesh((2, ws // 2)), None
    else:
        mesh, replicate = world_mesh(), None
    models = {engine: sharded(engine, NAME, mesh) for engine in ENGINES}
    records: dict[str, list[list[torch.Tensor]]] = {}
    for engine, model in models.items():
        records[engine] = []
        for m in fsdp_modules(model):
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
        step_all(models, ref, NAME, step)
        seen_grads = check_grads(models, grads_of(ref, scale), f"{kind} step {step}")
        check_same(seen_grads["fsdp2"], seen_grads["torch"], f"step {step} fsdp2 vs torch")
        for engine, model in models.items():
            for m, seen in zip(fsdp_modules(model), records[engine], strict=True):
                assert len(seen) == step + 1, (
                    f"{engine} {type(m).__name__}: hook called {len(seen)} times in {step + 1} "
                    "backwards, want once per backward"
                )
                want = shard_numel(_group_params(m), shard_size)
                assert seen[-1].dim() == 1 and seen[-1].numel() == want, (
                    f"{engine} {type(m).__name__}: hook got shape {tuple(seen[-1].shape)}, "
                    f"want the flat reduced shard of {want} elements"
                )
        for a, b in zip(records["fsdp2"], records["torch"], strict=True):
            check_close(a[-1], b[-1], f"step {step} hook input fsdp2 vs torch")
        for model in (ref, *models.values()):
            model.zero_grad()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("kind", ["record", "double", "replicate_all_reduce", "hsdp_double"])
def test_all_reduce_hook(world_size: int, kind: str) -> None:
    run_on_ranks(world_size, _all_reduce_hook, kind)


def _hook_stream_with_hsdp(engine: str) -> None:
    mesh = hsdp_mesh((2, dist.get_world_size() // 2))
    model = sharded(engine, NAME, mesh)
    with pytest.raises(ValueError):
        model.set_all_reduce_hook(lambda t: None, stream=object())
    if engine == "fsdp2":
        with pytest.raises(TypeError):
            sharded("fsdp2", NAME, mesh).set_all_reduce_hook("not callable")


@pytest.mark.parametrize("engine", list(ENGINES))
def test_all_reduce_hook_stream_with_hsdp_raises(engine: str) -> None:
    run_on_ranks(2, _hook_stream_with_hsdp, engine)


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
        ag = getattr(dist, AG_API)
        return ag(output_tensor, input_tensor, group=group, async_op=async_op)


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
        return getattr(dist, RS_API)(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


def _custom_comm(which: str) -> None:
    ref = build(NAME)
    models = {engine: sharded(engine, NAME) for engine in ENGINES}
    comms: dict[str, Any] = {}
    for engine, model in models.items():
        comm = _CountingAllGather() if which == "all_gather" else _CountingReduceScatter()
        comms[engine] = comm
        # torch checks no type and calls the comm with keywords: the same class serves both
        setter = "set_custom_all_gather" if which == "all_gather" else "set_custom_reduce_scatter"
        set_all(model, setter, comm)
    kind = "AG" if which == "all_gather" else "RS"
    per_step = GROUPS + N_BLOCKS if which == "all_gather" else GROUPS
    allocs_per_call = 1 if which == "all_gather" else 2  # reduce-scatter: input and output
    with CommCounter() as counter:
        for step in range(2):
            step_all(models, ref, NAME, step)
            # Both engines ran: every collective of that kind went through a custom comm.
            counted = [c for c in counter.take_calls() if c.kind == kind]
            assert len(counted) == 2 * per_step, f"step {step}: {len(counted)} {kind} in total"
            for engine, comm in comms.items():
                what = f"{engine} step {step}"
                assert comm.calls == per_step * (step + 1), f"{what}: {comm.calls} calls"
                assert comm.allocs == allocs_per_call * comm.calls, f"{what}: {comm.allocs}"
            seen = check_grads(models, grads_of(ref), f"step {step}")
            check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
            for model in (ref, *models.values()):
                model.zero_grad()
    assert comms["fsdp2"].calls == comms["torch"].calls, {e: c.calls for e, c in comms.items()}
    assert comms["fsdp2"].allocs == comms["torch"].allocs, {e: c.allocs for e, c in comms.items()}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("which", ["all_gather", "reduce_scatter"])
def test_custom_comm(world_size: int, which: str) -> None:
    run_on_ranks(world_size, _custom_comm, which)


def _custom_comm_wrong_type() -> None:
    model = sharded("fsdp2", NAME)
    with pytest.raises(TypeError):
        model.set_custom_all_gather(_CountingReduceScatter())
    with pytest.raises(TypeError):
        model.set_custom_reduce_scatter(_CountingAllGather())
    with pytest.raises(TypeError):
        model.set_custom_all_gather(getattr(dist, AG_API))


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
    mesh = world_mesh()
    rank = dist.get_rank()
    flag = case != "default"
    use = case == "used_on_rank0" and rank == 0
    local_ref = _with_spare()  # this rank's replica on its slice: average its grads by hand
    local_ref.layers[1].use_spare = use
    models = {}
    for engine, fn in engines_with("set_reduce_scatter_unused_params").items():
        models[engine] = shard_model(_with_spare(), fn, mesh, root_kwargs={})
        models[engine].layers[1].use_spare = use
        models[engine].set_reduce_scatter_unused_params(flag)
    for step in range(2):
        x, y = make_batch(NAME, step)
        for model in (local_ref, *models.values()):
            local_loss(model, NAME, mine(x), mine(y)).backward()
        want: dict[str, torch.Tensor | None] = {}
        for n, p in local_ref.named_parameters():
            if n in _SPARE and not flag:
                assert p.grad is None, n
                want[n] = None
            else:
                want[n] = mean_over_ranks(torch.zeros_like(p) if p.grad is None else p.grad)
        seen = check_grads(models, want, f"step {step}")
        if "torch" in seen:
            check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
        spare = models["fsdp2"].layers[1].spare.weight
        assert (spare.grad is not None) == flag, f"fsdp2 step {step}: spare grad {spare.grad}"
        if flag:
            assert isinstance(spare.grad, DTensor), f"fsdp2 step {step}: {type(spare.grad)}"
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
    engines = engines_with("set_reduce_scatter_max_input_buffers")
    models = {"fsdp2-default": sharded("fsdp2", NAME)}
    models.update({engine: sharded(engine, NAME) for engine in engines})
    for engine in engines:
        models[engine].set_reduce_scatter_max_input_buffers(2)
    ref_opt = make_optimizer("adamw", ref.parameters())
    opts = {e: make_optimizer("adamw", m.parameters()) for e, m in models.items()}
    with CommCounter() as counter:
        for step in range(2):
            step_all(models, ref, NAME, step)
            rs = [c for c in counter.take_calls() if c.kind == "RS"]
            assert len(rs) == len(models) * GROUPS, f"step {step}: {len(rs)} reduce-scatters"
            seen = check_grads(models, grads_of(ref), f"step {step}")
            check_same(
                seen["fsdp2"], seen["fsdp2-default"], f"step {step} vs default", bitwise=True
            )
            if "torch" in seen:
                check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
            for opt in (ref_opt, *opts.values()):
                opt.step()
                opt.zero_grad()
            check_params(models, ref, f"step {step}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_max_input_buffers(world_size: int) -> None:
    run_on_ranks(world_size, _max_input_buffers)


def _max_input_buffers_errors(engine: str) -> None:
    model = sharded(engine, NAME)
    for bad, exc in ((True, TypeError), (2.0, TypeError), ("2", TypeError)):
        with pytest.raises(exc):
            model.set_reduce_scatter_max_input_buffers(bad)
    for bad in (0, -1):
        with pytest.raises(ValueError):
            model.set_reduce_scatter_max_input_buffers(bad)


@pytest.mark.parametrize("engine", list(engines_with("set_reduce_scatter_max_input_buffers")))
def test_reduce_scatter_max_input_buffers_bad_values(engine: str) -> None:
    run_on_ranks(2, _max_input_buffers_errors, engine)


# ---------------------------------------------------------------------------------------------
# share_comm_ctx


def _share_comm_ctx(engine: str) -> None:
    share = {"fsdp2": fsdp2.share_comm_ctx, "torch": torch_share_comm_ctx}[engine]
    ref = build(NAME)
    x, y = make_batch(NAME, 0)
    local_loss(ref, NAME, x, y).backward()
    first, second = sharded(engine, NAME), sharded(engine, NAME)
    share([first, second])
    with pytest.raises(ValueError):
        share([first, nn.Linear(2, 2)])
    with pytest.raises(ValueError):
        share([first, first.head])  # a plain submodule of an FSDP module
    models = {f"{engine} first": first, f"{engine} second": second}
    for model in models.values():
        local_loss(model, NAME, mine(x), mine(y)).backward()
    check_grads(models, grads_of(ref), "after share_comm_ctx")


@pytest.mark.parametrize("engine", list(ENGINES))
def test_share_comm_ctx(engine: str) -> None:
    run_on_ranks(2, _share_comm_ctx, engine)
