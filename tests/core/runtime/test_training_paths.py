"""fully_shard training through the paths a training loop takes, on 2 and 4 gloo ranks,
each against a plain replica (``residual_training``: loss, full gradients and parameters per
step, fp32).

Covered: a plain run, eval under ``no_grad`` between steps, a block called twice (also when
its first call's input needs no grad), activation checkpointing (reentrant and not), a block
skipped in one step, frozen parameters, gradient accumulation, ``set_requires_gradient_sync``
over microbatches.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import WORLD_SIZES, world_mesh
from models import ResidualNet
from residual_training import (
    IN,
    OUT,
    StepFn,
    _compare_training,
    _mse_step,
    _run,
    _set_checkpoint,
    _shard,
)

from fsdp2 import FSDPModule, fully_shard


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
