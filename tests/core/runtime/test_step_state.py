"""The step's state machine (``StepPhase`` / ``TrainingState`` in fsdp2/_core/runtime/step.py) turns
orders of hooks fsdp2 cannot serve into clear errors, raised on every rank before any
collective, instead of silently unreduced gradients:

* a forward after a backward that raised, without ``reset_iter_state()``: that backward
  never ran its final callback, so its gradients were never reduced; the next forward
  raises ``RuntimeError`` saying to call ``reset_iter_state()``, after which training goes on
  and matches a reference that skipped the failed step;
* a backward through sharded modules while the root's forward is still running
  (``torch.autograd.grad`` inside ``forward``) raises ``RuntimeError``.

Activation-checkpoint recomputes (forwards inside backward) stay legal: see
tests/core/runtime/test_peer_behaviours.py and the activation-checkpointing tests of
tests/core/runtime/test_training_paths.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _harness import run_on_ranks
from helpers import check_close, mine, world_mesh
from models import build, full_params, local_loss, make_batch, make_optimizer, shard_model

import fsdp2

NAME = "mlp"


class _Boom(Exception):
    pass


def _boom(grad: torch.Tensor) -> None:
    raise _Boom("backward")


def _stale_backward() -> str:
    model = shard_model(build(NAME), fsdp2.fully_shard, world_mesh())
    ref = build(NAME)
    opt, ref_opt = (
        make_optimizer("sgd", model.parameters()),
        make_optimizer("sgd", ref.parameters()),
    )
    message = ""
    for step in range(3):
        x, y = make_batch(NAME, step)
        if step == 1:  # a backward that raises half-way, then the next forward
            out = model(mine(x))
            out.register_hook(_boom)
            with pytest.raises(_Boom):
                out.pow(2).mean().backward()
            with pytest.raises(RuntimeError, match="reset_iter_state") as info:
                model(mine(x))
            message = str(info.value)
            model.reset_iter_state()
            opt.zero_grad()
        local_loss(model, NAME, mine(x), mine(y)).backward()
        local_loss(ref, NAME, x, y).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    want = dict(ref.named_parameters())
    for name, got in full_params(model).items():
        check_close(got, want[name].detach(), f"{name} after the recovered step")
    return message


def test_forward_after_failed_backward_says_reset_iter_state() -> None:
    for msg in run_on_ranks(2, _stale_backward):
        assert "previous backward never finished" in msg, msg


class _GradInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_()
        h = self.inner(x)
        (g,) = torch.autograd.grad(h.sum(), x, create_graph=True)
        return self.out(h + g)


def _backward_inside_forward() -> str:
    model = _GradInForward()
    fsdp2.fully_shard(model.inner, mesh=world_mesh())
    fsdp2.fully_shard(model, mesh=world_mesh())
    try:
        model(torch.randn(2, 4))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_backward_inside_root_forward_raises() -> None:
    for msg in run_on_ranks(2, _backward_inside_forward):
        assert "while the root's forward was still running" in msg, msg
