"""Unsharding and resharding, by hand and by setting, on 2 and 4 gloo ranks, against a
plain replica (``residual_training``).

Covered: manual and async ``unshard``/``reshard`` (an async handle waited by hand or by the
forward), ``register_fsdp_forward_method``, ``reshard_after_forward`` as ``False`` or an int
(also with activation checkpointing; a forward without backward leaves an int copy the next
forward must not reuse once the parameters changed), ``set_post_optim_event`` on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from helpers import WORLD_SIZES, check_grads, grads_of, mine, world_mesh
from models import ResidualNet
from residual_training import (
    IN,
    OUT,
    TOL,
    D,
    _assert_sharded_registered,
    _batch,
    _compare_training,
    _mse_step,
    _run,
    _set_checkpoint,
    _shard,
    _shard_net,
)
from torch.distributed.tensor import DTensor

from fsdp2 import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method


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


def _nested_forward_method() -> None:
    # Regression: a registered method that calls the module's own forward (Hugging Face's
    # generate on the root, as accelerate and TRL register it) ended the forward inside;
    # the method's own end then raised "end of forward ... while it is in idle".
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

    mesh = world_mesh()
    torch.manual_seed(0)
    ref = ResidualNet()
    torch.manual_seed(0)
    model = _shard_net(ResidualNet(), mesh)
    torch.manual_seed(0)
    theirs = ResidualNet()
    for block in theirs.layers:
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(theirs, mesh=mesh)
    params = list(model.parameters())
    register_fsdp_forward_method(model, "decode")
    torch_register(theirs, "decode")
    x = mine(_batch(0)[0])
    with torch.no_grad():
        for _ in range(2):
            want = ref.decode(x)
            torch.testing.assert_close(model.decode(x), want)
            torch.testing.assert_close(theirs.decode(x), want)
    _assert_sharded_registered(model, params)
    for _ in range(2):  # with grad, twice: the gradients are averaged and sharded
        for m in (model, theirs):
            m.zero_grad()
            m.decode(x).sum().backward()
        ref.zero_grad()
        ref.decode(_batch(0)[0]).sum().div(dist.get_world_size()).backward()
        _assert_sharded_registered(model, params)
        check_grads({"fsdp2": model, "torch": theirs}, grads_of(ref), "decode", **TOL)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_register_fsdp_forward_method_calling_forward(world_size: int) -> None:
    _run(world_size, _nested_forward_method)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_register_fsdp_forward_method(world_size: int) -> None:
    _run(world_size, _forward_method)


def _reshard_after_forward(value: bool | int) -> None:
    _compare_training(ResidualNet, lambda m: _shard(m, reshard_after_forward=value))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("value", [False, 2], ids=["False", "int2"])
def test_reshard_after_forward(value: bool | int, world_size: int) -> None:
    _run(world_size, _reshard_after_forward, value)


def _small_copy_not_reused() -> None:
    mesh = world_mesh()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, D), nn.Linear(D, OUT))
    fully_shard(model[0], mesh=mesh, reshard_after_forward=2)
    fully_shard(model, mesh=mesh)
    x = torch.ones(2, IN)
    model(x)  # grad-enabled forward, no backward: model[0] keeps a 2-rank copy
    # torch's contract: to modify the parameters between forward and backward, reshard first
    # (the root keeps its unsharded parameters registered, model[0] the 2-rank copy)
    model[0].reshard()
    model.reshard()
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
