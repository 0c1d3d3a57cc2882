"""``fsdp2.optim.step_on_local_shards``: an optimizer over ``fully_shard`` parameters stepping
the local shards as plain tensors, on 2 gloo ranks (and 1 and 4 for checkpoints).

* Numbers: for every elementwise ``torch.optim`` class (and foreach / fused / amsgrad /
  nesterov / maximize variants), 2 steps of ``TinyTransformer`` (tied weight, uneven shards;
  the second steps with the state the first made) with the local step equal bitwise, loss
  by loss and parameter by parameter, those of the same optimizer stepping the DTensors
  (fsdp2 and torch's ``fully_shard``), and are close to an unsharded reference on the
  global batch. ``Rprop`` cannot step DTensors at all in torch 2.13 (its boolean-mask
  ``index_put_``); on local shards it works and matches the reference.
  Also with HSDP (2x2), a frozen parameter, a plain (unsharded) parameter in the optimizer,
  ``zero_grad(set_to_none=False)``, a closure, and an LR scheduler made before or after the
  call.
* State: between steps ``optim.state`` holds DTensors sharded like their parameter (the
  parameter's spec) and plain scalar ``step`` tensors, as stepping DTensors does; the step's
  local views hold no gradient afterwards. ``torch.distributed.checkpoint`` saves it at 2 ranks
  and loads it at 1 and 4 (full state equal to the saved one), and training resumes equal to
  an optimizer stepping DTensors loaded from the same checkpoint.
* Errors: a non-elementwise optimizer (``LBFGS``, ``Adafactor``, an unknown class) is refused
  with ``TypeError`` unless ``elementwise=True``; optimizer state that is a plain full tensor
  (a full state dict loaded as is) raises ``ValueError`` naming the parameter before any
  change; an error inside the step (a pre-hook raising) leaves the optimizer holding its
  DTensor parameters and state.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _harness import run_on_ranks
from helpers import ENGINES, check_close, check_same, hsdp_mesh, world_mesh
from models import (
    build,
    full_params,
    full_value,
    local_loss,
    make_batch,
    mean_over_ranks,
    rank_slice,
    shard_model,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2.optim import step_on_local_shards

MODEL = "transformer"
STEPS = 3
TOL = {"atol": 2e-5, "rtol": 2e-5}

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam_amsgrad_maximize": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, maximize=True),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, decoupled_weight_decay=True),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-3),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=1),
}


def _models(mesh: Any) -> dict[str, nn.Module]:
    """The unsharded reference and three sharded copies: fsdp2 stepping local shards, fsdp2
    and torch's engine stepping DTensors."""
    return {
        "ref": build(MODEL),
        "local": shard_model(build(MODEL), fsdp2.fully_shard, mesh),
        "fsdp2": shard_model(build(MODEL), fsdp2.fully_shard, mesh),
        "torch": shard_model(build(MODEL), ENGINES["torch"], mesh),
    }


def _train(
    models: dict[str, nn.Module],
    opts: dict[str, torch.optim.Optimizer],
    dp: tuple[int, int],
    what: str,
    steps: int = STEPS,
    first: int = 0,
    closure: bool = False,
    set_to_none: bool = True,
) -> None:
    """Train all models side by side; the sharded ones must agree bitwise, and with ``ref``
    (if given) within ``TOL``."""
    rank, size = dp
    for step in range(first, first + steps):
        x, y = make_batch(MODEL, step)
        losses: dict[str, torch.Tensor] = {}
        for key, model in models.items():
            xs, ys = (
                (x, y) if key == "ref" else (rank_slice(x, rank, size), rank_slice(y, rank, size))
            )

            def fwd_bwd(model: nn.Module = model, xs: Any = xs, ys: Any = ys) -> torch.Tensor:
                loss = local_loss(model, MODEL, xs, ys)
                loss.backward()
                return loss

            if closure:
                loss = opts[key].step(fwd_bwd)
            else:
                loss = fwd_bwd()
                opts[key].step()
            opts[key].zero_grad(set_to_none=set_to_none)
            losses[key] = loss.detach() if key == "ref" else mean_over_ranks(loss)
        sharded = [k for k in models if k != "ref"]
        fulls = {k: full_params(models[k]) for k in sharded}
        for k in sharded[1:]:
            check_same(
                {"loss": losses[k], **fulls[k]},
                {"loss": losses[sharded[0]], **fulls[sharded[0]]},
                f"{what} step {step}: {k} vs {sharded[0]}",
                bitwise=True,
            )
        if "ref" in models:
            check_close(losses[sharded[0]], losses["ref"], f"{what} step {step} loss", **TOL)
            for n, p in models["ref"].named_parameters():
                check_close(fulls[sharded[0]][n], p.detach(), f"{what} step {step} {n}", **TOL)


def _check_state(model: nn.Module, opt: torch.optim.Optimizer, what: str) -> None:
    for p in model.parameters():
        assert p._local_tensor.grad is None, f"{what}: a local view kept a gradient"
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert isinstance(value, DTensor), f"{what}: state {key} is {type(value)}"
                assert value.placements == p.placements, f"{what}: state {key} placements"
                assert value.shape == p.shape, f"{what}: state {key} shape"


# Stepping DTensors fails in torch for these ("aten.index_put_.default: in-place operations
# that require placement changes are not supported"); the local step is checked against the
# reference only.
DTENSOR_FAILS = {"rprop"}


def _every_optimizer() -> None:
    for name, make in OPTIMIZERS.items():
        models = _models(world_mesh())
        if name in DTENSOR_FAILS:
            models = {k: models[k] for k in ("ref", "local")}
        opts = {k: make(m.parameters()) for k, m in models.items()}
        step_on_local_shards(opts["local"])
        _train(models, opts, (dist.get_rank(), dist.get_world_size()), name, steps=2)
        _check_state(models["local"], opts["local"], name)
        if name in DTENSOR_FAILS:
            continue
        for p, q in zip(models["local"].parameters(), models["fsdp2"].parameters(), strict=True):
            for key, value in opts["fsdp2"].state[q].items():
                check_same(
                    {key: full_value(opts["local"].state[p][key])},
                    {key: full_value(value)},
                    f"{name} state",
                    bitwise=True,
                )


def test_every_elementwise_optimizer() -> None:
    run_on_ranks(2, _every_optimizer)


def _hsdp_frozen_plain_scheduler(order: str) -> None:
    """HSDP 2x2, a frozen block, a plain extra parameter, a scheduler, zero_grad to zeros."""
    mesh = hsdp_mesh((2, 2))
    models = {
        "ref": build(MODEL),
        "local": shard_model(build(MODEL), fsdp2.fully_shard, mesh),
        "fsdp2": shard_model(build(MODEL), fsdp2.fully_shard, mesh),
    }
    extra = {k: nn.Parameter(torch.full((3,), 0.5)) for k in models}
    for model in models.values():
        model.layers[0].requires_grad_(False)
    opts, scheds = {}, {}
    for k, model in models.items():
        params = [p for p in model.parameters() if p.requires_grad]
        opts[k] = torch.optim.AdamW(
            [{"params": params}, {"params": [extra[k]], "weight_decay": 0.0}], lr=1e-2
        )
        if k == "local" and order == "wrap_first":
            step_on_local_shards(opts[k])
        scheds[k] = torch.optim.lr_scheduler.StepLR(opts[k], step_size=1, gamma=0.5)
        if k == "local" and order == "scheduler_first":
            step_on_local_shards(opts[k])
    rank = dist.get_rank()
    dp = (rank, 4)  # every rank its own slice: HSDP averages all four
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for step in range(STEPS):

            def train(model: nn.Module, k: str, step: int = step) -> None:
                x, y = make_batch(MODEL, step)
                if k != "ref":
                    x, y = rank_slice(x, *dp), rank_slice(y, *dp)
                (local_loss(model, MODEL, x, y) + extra[k].sum() * 0.1).backward()

            for k, model in models.items():
                train(model, k)
                opts[k].step()
                opts[k].zero_grad(set_to_none=False)
                scheds[k].step()
            check_same(
                full_params(models["local"]),
                full_params(models["fsdp2"]),
                f"{order} step {step}",
                bitwise=True,
            )
            check_same(
                {"extra": extra["local"].detach()},
                {"extra": extra["fsdp2"].detach()},
                f"{order} step {step}",
                bitwise=True,
            )
            for n, p in models["ref"].named_parameters():
                check_close(full_params(models["local"])[n], p.detach(), f"step {step} {n}", **TOL)
    assert opts["local"].param_groups[0]["lr"] == 1e-2 * 0.5**STEPS
    frozen = next(models["local"].layers[0].parameters())
    assert frozen not in opts["local"].state
    assert isinstance(opts["local"].state[extra["local"]]["exp_avg"], torch.Tensor)
    _check_state(models["local"].layers[1], opts["local"], order)


@pytest.mark.parametrize("order", ["wrap_first", "scheduler_first"])
def test_hsdp_frozen_plain_param_scheduler(order: str) -> None:
    run_on_ranks(4, _hsdp_frozen_plain_scheduler, order)


def _closure_and_idempotent() -> None:
    models = _models(world_mesh())
    del models["torch"]
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for k, m in models.items()}
    assert step_on_local_shards(opts["local"]) is opts["local"]
    step = opts["local"].step
    assert step_on_local_shards(opts["local"]) is opts["local"] and opts["local"].step is step
    _train(models, opts, (dist.get_rank(), dist.get_world_size()), "closure", closure=True)


def test_closure_and_idempotent() -> None:
    run_on_ranks(2, _closure_and_idempotent)


# ---------------------------------------------------------------------------------------------
# Checkpoints across world sizes


def _sharded_pair() -> dict[str, nn.Module]:
    mesh = world_mesh()
    return {k: shard_model(build(MODEL), fsdp2.fully_shard, mesh) for k in ("local", "fsdp2")}


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _full_optim_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        f"{n}.{k}": full_value(v)
        for n, p in model.named_parameters()
        for k, v in sorted(opt.state[p].items())
    }


def _save(root: str) -> dict[str, Any]:
    models = _sharded_pair()
    opts = {k: _adamw(m.parameters()) for k, m in models.items()}
    step_on_local_shards(opts["local"])
    _train(models, opts, (dist.get_rank(), dist.get_world_size()), "before save", steps=2)
    model_sd, optim_sd = get_state_dict(models["local"], opts["local"])
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)
    saved = _full_optim_state(models["local"], opts["local"])
    return {"state": saved, "params": full_params(models["local"])}


def _load(root: str, saved: dict[str, Any]) -> None:
    models = _sharded_pair()
    opts = {k: _adamw(m.parameters()) for k, m in models.items()}
    step_on_local_shards(opts["local"])
    for k, model in models.items():
        model_sd, optim_sd = get_state_dict(model, opts[k])  # initializes the state (a step)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=root)
        set_state_dict(
            model, opts[k], model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        check_same(full_params(model), saved["params"], f"{k} loaded params", bitwise=True)
        check_same(
            _full_optim_state(model, opts[k]), saved["state"], f"{k} loaded state", bitwise=True
        )
    _check_state(models["local"], opts["local"], "loaded")
    _train(models, opts, (dist.get_rank(), dist.get_world_size()), "resumed", steps=2, first=2)


def test_checkpoint_across_world_sizes(tmp_path: Any) -> None:
    root = os.path.join(str(tmp_path), "ckpt")
    saved = run_on_ranks(2, _save, root)[0]
    run_on_ranks(1, _load, root, saved)
    run_on_ranks(4, _load, root, saved)


# ---------------------------------------------------------------------------------------------
# Errors


class _Custom(torch.optim.Optimizer):
    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad, alpha=group["lr"])


def _errors() -> None:
    model = shard_model(build(MODEL), fsdp2.fully_shard, world_mesh())
    for make in (
        lambda ps: torch.optim.LBFGS(ps),
        lambda ps: torch.optim.Adafactor(ps),
        _Custom,
    ):
        opt = make(model.parameters())
        with pytest.raises(TypeError, match="not one of the elementwise"):
            step_on_local_shards(opt)
    custom = step_on_local_shards(_Custom(model.parameters()), elementwise=True)
    x, y = make_batch(MODEL, 0)
    rank, size = dist.get_rank(), dist.get_world_size()
    local_loss(model, MODEL, rank_slice(x, rank, size), rank_slice(y, rank, size)).backward()
    before = full_params(model)
    custom.step()  # runs on plain local tensors: no mixed DTensor/Tensor error
    after = full_params(model)
    assert all(not torch.equal(after[n], before[n]) for n in before), "custom step changed nothing"

    # A full plain state (e.g. a full optimizer state dict loaded as is) is refused.
    opt = step_on_local_shards(_adamw(model.parameters()))
    params = list(model.parameters())
    opt.step()
    opt.state[params[3]]["exp_avg"] = full_value(opt.state[params[3]]["exp_avg"])
    before = full_params(model)
    with pytest.raises(ValueError, match=r"state 'exp_avg' of param_groups\[0\]\['params'\]\[3\]"):
        opt.step()
    check_same(full_params(model), before, "after the refused step", bitwise=True)
    assert opt.param_groups[0]["params"] == params
    assert all(isinstance(p, DTensor) for p in opt.param_groups[0]["params"])
    assert all(p._local_tensor.grad is None for p in params)

    # An error inside the step leaves the DTensor parameters and state in place.
    opt = step_on_local_shards(_adamw(model.parameters()))
    opt.step()

    def boom(*_: Any) -> None:
        raise RuntimeError("boom")

    handle = opt.register_step_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    handle.remove()
    assert opt.param_groups[0]["params"] == params
    _check_state(model, opt, "after an error")
    opt.step()


def test_errors() -> None:
    run_on_ranks(2, _errors)
