"""What the ResidualNet training tests share (``core/test_module_structure.py``,
``core/test_training_paths.py``, ``core/test_unshard_reshard.py``), on 2 and 4 gloo ranks.

Numbers (``helpers.train_and_compare``, fsdp2 only; ``_compare_training``): each rank trains a
sharded model, mostly ``models.ResidualNet`` (its root holds parameters on both sides of two
residual blocks; flags skip a block, call one twice or checkpoint them), on its slice of a
global batch and, in the same process, a plain replica (same seed) on the whole batch; the
initial full parameters, then per step the rank-averaged loss, the full gradients (``None``
where the replica has none) and, after AdamW, the full parameters must match in fp32.
Invariant checked throughout (``_assert_sharded_registered``): outside forward and backward
every registered parameter is the sharded DTensor the optimizer holds, or, for a group that
is not sharded, what torch's FSDP2 registers then (its unsharded parameters).

The names keep a leading underscore: they are these test modules' own helpers, imported by
name from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from helpers import mine, train_and_compare, world_mesh
from models import ResidualNet, make_batch, shard_model
from torch.distributed.tensor import DTensor

from fsdp2 import fully_shard
from fsdp2._core.support.unsharded import sharded_of

IN, D, OUT = 5, 6, 3  # ResidualNet's sizes; D=6 on 4 ranks: chunks of 2, 2, 2, 0 rows
TOL = {"rtol": 1e-5, "atol": 1e-6}  # gradients and parameters
LOSS_TOL = {"rtol": 1.3e-6, "atol": 1e-5}  # torch's defaults for fp32


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
    """Every registered parameter is an nn.Parameter(DTensor), the one in ``params``, or
    (a group that is not sharded: the root after a forward, as on torch's FSDP2) a temporary
    of that parameter's group."""
    registered = list(model.parameters())
    for name, p in model.named_parameters():
        p = sharded_of(p)
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), (
            f"{name} is registered as {type(p).__name__} outside forward/backward"
        )
    if params is not None:
        assert len(registered) == len(params)
        for (name, p), q in zip(model.named_parameters(), params, strict=True):
            assert sharded_of(p) is q, f"{name} is not the parameter object the optimizer holds"


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
    DTensor the optimizer holds, or a temporary of a group that is not sharded.
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


def _set_checkpoint(use_reentrant: bool) -> Callable[[nn.Module, int], None]:
    def set_flag(model: nn.Module, step: int) -> None:
        model.checkpoint = use_reentrant

    return set_flag
