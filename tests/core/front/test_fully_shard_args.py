"""The extra ``fully_shard`` arguments and forms: ``shard_placement_fn`` (dim-1 shards),
``ignored_params``, the list form ``fully_shard([a, b])`` (one group, one all-gather and one
reduce-scatter for two modules), and ``register_fsdp_forward_method`` on a plain module.

Each rank function builds, under one seed, a replicated reference trained on the whole global
batch (for ``ignored_params`` also a replica on the rank's slice: ignored parameters are not
reduced) and the model sharded by ``fsdp2.fully_shard`` and by ``torch.distributed.fsdp.
fully_shard``; the sharded models train on their rank's slice. Full gradients (after backward)
and parameters (after the optimizer step) must match the reference in fp32 and each other
(``helpers.check_grads`` / ``check_params`` / ``check_same``); collectives are counted with
``comm_counter.CommCounter``. Cases run on 2 and 4 gloo ranks.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from comm_counter import CommCounter, shard_numel
from helpers import (
    ENGINES,
    NAME,
    WORLD_SIZES,
    check_grads,
    check_params,
    check_same,
    grads_of,
    mine,
    world_mesh,
)
from models import MLPStack, build, local_loss, make_batch, make_optimizer, shard_model
from torch.distributed.fsdp import register_fsdp_forward_method as torch_register_method
from torch.distributed.tensor import DTensor, Shard

import fsdp2

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
    ws = dist.get_world_size()
    mesh = world_mesh()

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
                want = (p_ref.shape[0], p_ref.shape[1] // ws)
                assert p.to_local().shape == want, f"{engine} {n}: {p.to_local().shape}"
    ref_opt = make_optimizer("adamw", ref.parameters())
    opts = {e: make_optimizer("adamw", m.parameters()) for e, m in models.items()}
    for step in range(2):
        x, y = _placement_batch(step)
        F.mse_loss(ref(x), y).backward()
        for model in models.values():
            F.mse_loss(model(mine(x)), mine(y)).backward()
        for engine, model in models.items():
            for n, p in model.named_parameters():
                assert p.grad.placements == p.placements, f"{engine} {n}: {p.grad.placements}"
        seen = check_grads(models, grads_of(ref), f"step {step}")
        check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
        for opt in (ref_opt, *opts.values()):
            opt.step()
            opt.zero_grad()
        check_params(models, ref, f"step {step}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shard_placement_fn_dim1(world_size: int) -> None:
    run_on_ranks(world_size, _shard_placement_fn)


def _shard_placement_uneven() -> None:
    model = _placement_model()
    with pytest.raises(ValueError, match="layers.2|lin.weight"):
        fsdp2.fully_shard(
            model.layers[2], mesh=world_mesh(), shard_placement_fn=lambda p: Shard(p.dim() - 1)
        )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shard_placement_fn_uneven_dim_raises(world_size: int) -> None:
    run_on_ranks(world_size, _shard_placement_uneven)


# ---------------------------------------------------------------------------------------------
# ignored_params


def _ignored_params() -> None:
    mesh = world_mesh()
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
        assert type(ignored) is nn.Parameter and not isinstance(ignored, DTensor), (
            f"{engine}: the ignored param is a {type(ignored).__name__}"
        )
        models[engine] = model
    x, y = make_batch(NAME, 0)
    local_loss(ref, NAME, x, y).backward()
    local_loss(local_ref, NAME, mine(x), mine(y)).backward()
    for model in models.values():
        local_loss(model, NAME, mine(x), mine(y)).backward()
    want = grads_of(ref)
    want[ignored_name] = local_ref.layers[1].lin.bias.grad  # not reduced: this rank's own
    for engine, model in models.items():
        g = model.layers[1].lin.bias.grad
        assert g is not None and not isinstance(g, DTensor), f"{engine}: {type(g)}"
    seen = check_grads(models, want, "ignored")
    check_same(seen["fsdp2"], seen["torch"], "fsdp2 vs torch")
    local_grads = [torch.empty_like(want[ignored_name]) for _ in range(dist.get_world_size())]
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
    ws = dist.get_world_size()
    mesh = world_mesh()
    ref = build("mlp")
    models = {}
    for engine, fn in ENGINES.items():
        model = build("mlp")
        fn([model.layers[0], model.layers[1]], mesh=mesh)
        fn(model.layers[2], mesh=mesh)
        models[engine] = fn(model, mesh=mesh)
    pair = shard_numel([*ref.layers[0].parameters(), *ref.layers[1].parameters()], ws)
    last = shard_numel(list(ref.layers[2].parameters()), ws)
    ref_opt = make_optimizer("adamw", ref.parameters())
    opts = {e: make_optimizer("adamw", m.parameters()) for e, m in models.items()}
    with CommCounter() as counter:
        for step in range(2):
            x, y = make_batch("mlp", step)
            local_loss(ref, "mlp", x, y).backward()
            for engine, model in models.items():
                counter.phase = "forward"
                loss = local_loss(model, "mlp", mine(x), mine(y))
                counter.phase = "backward"
                loss.backward()
                counter.phase = "?"
                calls = counter.take_calls()
                for phase in ("forward", "backward"):
                    ag = sorted(c.numel for c in calls if c.kind == "AG" and c.phase == phase)
                    want = sorted([pair, last])
                    assert ag == want, f"{engine} step {step} {phase}: all-gathers {ag}, {want}"
                rs = sorted(c.numel for c in calls if c.kind == "RS")
                assert rs == sorted([pair * ws, last * ws]), f"{engine} step {step}: RS {rs}"
            seen = check_grads(models, grads_of(ref), f"step {step}")
            check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
            for opt in (ref_opt, *opts.values()):
                opt.step()
                opt.zero_grad()
            check_params(models, ref, f"step {step}")


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
    mesh = world_mesh()
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
            F.mse_loss(model(mine(x)), mine(y)).backward()
            rs[engine] = [c.numel for c in counter.take_calls() if c.kind == "RS"]
    for engine, numels in rs.items():
        assert len(numels) == 1, f"{engine}: reduce-scatters of sizes {numels} for one group"
    seen = check_grads(models, grads_of(ref), "list group")
    check_same(seen["fsdp2"], seen["torch"], "fsdp2 vs torch")


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


@pytest.mark.parametrize(
    "register", [fsdp2.register_fsdp_forward_method, torch_register_method], ids=list(ENGINES)
)
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
