"""``torch.nn.utils.clip_grad_norm_`` on ``fully_shard`` models, on 4 gloo ranks, with fsdp2 and
with torch's ``fully_shard`` (the ``engine`` parameter), each against an unsharded reference
trained on the global batch (2 AdamW steps, clipping every step at a max norm below the total
norm):

* FSDP (1D mesh) and HSDP (2x2) ``tests/models.TinyTransformer``: every gradient is a DTensor on
  one mesh; the returned total norm (a DTensor; ``full_tensor()``) equals the reference's and
  the clipped full gradients and the updated parameters match;
* FSDP + TP with ``SequenceParallel`` norms (``tp_models``' ``tp_sp`` plan): every gradient is on
  the ``(dp, tp)`` mesh, same checks;
* FSDP + TP with plain norms (``tp`` plan): the norms' gradients are on ``dp``, the rest on
  ``(dp, tp)``. torch's ``clip_grad_norm_`` raises for both engines ("All operands in
  aten.stack.default must have the same mesh"), and so does ``clip_grads_with_norm_`` with one
  plain total norm ("Cannot run aten.mul.Tensor on inputs with different meshes").
  ``fsdp2.clip_grad_norm_`` (one norm per mesh, combined, then one clip per mesh)
  matches the reference for both engines.

And ``fsdp2.clip_grad_norm_(model.parameters())`` while every group keeps its unsharded
parameters registered (``set_reshard_after_backward(False)``): it clips the sharded gradients
behind them, where torch's finds none.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from helpers import ENGINES, check_close, hsdp_mesh, world_mesh
from models import build, full_grads, full_params, rank_slice, shard_model
from torch.distributed.tensor import DTensor
from tp_models import (
    build_tp_model,
    dp_rank_and_size,
    make_meshes,
    parallelize,
    tp_batch,
    tp_loss,
)

import fsdp2
from fsdp2._core.support.unsharded import sharded_of

WORLD_SIZE = 4
MAX_NORM = 0.05  # below every total norm seen here, so clipping scales


def _sharded(setup: str, engine: str) -> tuple[nn.Module, nn.Module, int, int, Callable]:
    """The reference, the sharded model, this rank's data-parallel slice and the loss."""
    fn = ENGINES[engine]
    if setup in ("fsdp", "hsdp"):
        dp_mesh = world_mesh() if setup == "fsdp" else hsdp_mesh((2, 2))
        model = shard_model(build("transformer"), fn, dp_mesh)
        return build("transformer"), model, dist.get_rank(), WORLD_SIZE, _transformer_loss
    mesh, dp_mesh, tp_mesh = make_meshes("fsdp2x2")
    plan = "tp_sp" if setup == "fsdp_tp_sp" else "tp"
    model = shard_model(parallelize(build_tp_model(), tp_mesh, plan), fn, dp_mesh)
    dp_rank, dp_size = dp_rank_and_size(mesh)
    return build_tp_model(), model, dp_rank, dp_size, _tp_step_loss


def _transformer_loss(model: nn.Module, step: int, rank: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3000 + step)
    tokens = torch.randint(0, 37, (8, 9), generator=g)
    x, y = rank_slice(tokens[:, :-1], rank, size), rank_slice(tokens[:, 1:], rank, size)
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


def _tp_step_loss(model: nn.Module, step: int, rank: int, size: int) -> torch.Tensor:
    x, y = tp_batch(step)
    return tp_loss(model, rank_slice(x, rank, size), rank_slice(y, rank, size))


def _clip(setup: str, engine: str) -> None:
    ref, model, dp_rank, dp_size, loss_fn = _sharded(setup, engine)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mixed_meshes = setup == "fsdp_tp"
    for step in range(2):
        loss_fn(ref, step, 0, 1).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        assert ref_norm > MAX_NORM, f"step {step}: norm {ref_norm} too small to test clipping"
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        loss_fn(model, step, dp_rank, dp_size).backward()
        params = list(model.parameters())
        if mixed_meshes:
            with pytest.raises(RuntimeError, match="must have the same mesh"):
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            # A plain total norm does not help: one foreach op cannot mix meshes either
            # (max_norm far above it: even a partial scaling would multiply by 1).
            with pytest.raises(RuntimeError, match="different mesh"):  # "meshes" from 2.13
                torch.nn.utils.clip_grads_with_norm_(params, 1e6, torch.tensor(1.0))
            norm = fsdp2.clip_grad_norm_(params, MAX_NORM)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            assert isinstance(norm, DTensor), f"total norm is a {type(norm).__name__}"
            norm = norm.full_tensor()
        check_close(norm, ref_norm, f"step {step} total norm")
        for name, grad in full_grads(model).items():
            check_close(grad, ref_grads[name], f"step {step} clipped grad {name}")
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        ref_params = dict(ref.named_parameters())
        for name, full in full_params(model).items():
            check_close(full, ref_params[name].detach(), f"step {step} param {name}")


@pytest.mark.parametrize("setup", ["fsdp", "hsdp", "fsdp_tp_sp", "fsdp_tp"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_clip_grad_norm(engine: str, setup: str) -> None:
    run_on_ranks(WORLD_SIZE, _clip, setup, engine)


def _clip_while_unsharded() -> dict[str, float]:
    """``set_reshard_after_backward(False)`` on every module: after the backward every group
    keeps its unsharded parameters registered (as on torch's FSDP2), which have no gradient
    (it was reduced into the sharded parameters)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = build("mlp_head")
    torch.manual_seed(0)
    model = shard_model(build("mlp_head"), fsdp2.fully_shard, world_mesh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # before any forward: the sharded ones
    model.set_reshard_after_backward(False)
    x = torch.randn(8, 7, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 2, generator=torch.Generator().manual_seed(2))
    F.mse_loss(ref(x), y).backward()
    F.mse_loss(model(rank_slice(x, rank, size)), rank_slice(y, rank, size)).backward()
    registered = list(model.parameters())
    assert not any(isinstance(p, DTensor) for p in registered), "all registered unsharded"
    assert all(p.grad is None for p in registered)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    norm = fsdp2.clip_grad_norm_(registered, MAX_NORM)
    check_close(norm, ref_norm, "total norm")
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = sharded_of(p).grad
        assert isinstance(grad, DTensor), name
        check_close(grad.full_tensor(), refs[name].grad, f"clipped grad {name}")
    opt.step()
    return {"torch": float(torch.nn.utils.clip_grad_norm_(registered, MAX_NORM))}


def test_fsdp2_clip_while_unsharded() -> None:
    """``fsdp2.clip_grad_norm_(model.parameters())`` clips the sharded gradients behind the
    registered unsharded parameters; torch's finds no gradient there (norm 0)."""
    out = run_on_ranks(2, _clip_while_unsharded)
    assert out[0]["torch"] == 0.0, out
