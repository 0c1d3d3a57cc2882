"""Checks fully_shard's behaviour over training steps on 2 and 4 gloo ranks.

Structure: the class swap, slicing a sharded ``nn.Sequential``, the default mesh, buffers.
Invariants: unsharded parameters keep their identity across steps; outside forward and
backward every registered parameter is the sharded DTensor the optimizer holds.
Numbers (``helpers.train_and_compare``, fsdp2 only): each rank trains a sharded model, mostly
``models.ResidualNet`` (its root holds parameters on both sides of two residual blocks; flags
skip a block, call one twice or checkpoint them), on its slice of a global batch and, in the
same process, a plain replica (same seed) on the whole batch; the initial full parameters,
then per step the rank-averaged loss, the full gradients (``None`` where the replica has
none) and, after AdamW, the full parameters must match in fp32. Covered: eval under
``no_grad`` between steps, a block called twice, activation checkpointing (reentrant and
not), a block skipped in one step, frozen parameters, gradient accumulation,
``set_requires_gradient_sync``, manual and async ``unshard``/``reshard``,
``register_fsdp_forward_method``, the list form of ``fully_shard`` and
``reshard_after_forward`` as ``False`` or an int.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from helpers import WORLD_SIZES, check_grads, grads_of, mine, train_and_compare, world_mesh
from models import ResidualBlock, ResidualNet, make_batch, shard_model
from torch.distributed.tensor import DTensor, Shard

from fsdp2 import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method

IN, D, OUT = 5, 6, 3  # ResidualNet's sizes; D=6 on 4 ranks: chunks of 2, 2, 2, 0 rows
TOL = {"rtol": 1e-5, "atol": 1e-6}  # gradients and parameters
LOSS_TOL = {"rtol": 1.3e-6, "atol": 1e-5}  # torch's defaults for fp32


class Scaled(nn.Module):
    """A Linear next to a persistent and a non-persistent buffer used in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(IN, OUT)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, OUT))
        self.register_buffer("shift", torch.full((OUT,), 0.25), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + self.shift


# ---------------------------------------------------------------------------------------------
# Helpers


def _shard_net(model: ResidualNet, mesh=None, **kwargs: Any) -> ResidualNet:
    """Every block with ``kwargs``, then the root with the defaults."""
    return shard_model(model, fully_shard, mesh, root_kwargs={}, **kwargs)


def _shard(model: ResidualNet, **kwargs: Any) -> ResidualNet:
    """``_shard_net`` on the 1D mesh over every rank."""
    return _shard_net(model, world_mesh(), **kwargs)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: 8 rows of ``IN`` features, ``OUT`` targets."""
    return make_batch("residual", step)


def _assert_sharded_registered(model: nn.Module, params: list[nn.Parameter] | None) -> None:
    """Every registered parameter is an nn.Parameter(DTensor), the one in ``params``."""
    registered = list(model.parameters())
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), (
            f"{name} is registered as {type(p).__name__} outside forward/backward"
        )
    if params is not None:
        assert len(registered) == len(params)
        for (name, p), q in zip(model.named_parameters(), params, strict=True):
            assert p is q, f"{name} is not the parameter object the optimizer holds"


def _mse_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.detach()


StepFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _compare_training(
    build: Callable[[], nn.Module],
    shard: Callable[[nn.Module], Any],
    step_fn: StepFn = _mse_step,
    *,
    steps: int = 3,
    before_step: Callable[[nn.Module, int], None] | None = None,
    eval_each_step: bool = False,
) -> None:
    """Train a sharded model and a plain replica side by side (``helpers.train_and_compare``:
    initial parameters, then per step loss, gradients and parameters).

    ``step_fn`` runs forward and backward and returns the loss (a mean over the rows it saw);
    ``before_step(model, step)`` sets per-step flags on both models; with ``eval_each_step``
    a ``no_grad`` forward on this rank's slice precedes each step and must match the
    replica's. Outside forward and backward, every registered parameter must be the sharded
    DTensor the optimizer holds.
    """
    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    model = build()
    shard(model)
    params = list(model.parameters())

    def before(step: int, x: torch.Tensor, y: torch.Tensor) -> None:
        if before_step is not None:
            before_step(ref, step)
            before_step(model, step)
        if eval_each_step:
            with torch.no_grad():
                got = model(mine(x))
                want = ref(mine(x))
            torch.testing.assert_close(got, want, msg=lambda m: f"step {step} eval: {m}")
            _assert_sharded_registered(model, params)

    train_and_compare(
        ref,
        {"fsdp2": model},
        batch=_batch,
        forward_backward=step_fn,
        steps=steps,
        tol=TOL,
        loss_tol=LOSS_TOL,
        check_init=True,
        before_step=before,
        invariant=lambda key, m, ps: _assert_sharded_registered(m, ps),
    )


def _run(world_size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    return run_on_ranks(world_size, fn, *args, timeout=120.0)


# ---------------------------------------------------------------------------------------------
# Structure


def _class_swap() -> None:
    mesh = world_mesh()
    model = ResidualNet()
    fully_shard(model.inp, mesh=mesh)
    fully_shard(model.out, mesh=mesh)
    _shard_net(model, mesh)
    assert type(model.inp).__name__ == "FSDPLinear"
    assert isinstance(model.inp, nn.Linear) and isinstance(model.inp, FSDPModule)
    assert type(model.inp) is type(model.out), "two Linear modules must share one FSDP class"
    assert type(model.layers[0]) is type(model.layers[1])
    assert type(model.layers[0]).__name__ == "FSDPResidualBlock"
    assert isinstance(model.layers[0], ResidualBlock)
    assert type(model).__name__ == "FSDPResidualNet" and isinstance(model, ResidualNet)
    assert type(model.layers[0].lin1) is nn.Linear, "submodules are not swapped"
    assert type(model.layers) is nn.ModuleList


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_class_swap(world_size: int) -> None:
    _run(world_size, _class_swap)


def _sequential_slicing() -> None:
    mesh = world_mesh()
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(IN, D), nn.Tanh(), nn.Linear(D, OUT))
    ref = nn.Sequential(nn.Linear(IN, D), nn.Tanh(), nn.Linear(D, OUT))
    ref.load_state_dict(seq.state_dict())
    fully_shard(seq[0], mesh=mesh)
    fully_shard(seq[2], mesh=mesh)
    fully_shard(seq, mesh=mesh)
    assert type(seq).__name__ == "FSDPSequential" and len(seq) == 3
    first = seq[0]
    assert type(first).__name__ == "FSDPLinear"
    head = seq[0:2]
    assert type(head) is nn.Sequential, f"slicing gave {type(head).__name__}"
    assert len(head) == 2 and head[0] is seq[0] and head[1] is seq[1]
    assert list(seq[-2:]) == [seq[1], seq[2]]
    x = mine(_batch(0)[0])
    with torch.no_grad():
        torch.testing.assert_close(seq(x), ref(x))
    _assert_sharded_registered(seq, None)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sequential_slicing(world_size: int) -> None:
    _run(world_size, _sequential_slicing)


def _default_mesh() -> None:
    torch.manual_seed(0)
    model = ResidualNet()
    orig = {n: p.detach().clone() for n, p in model.named_parameters()}
    _shard_net(model)  # mesh=None everywhere
    ws = dist.get_world_size()
    for name, p in model.named_parameters():
        mesh = p.device_mesh
        assert mesh.ndim == 1 and mesh.size() == ws and mesh.device_type == "cpu", name
        assert mesh.mesh.tolist() == list(range(ws)), name
        assert tuple(p.placements) == (Shard(0),), name
        torch.testing.assert_close(p.full_tensor(), orig[name], rtol=0, atol=0)
    model(torch.randn(2, IN)).sum().backward()
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_default_mesh(world_size: int) -> None:
    _run(world_size, _default_mesh)


def _buffers() -> None:
    mesh = world_mesh()
    torch.manual_seed(0)
    probe = Scaled()
    fully_shard(probe, mesh=mesh)
    for name, buf in probe.named_buffers():
        assert not isinstance(buf, DTensor), f"buffer {name} became a DTensor"
        assert buf.device.type == "cpu"
    torch.testing.assert_close(probe.scale, torch.linspace(0.5, 1.5, OUT), rtol=0, atol=0)
    torch.testing.assert_close(probe.shift, torch.full((OUT,), 0.25), rtol=0, atol=0)
    assert "scale" in probe.state_dict() and "shift" not in probe.state_dict()
    _compare_training(Scaled, lambda m: fully_shard(m, mesh=mesh))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_buffers_unsharded_and_used(world_size: int) -> None:
    _run(world_size, _buffers)


# ---------------------------------------------------------------------------------------------
# Invariants


def _unsharded_identity() -> None:
    mesh = world_mesh()
    torch.manual_seed(0)
    model = _shard_net(ResidualNet(), mesh)
    seen: dict[str, list[tuple[int, bool, tuple[int, ...]]]] = {}

    def record(key: str, module: nn.Module) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any) -> None:
            for pname, p in module.named_parameters():
                seen.setdefault(f"{key}.{pname}", []).append(
                    (id(p), isinstance(p, DTensor), tuple(p.shape))
                )

        return hook

    # Registered after fully_shard: runs after fsdp2's pre-forward (which is prepended).
    model.layers[0].register_forward_pre_hook(record("layers.0", model.layers[0]))
    model.layers[1].lin1.register_forward_pre_hook(record("layers.1.lin1", model.layers[1].lin1))
    model.inp.register_forward_pre_hook(record("inp", model.inp))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = _batch(step)
        F.mse_loss(model(mine(x)), mine(y)).backward()
        opt.step()
        opt.zero_grad()
    assert set(seen) >= {"layers.0.lin1.weight", "layers.1.lin1.bias", "inp.weight"}
    full_shapes = {n: tuple(p.shape) for n, p in ResidualNet().named_parameters()}
    for key, records in seen.items():
        assert len(records) == 3, key
        ids = {r[0] for r in records}
        assert len(ids) == 1, f"{key}: unsharded parameter changed identity across steps"
        assert not any(r[1] for r in records), f"{key}: a DTensor was registered in forward"
        assert records[0][2] == full_shapes[key], f"{key}: shape {records[0][2]} in forward"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_unsharded_param_identity_stable(world_size: int) -> None:
    _run(world_size, _unsharded_identity)


def _registered_are_optimizer_params() -> None:
    mesh = world_mesh()
    torch.manual_seed(0)
    model = _shard_net(ResidualNet(), mesh)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    opt_params = opt.param_groups[0]["params"]
    assert all(p is q for p, q in zip(params, opt_params, strict=True))
    for step in range(3):
        _assert_sharded_registered(model, params)
        x, y = _batch(step)
        loss = F.mse_loss(model(mine(x)), mine(y))
        # Between forward and backward: blocks resharded (default True); the root keeps
        # its unsharded parameters for backward (default False for the root).
        for block in model.layers:
            _assert_sharded_registered(block, None)
        assert not isinstance(model.inp.weight, DTensor)
        loss.backward()
        _assert_sharded_registered(model, params)
        for p in params:
            assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements
            assert p.grad.shape == p.shape
        opt.step()
        opt.zero_grad()
    _assert_sharded_registered(model, opt.param_groups[0]["params"])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_registered_params_are_optimizer_params(world_size: int) -> None:
    _run(world_size, _registered_are_optimizer_params)


# ---------------------------------------------------------------------------------------------
# Parity with a replica


def _parity_default() -> None:
    _compare_training(ResidualNet, _shard)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_parity_plain(world_size: int) -> None:
    _run(world_size, _parity_default)


def _eval_then_train() -> None:
    _compare_training(ResidualNet, _shard, eval_each_step=True)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_no_grad_eval_then_train(world_size: int) -> None:
    _run(world_size, _eval_then_train)


def _reuse(model: nn.Module, step: int) -> None:
    model.reuse_first = True


def _weight_reuse() -> None:
    _compare_training(ResidualNet, _shard, before_step=_reuse)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_module_called_twice(world_size: int) -> None:
    _run(world_size, _weight_reuse)


class _SquaredWeight(nn.Module):
    """``x @ w**2``: the weight's own gradient needs the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(IN, IN) / IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.w * self.w)


class _ReuseWithoutGradInput(nn.Module):
    """``a`` runs twice: first on the raw input (no grad needed, so no post-backward
    node), then on an activation. Backward must gather ``a`` again after the second
    call's post-backward resharded it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = _SquaredWeight()
        self.b = nn.Linear(IN, IN)
        self.out = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.a(self.b(self.a(x))))


def _reuse_without_grad_input() -> None:
    def shard(m: nn.Module) -> None:
        mesh = world_mesh()
        fully_shard(m.a, mesh=mesh)
        fully_shard(m.b, mesh=mesh)
        fully_shard(m, mesh=mesh)

    _compare_training(_ReuseWithoutGradInput, shard)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_module_called_twice_first_input_without_grad(world_size: int) -> None:
    _run(world_size, _reuse_without_grad_input)


def _small_copy_not_reused() -> None:
    mesh = world_mesh()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, D), nn.Linear(D, OUT))
    fully_shard(model[0], mesh=mesh, reshard_after_forward=2)
    fully_shard(model, mesh=mesh)
    x = torch.ones(2, IN)
    model(x)  # grad-enabled forward, no backward: model[0] keeps a 2-rank copy
    model.reshard()  # the root keeps its params after forward; register its shards
    with torch.no_grad():
        for p in model[0].parameters():
            p.to_local().add_(1.0)
    w0, b0, w1, b1 = (p.full_tensor() for p in model.parameters())
    want = F.linear(F.linear(x, w0, b0), w1, b1)
    torch.testing.assert_close(model(x), want)


def test_int_reshard_copy_not_reused_after_params_change() -> None:
    """A forward without backward leaves a reshard_after_forward=int copy; the next
    forward must gather the current shards, not that copy."""
    _run(4, _small_copy_not_reused)


def _set_checkpoint(use_reentrant: bool) -> Callable[[nn.Module, int], None]:
    def set_flag(model: nn.Module, step: int) -> None:
        model.checkpoint = use_reentrant

    return set_flag


def _activation_checkpointing(use_reentrant: bool) -> None:
    _compare_training(
        ResidualNet,
        _shard,
        before_step=_set_checkpoint(use_reentrant),
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_activation_checkpointing(use_reentrant: bool, world_size: int) -> None:
    _run(world_size, _activation_checkpointing, use_reentrant)


def _skip_second_block_at_step_1(model: nn.Module, step: int) -> None:
    model.skip = 1 if step == 1 else None


def _unused_block() -> None:
    # _compare_training checks that layers.1's grads are None at step 1 like the replica's.
    _compare_training(
        lambda: ResidualNet(n_layers=3),
        _shard,
        before_step=_skip_second_block_at_step_1,
        steps=3,
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_unused_block_gets_no_grad(world_size: int) -> None:
    _run(world_size, _unused_block)


def _frozen_net(which: str) -> Callable[[], ResidualNet]:
    def build() -> ResidualNet:
        model = ResidualNet()
        frozen = model.layers[0].lin1 if which == "one_linear" else model.layers[1]
        frozen.requires_grad_(False)
        return model

    return build


def _frozen(which: str) -> None:
    _compare_training(_frozen_net(which), _shard)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("which", ["one_linear", "whole_block"])
def test_frozen_params(which: str, world_size: int) -> None:
    _run(world_size, _frozen, which)


def _two_backwards(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    total = torch.zeros(())
    for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True):  # no zero_grad in between: grads add up
        loss = F.mse_loss(model(xm), ym)
        loss.backward()
        total += loss.detach()
    return total


def _grad_accumulation() -> None:
    _compare_training(ResidualNet, _shard, _two_backwards)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gradient_accumulation(world_size: int) -> None:
    _run(world_size, _grad_accumulation)


def _microbatches(k: int) -> StepFn:
    def step_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not isinstance(model, FSDPModule):  # the replica: one big batch
            return _mse_step(model, x, y)
        total = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k), strict=True)):
            last = i == k - 1
            model.set_requires_gradient_sync(last)
            loss = F.mse_loss(model(xm), ym) / k
            loss.backward()
            total += loss.detach()
            if not last:
                assert all(p.grad is None for p in model.parameters()), (
                    "a backward without gradient sync landed sharded gradients"
                )
        return total

    return step_fn


def _no_sync(k: int) -> None:
    _compare_training(ResidualNet, _shard, _microbatches(k))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("k", [2])
def test_requires_gradient_sync_microbatches(k: int, world_size: int) -> None:
    _run(world_size, _no_sync, k)


def _net_math(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """ResidualNet's forward written with the registered tensors, no module calls."""
    h = F.linear(x, model.inp.weight, model.inp.bias)
    for b in model.layers:
        a = torch.tanh(F.linear(h, b.lin1.weight, b.lin1.bias))
        h = h + F.linear(a, b.lin2.weight, b.lin2.bias)
    return F.linear(h, model.out.weight, model.out.bias)


def _unshard_reshard() -> None:
    _compare_training(ResidualNet, _shard, _manual_unshard_checked)


def _manual_unshard_checked(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if isinstance(model, FSDPModule):
        fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        params = list(model.parameters())
        model.unshard()  # not recursive: only the root's own parameters
        assert not isinstance(model.inp.weight, DTensor)
        assert tuple(model.inp.weight.shape) == (D, IN)
        assert isinstance(model.layers[0].lin1.weight, DTensor)
        for m in fsdp_modules:
            m.unshard()
        assert not any(isinstance(p, DTensor) for p in model.parameters())
        with torch.no_grad():
            manual = _net_math(model, x)
        for m in fsdp_modules:
            m.reshard()
        _assert_sharded_registered(model, params)
        with torch.no_grad():
            torch.testing.assert_close(manual, model(x))  # the hooks gather the same values
        _assert_sharded_registered(model, params)
    return _mse_step(model, x, y)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_unshard_manual_forward_reshard(world_size: int) -> None:
    _run(world_size, _unshard_reshard)


def _async_unshard() -> None:
    mesh = world_mesh()
    torch.manual_seed(0)
    model = _shard_net(ResidualNet(), mesh)
    torch.manual_seed(0)
    full = {n: p.detach().clone() for n, p in ResidualNet().named_parameters()}
    block = model.layers[0]
    params = list(model.parameters())
    handle = block.unshard(async_op=True)
    assert isinstance(handle, UnshardHandle)
    handle.wait()
    handle.wait()  # idempotent
    for name, p in block.named_parameters():
        assert not isinstance(p, DTensor), f"layers.0.{name} still sharded after wait()"
        torch.testing.assert_close(p.detach(), full[f"layers.0.{name}"], rtol=0, atol=0)
    assert block.unshard() is None
    block.reshard()
    _assert_sharded_registered(model, params)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_unshard_async_handle(world_size: int) -> None:
    _run(world_size, _async_unshard)


def _prefetch_all_then_forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if isinstance(model, FSDPModule):
        handles = [b.unshard(async_op=True) for b in model.layers]  # waited by their forward
        assert all(isinstance(h, UnshardHandle) for h in handles)
    return _mse_step(model, x, y)


def _async_unshard_training() -> None:
    _compare_training(ResidualNet, _shard, _prefetch_all_then_forward)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_unshard_async_waited_by_forward(world_size: int) -> None:
    _run(world_size, _async_unshard_training)


def _forward_method() -> None:
    mesh = world_mesh()
    torch.manual_seed(0)
    ref = ResidualNet()
    torch.manual_seed(0)
    model = _shard_net(ResidualNet(), mesh)
    params = list(model.parameters())
    register_fsdp_forward_method(model, "generate")
    register_fsdp_forward_method(ref, "generate")  # a no-op on plain modules
    assert isinstance(model.inp.weight, DTensor)
    x = mine(_batch(0)[0])
    with torch.no_grad():
        torch.testing.assert_close(model.generate(x), ref.generate(x))
    _assert_sharded_registered(model, params)
    # With grad: gradients of the root's parameters come back sharded and averaged.
    model.generate(x).sum().backward()
    ref.generate(_batch(0)[0]).sum().div(dist.get_world_size()).backward()
    _assert_sharded_registered(model, params)
    check_grads({"fsdp2": model}, grads_of(ref), "generate", **TOL)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_register_fsdp_forward_method(world_size: int) -> None:
    _run(world_size, _forward_method)


def _shard_as_list(model: ResidualNet) -> None:
    mesh = world_mesh()
    blocks = [model.layers[0], model.layers[1]]
    out = fully_shard(blocks, mesh=mesh)
    assert out == blocks and all(a is b for a, b in zip(out, blocks, strict=True))
    assert all(
        isinstance(b, FSDPModule) and type(b).__name__ == "FSDPResidualBlock" for b in blocks
    )
    fully_shard(model, mesh=mesh)


def _list_form() -> None:
    _compare_training(ResidualNet, _shard_as_list)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fully_shard_list_form(world_size: int) -> None:
    _run(world_size, _list_form)


def _reshard_after_forward(value: bool | int) -> None:
    _compare_training(ResidualNet, lambda m: _shard(m, reshard_after_forward=value))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("value", [False, 2], ids=["False", "int2"])
def test_reshard_after_forward(value: bool | int, world_size: int) -> None:
    _run(world_size, _reshard_after_forward, value)


def _reshard_int_checkpointed() -> None:
    _compare_training(
        ResidualNet,
        lambda m: _shard(m, reshard_after_forward=2),
        before_step=_set_checkpoint(False),
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reshard_after_forward_int_with_checkpointing(world_size: int) -> None:
    _run(world_size, _reshard_int_checkpointed)


def _post_optim_event_on_cpu() -> None:
    # On CPU there is no stream to order: the event (a CPU torch.Event cannot even be
    # recorded) is dropped at the next forward, which trains as usual.
    def set_event(model: nn.Module, step: int) -> None:
        if isinstance(model, FSDPModule):  # not the replica
            model.set_post_optim_event(torch.Event(device="cpu"))

    _compare_training(ResidualNet, _shard, before_step=set_event)


@pytest.mark.parametrize("world_size", [2])
def test_post_optim_event_on_cpu_is_dropped(world_size: int) -> None:
    _run(world_size, _post_optim_event_on_cpu)
