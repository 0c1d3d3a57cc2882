"""``fsdp2.replica_optim``'s gradient pieces read by the standard tools, on HSDP 2x2.

With the optimizer sharded over the replicas each rank holds one piece of each gradient; it
is the parameter's ``.grad`` (a ``PieceGrad``), so what reads ``.grad`` gets plain HSDP's
numbers, never a silent 0 ([Note: pieces as .grad] in fsdp2/_core/replicas/piece_grad.py):

* ``torch.nn.utils.clip_grad_norm_`` (foreach and not), ``get_total_norm``, per-parameter
  norms and ``clip_grad_value_``: plain HSDP's norms (to the rounding of the sum's order),
  clipped gradients and the parameters after the step; ``full_tensor()`` of each gradient
  is plain HSDP's, bitwise; every trainable parameter has a ``.grad`` after a backward and
  none after ``zero_grad``; ``zero_grad(set_to_none=False)`` then another backward;
* fp16 with ``ShardedGradScaler`` and with ``torch.amp.GradScaler``, one rank's loss
  overflowing at one step: every rank skips that step and halves the scale, as torch's
  plain HSDP does, and the parameters end equal to plain HSDP's and torch's;
* what needs the gradient in its layout (a view, a reduction over a dim, an op with a
  tensor of another layout, pickling) raises naming the parameter and ``.whole()``;
* the same tools and refusals with torch < 2.13's rules (torch functions, not aten ops:
  DTensor's dispatch there never calls a subclass's) installed on this torch, so that the
  main suite runs them too, not only ``make compat``.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks
from helpers import hsdp_mesh
from models import build, full_grads, full_params, local_loss, make_batch, rank_slice, shard_model

import fsdp2
from fsdp2._core.replicas import piece_grad
from fsdp2._core.replicas.piece_grad import PieceGrad
from fsdp2.replica_optim import shard_over_replicas

MODEL = "transformer"


def _pair(engine: str = "fsdp2", **kw: Any) -> tuple[torch.nn.Module, Any]:
    model = build(MODEL)
    if engine == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        shard_model(model, torch_fully_shard, hsdp_mesh((2, 2)), **kw)
    else:
        shard_model(model, fsdp2.fully_shard, hsdp_mesh((2, 2)), **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)


def _backward(model: torch.nn.Module, step: int, scale: float = 1.0) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = make_batch(MODEL, step)
    loss = local_loss(model, MODEL, rank_slice(x, rank, world), rank_slice(y, rank, world))
    (loss * scale).backward()
    return loss.detach()


def _close(a: dict, b: dict, what: str, bitwise: bool = False) -> None:
    for n, v in b.items():
        if v is None:
            assert a[n] is None, f"{what}: {n}"
        elif bitwise:
            assert torch.equal(a[n], v), f"{what}: {n}"
        else:
            torch.testing.assert_close(a[n], v, rtol=1e-5, atol=1e-6, msg=f"{what}: {n}")


def _tools() -> None:
    plain, popt = _pair()
    model, opt = _pair()
    opt = shard_over_replicas(opt)
    for step in range(2):
        _backward(plain, step)
        _backward(model, step)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        assert all(isinstance(p.grad, PieceGrad) for _, p in trainable), "a .grad is missing"
        local = sum(p.to_local().numel() for _, p in trainable)
        assert sum(p.grad.to_local().numel() for _, p in trainable) <= local // 2 + len(trainable)
        _close(full_grads(model), full_grads(plain), f"step {step} full gradients", bitwise=True)
        for (_, p), q in zip(trainable, plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad.norm().full_tensor(), q.grad.norm().full_tensor())
        if step == 0:  # torch's clipping, foreach, then the clipped step
            ours = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
            assert ours.full_tensor() > 0.5, "the norm must clip here"
        else:  # per tensor (foreach=False), then clip_grad_value_ (exact: a clamp)
            grads = [p.grad for p in model.parameters()]
            ours = torch.nn.utils.get_total_norm(grads, foreach=False)
            want = torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()])
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.5, ours, foreach=False)
            torch.nn.utils.clip_grads_with_norm_(plain.parameters(), 0.5, want)
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
            torch.nn.utils.clip_grad_value_(plain.parameters(), 1e-3)
        torch.testing.assert_close(ours.full_tensor(), want.full_tensor(), rtol=1e-6, atol=0)
        _close(full_grads(model), full_grads(plain), f"step {step} clipped gradients")
        opt.step()
        popt.step()
        _close(full_params(model), full_params(plain), f"step {step} parameters")
        if step == 0:  # zeros kept as pieces, accumulated into by the next backward
            opt.zero_grad(set_to_none=False)
            popt.zero_grad(set_to_none=False)
            assert all(p.grad.to_local().abs().sum() == 0 for _, p in trainable)
        else:
            model.zero_grad()
            assert all(p.grad is None for p in model.parameters())


def test_torch_clipping_norms_and_full_tensor_equal_plain_hsdp() -> None:
    run_on_ranks(4, _tools)


def _refusals() -> list[str]:
    model, opt = _pair()
    opt = shard_over_replicas(opt)
    _backward(model, 0)
    p = model.layers[0].attn.qkv.weight
    g = p.grad
    msgs = []
    for op in (
        lambda: g.view(-1),
        lambda: g.sum(dim=0),
        lambda: g + p.detach(),
        lambda: g.mean(),
        lambda: torch.save(g, io.BytesIO()),
    ):
        try:
            op()
            msgs.append("no error")
        except RuntimeError as e:
            msgs.append(str(e))
    whole = g.whole()  # the parameter's layout: a gradient DTensor like plain HSDP's
    assert whole.placements == p.placements and whole.to_local().shape == p.to_local().shape
    assert torch.equal(whole.full_tensor(), g.full_tensor())
    return msgs


def test_what_needs_the_layout_raises_naming_the_parameter() -> None:
    for msg in run_on_ranks(4, _refusals)[0]:
        assert "layers.0.attn.qkv.weight" in msg and ".whole()" in msg, msg


def _older_torch_dispatch(cls: Any, func: Any, types: Any, args: Any = (), kw: Any = None) -> Any:
    """What an op on a PieceGrad does on torch < 2.13: DTensor's own dispatch, as if it
    were a DTensor (no rule, no PieceGrad out); an in-place op returns its input."""
    out = func(*piece_grad.tree_map(piece_grad._as_dtensor, args), **(kw or {}))
    return args[0] if piece_grad._mutates_first(func) else out


def _with_older_torch_rules(task: Any) -> Any:
    if not piece_grad.DTENSOR_SUBCLASS_DISPATCH:  # torch < 2.13: its own rules already
        return task()
    own = PieceGrad.__dict__["__torch_dispatch__"]
    PieceGrad.__torch_dispatch__ = classmethod(_older_torch_dispatch)  # type: ignore[assignment]
    PieceGrad.__torch_function__ = classmethod(piece_grad._torch_function)  # type: ignore[assignment]
    try:
        return task()
    finally:
        PieceGrad.__torch_dispatch__ = own
        del PieceGrad.__torch_function__  # DTensor's again (disabled)


def _tools_and_refusals_older_torch() -> list[str]:
    _with_older_torch_rules(_tools)
    return _with_older_torch_rules(_refusals)


def test_torch_function_rules_of_older_torch() -> None:
    """compat.DTENSOR_SUBCLASS_DISPATCH's other side, on this torch: the clipping, norms and
    step of ``_tools`` and the refusals of ``_refusals`` under the torch-function rules."""
    for msg in run_on_ranks(4, _tools_and_refusals_older_torch)[0]:
        assert "layers.0.attn.qkv.weight" in msg and ".whole()" in msg, msg


def _fp16_overflow(engine: str, pieces: bool, scaler_kind: str) -> dict[str, Any]:
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    if engine == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    model, opt = _pair(engine, mp_policy=policy)
    if pieces:
        opt = shard_over_replicas(opt)
    if scaler_kind == "sharded":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler: Any = ShardedGradScaler(device="cpu", init_scale=2.0**10)
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scales, before = [], None
    for step in range(3):
        overflow = step == 1 and dist.get_rank() == 1  # one rank's loss overflows once
        loss = _backward_scaled(model, step, scaler, 1e30 if overflow else 1.0)
        if step == 1:
            before = full_params(model)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        if step == 1:
            _close(full_params(model), before, "the overflowing step was not skipped", True)
        del loss
    return {"scales": scales, "params": full_params(model)}


def _backward_scaled(model: torch.nn.Module, step: int, scaler: Any, mul: float) -> Any:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = make_batch(MODEL, step)
    loss = local_loss(model, MODEL, rank_slice(x, rank, world), rank_slice(y, rank, world))
    scaler.scale(loss.float() * mul).backward()
    return loss.detach()


@pytest.mark.parametrize("scaler_kind", ["sharded", "amp"])
def test_grad_scaler_skips_an_overflowing_step_on_every_rank(scaler_kind: str) -> None:
    ours = run_on_ranks(4, _fp16_overflow, "fsdp2", True, scaler_kind)
    plain = run_on_ranks(4, _fp16_overflow, "fsdp2", False, scaler_kind)
    theirs = run_on_ranks(4, _fp16_overflow, "torch", False, scaler_kind)
    for rank, (a, b, c) in enumerate(zip(ours, plain, theirs, strict=True)):
        assert a["scales"] == b["scales"] == c["scales"] == [1024.0, 512.0, 512.0], (rank, a, c)
        _close(a["params"], b["params"], f"rank {rank}: vs plain HSDP", bitwise=True)
        _close(a["params"], c["params"], f"rank {rank}: vs torch's HSDP")


def _scheduler_built_before_the_wrap() -> list[float]:
    """A framework builds its LR scheduler on the optimizer it made, then the wrap: the
    scheduler drives the wrapper's learning rates, also after a ``load_state_dict``."""
    model, raw = _pair()
    sched = torch.optim.lr_scheduler.StepLR(raw, step_size=1, gamma=0.5)
    opt = shard_over_replicas(raw)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        for step in range(3):
            _backward(model, step)
            opt.step()
            opt.zero_grad()
            sched.step()
            if step == 1:
                opt.load_state_dict(opt.state_dict())
            lrs.append(opt.param_groups[0]["lr"])
    return lrs


def test_a_scheduler_built_on_the_wrapped_optimizer_drives_it() -> None:
    lrs = run_on_ranks(4, _scheduler_built_before_the_wrap)[0]
    assert lrs == [5e-3, 2.5e-3, 1.25e-3], lrs
