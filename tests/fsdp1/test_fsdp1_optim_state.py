"""FSDP1-style optimizer state dicts and ``state_dict_type`` of the migration layer
(``fsdp2.fsdp1``), checked against torch's FSDP1.

* FULL parity: after the same 2 AdamW steps, our FULL optimizer state dict equals FSDP1's
  ``FSDP.optim_state_dict`` under FULL_STATE_DICT (keys, param groups, values), with
  ``rank0_only`` (``{}`` on the other ranks) and ``offload_to_cpu`` (CPU tensors) from
  ``state_dict_type``; FSDP1's rank0_only FULL model + optimizer state dicts load into a fresh
  fsdp2 model and 3 more steps give FSDP1's losses and parameters (ws 2 and 4: with 4 ranks
  some shards are empty).
* Round trips (FULL, FULL rank0_only + offload, SHARDED, LOCAL): save after 2 steps, load into
  a fresh model + optimizer, the next step's loss and parameters equal the uninterrupted run's;
  with two param groups whose parameters are in another order than ``named_parameters`` and a
  parameter that is never stepped (no state, no key), and on a model with a tied parameter
  (one key, the first name).
* ``state_dict_type`` / ``set_state_dict_type`` / ``get_state_dict_type``: ``model.state_dict()``
  and ``model.load_state_dict`` under FULL / SHARDED / LOCAL, through a parent module's
  ``state_dict()``, nesting, restoring after exit and after an exception, torch's enum and
  configs, the optimizer functions' defaults.
* DCP interop: a SHARDED checkpoint written by FSDP1 with ``torch.distributed.checkpoint``
  loads into fsdp2 (``init_optim_state`` gives the optimizer state to load into) and training
  continues as FSDP1's; an fsdp2 SHARDED checkpoint loads into FSDP1 the same way.
* Errors: bad arguments name what to pass (single process, plain modules), and a plain module
  round-trips (groups matched by parameters, FSDP1 prefixes stripped).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _harness import run_on_ranks
from helpers import TOL
from models import (
    MLPBlock,
    TransformerBlock,
    build,
    full_params,
    local_loss,
    make_batch,
    rank_slice,
)
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.fsdp import FullOptimStateDictConfig as TorchFullOptimStateDictConfig
from torch.distributed.fsdp import FullStateDictConfig as TorchFullStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.fsdp import StateDictType as TorchStateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

from fsdp2.fsdp1 import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictSettings,
    StateDictType,
    get_state_dict,
    get_state_dict_type,
    init_optim_state,
    load_state_dict,
    optim_state_dict,
    optim_state_dict_to_load,
    set_state_dict_type,
    shard_model,
    state_dict_type,
    strip_fsdp1_prefixes,
)

MODEL = "mlp_head"  # blocks 7->5->3->1 and a root head 1->2
FULL = StateDictType.FULL_STATE_DICT
SHARDED = StateDictType.SHARDED_STATE_DICT
LOCAL = StateDictType.LOCAL_STATE_DICT


def _close(got: Any, want: Any, what: str) -> None:
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


def _ours(seed: int = 0, name: str = MODEL) -> nn.Module:
    block = MLPBlock if name == MODEL else TransformerBlock
    return shard_model(build(name, seed), auto_wrap_policy={block})


def _torch_fsdp1(seed: int = 0) -> nn.Module:
    return FSDP1(
        build(MODEL, seed),
        auto_wrap_policy=ModuleWrapPolicy({MLPBlock}),
        use_orig_params=True,
        device_id=torch.device("cpu"),
    )


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model: nn.Module, opt: torch.optim.Optimizer, step: int, name: str = MODEL) -> float:
    """One step on this rank's slice of the global batch; returns this rank's loss."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    x, y = make_batch(name, step)
    opt.zero_grad(set_to_none=True)
    loss = local_loss(model, name, rank_slice(x, rank, ws), rank_slice(y, rank, ws))
    loss.backward()
    opt.step()
    return loss.item()


def _torch_full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    with FSDP1.state_dict_type(model, TorchStateDictType.FULL_STATE_DICT):
        return {k: v.clone() for k, v in strip_fsdp1_prefixes(model.state_dict()).items()}


def _torch_full_osd(model: nn.Module, opt: torch.optim.Optimizer, rank0_only: bool) -> Any:
    """FSDP1's FULL optimizer state dict. Not with its default ``offload_to_cpu=True``: with a
    CPU compute device FSDP1 (torch 2.13) then returns views of one all-gather buffer it reuses
    for every state name, so ``exp_avg`` comes back equal to ``exp_avg_sq``."""
    with FSDP1.state_dict_type(
        model,
        TorchStateDictType.FULL_STATE_DICT,
        TorchFullStateDictConfig(rank0_only=rank0_only),
        TorchFullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
    ):
        return FSDP1.optim_state_dict(model, opt)


def _check_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for name in want:
        _close(got[name], want[name], f"{what} {name}")


def _check_osd(got: Any, want: Any, what: str) -> None:
    """Two FQN-keyed optimizer state dicts hold the same state and param groups."""
    assert got.keys() == want.keys() == {"state", "param_groups"}, (sorted(got), sorted(want))
    assert got["state"].keys() == want["state"].keys(), (
        sorted(got["state"]),
        sorted(want["state"]),
    )
    for fqn, values in want["state"].items():
        assert got["state"][fqn].keys() == values.keys(), (fqn, sorted(got["state"][fqn]))
        for key, value in values.items():
            _close(got["state"][fqn][key], value, f"{what} {fqn}.{key}")
    assert got["param_groups"] == want["param_groups"], (got["param_groups"], want["param_groups"])


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree


# ---------------------------------------------------------------------------------------------
# FULL parity with torch's FSDP1


def _full_parity() -> None:
    rank = dist.get_rank()
    torch_model, ours = _torch_fsdp1(), _ours()
    torch_opt, opt = _adamw(torch_model), _adamw(ours)
    for step in range(2):
        _close(_train(ours, opt, step), _train(torch_model, torch_opt, step), f"loss {step}")
    want = _torch_full_osd(torch_model, torch_opt, rank0_only=False)
    got = optim_state_dict(ours, opt, state_dict_type=FULL)
    _check_osd(got, want, "FULL vs FSDP1")
    for values in got["state"].values():
        for v in values.values():
            assert type(v) is torch.Tensor and v.device.type == "cpu", type(v)
    # rank0_only and offload_to_cpu through the context manager, as FSDP1 users write it
    with state_dict_type(
        ours,
        FULL,
        FullStateDictConfig(rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
    ):
        got0 = optim_state_dict(ours, opt)
    want0 = _torch_full_osd(torch_model, torch_opt, rank0_only=True)
    if rank == 0:
        _check_osd(got0, want0, "FULL rank0_only vs FSDP1")
    else:
        assert got0 == {} and want0 == {}, (sorted(got0), sorted(want0))

    # FSDP1's rank0_only FULL checkpoint loads into a fresh fsdp2 model; training goes on alike
    with FSDP1.state_dict_type(
        torch_model, TorchStateDictType.FULL_STATE_DICT, TorchFullStateDictConfig(rank0_only=True)
    ):
        model_sd = _clone(torch_model.state_dict())
    fresh = _ours(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)  # hyperparameters come from want0
    load_state_dict(fresh, model_sd, FULL, FullStateDictConfig(rank0_only=True))
    fresh_opt.load_state_dict(
        optim_state_dict_to_load(
            fresh,
            fresh_opt,
            want0,
            state_dict_type=TorchStateDictType.FULL_STATE_DICT,
            config=TorchFullOptimStateDictConfig(rank0_only=True),
        )
    )
    assert fresh_opt.param_groups[0]["lr"] == 1e-2
    for step in range(2, 5):
        want_loss = _train(torch_model, torch_opt, step)
        _close(_train(fresh, fresh_opt, step), want_loss, f"resumed from FSDP1 FULL, loss {step}")
    _check_params(full_params(fresh), _torch_full_params(torch_model), "after 3 resumed steps")


@pytest.mark.parametrize("world_size", [2, 4])
def test_full_optim_state_dict_parity_with_fsdp1(world_size: int) -> None:
    run_on_ranks(world_size, _full_parity)


# ---------------------------------------------------------------------------------------------
# Round trips


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name != MODEL:
        return _adamw(model)
    # two groups, parameters in another order than named_parameters()
    params = dict(model.named_parameters())
    first = ["head.bias", "layers.2.lin.weight", "head.weight", "layers.2.lin.bias"]
    second = [n for n in reversed(params) if n not in first]
    return torch.optim.AdamW(
        [
            {"params": [params[n] for n in first]},
            {"params": [params[n] for n in second], "lr": 2e-2},
        ],
        lr=1e-2,
        weight_decay=0.1,
    )


UNSTEPPED = "layers.1.lin.bias"  # in the optimizer, never stepped: no state


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, name: str) -> float:
    rank, ws = dist.get_rank(), dist.get_world_size()
    x, y = make_batch(name, step)
    opt.zero_grad(set_to_none=True)
    loss = local_loss(model, name, rank_slice(x, rank, ws), rank_slice(y, rank, ws))
    loss.backward()
    if name == MODEL:
        dict(model.named_parameters())[UNSTEPPED].grad = None
    opt.step()
    return loss.item()


ROUND_TRIPS = {
    "FULL": (FULL, FullOptimStateDictConfig(), FullStateDictConfig()),
    "FULL_rank0_only": (
        FULL,
        FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
        FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
    ),
    "SHARDED": (SHARDED, ShardedOptimStateDictConfig(), ShardedStateDictConfig()),
    "LOCAL": (LOCAL, LocalOptimStateDictConfig(), LocalStateDictConfig()),
}


def _round_trip(case: str, name: str) -> None:
    kind, config, model_config = ROUND_TRIPS[case]
    empty = getattr(config, "rank0_only", False) and dist.get_rank() != 0
    model = _ours(name=name)
    opt = _optimizer(model, name)
    for step in range(2):
        _step(model, opt, step, name)
    osd = _clone(optim_state_dict(model, opt, state_dict_type=kind, config=config))
    model_sd = _clone(get_state_dict(model, kind, model_config))
    want_loss = _step(model, opt, 2, name)
    want = full_params(model)

    if empty:
        assert osd == {} and model_sd == {}, (sorted(osd), sorted(model_sd))
    else:
        state = osd["state"]
        if name == MODEL:
            assert UNSTEPPED not in state, sorted(state)
            assert len(state) == len(list(model.parameters())) - 1, sorted(state)
            assert osd["param_groups"][0]["params"][0] == "head.bias", osd["param_groups"]
            assert osd["param_groups"][1]["lr"] == 2e-2, osd["param_groups"]
        else:  # tied: the head's weight is the token embedding's, stored once
            assert "tok_emb.weight" in state and "head.weight" not in state, sorted(state)
        params = dict(model.named_parameters())
        for fqn, values in state.items():
            assert type(values["step"]) is torch.Tensor and values["step"].dim() == 0
            avg = values["exp_avg"]
            if kind is SHARDED:
                assert isinstance(avg, DTensor) and avg.placements == params[fqn].placements
            elif kind is LOCAL:
                assert type(avg) is torch.Tensor and avg.shape == params[fqn].to_local().shape
            else:
                assert type(avg) is torch.Tensor and avg.shape == params[fqn].shape, fqn
                assert avg.device.type == "cpu"

    fresh = _ours(seed=1, name=name)
    fresh_opt = _optimizer(fresh, name)
    load_state_dict(fresh, model_sd, kind, model_config)
    fresh_opt.load_state_dict(
        optim_state_dict_to_load(fresh, fresh_opt, osd, state_dict_type=kind, config=config)
    )
    for p in fresh.parameters():  # the optimizer still holds the model's own parameters
        assert any(p is q for g in fresh_opt.param_groups for q in g["params"])
        if p in fresh_opt.state:
            assert isinstance(fresh_opt.state[p]["exp_avg"], DTensor)
    _close(_step(fresh, fresh_opt, 2, name), want_loss, f"{case} loss after loading")
    _check_params(full_params(fresh), want, f"{case} after loading and one step")


@pytest.mark.parametrize(
    ("name", "case"),
    [(MODEL, case) for case in ROUND_TRIPS] + [("transformer", "FULL"), ("transformer", "SHARDED")],
)
def test_optim_state_dict_round_trip(name: str, case: str) -> None:
    run_on_ranks(2, _round_trip, case, name)


# ---------------------------------------------------------------------------------------------
# state_dict_type


def _context_manager() -> None:
    rank = dist.get_rank()
    model = _ours()
    opt = _adamw(model)
    _train(model, opt, 0)
    want = full_params(model)
    params = dict(model.named_parameters())

    def perturbed_then(load: Any, sd: Any, what: str) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-2.0).add_(0.5)
        load(sd)
        _check_params(full_params(model), want, what)

    assert get_state_dict_type(model).state_dict_type is SHARDED  # fsdp2's native kind
    with state_dict_type(model, FULL):
        assert get_state_dict_type(model) == StateDictSettings(
            FULL, FullStateDictConfig(), FullOptimStateDictConfig()
        )
        sd = _clone(model.state_dict())
        _check_params({k: v for k, v in sd.items()}, want, "FULL state_dict()")
        assert all(type(v) is torch.Tensor for v in sd.values())
        perturbed_then(model.load_state_dict, sd, "FULL load_state_dict()")
        # a parent's state_dict() reaches the root's override (keys get the parent's prefix)
        outer = nn.ModuleDict({"inner": model}).state_dict()
        assert outer.keys() == {f"inner.{k}" for k in want}, sorted(outer)
        assert type(outer["inner.head.weight"]) is torch.Tensor
        # the optimizer functions default to the context's type
        osd = optim_state_dict(model, opt)
        assert type(osd["state"]["head.weight"]["exp_avg"]) is torch.Tensor
        with state_dict_type(model, LOCAL):  # nesting
            local = _clone(model.state_dict())
            for k, p in params.items():
                assert type(local[k]) is torch.Tensor and local[k].shape == p.to_local().shape
            perturbed_then(model.load_state_dict, local, "LOCAL load_state_dict()")
            osd = optim_state_dict(model, opt)
            assert type(osd["state"]["head.weight"]["exp_avg"]) is torch.Tensor
            opt.load_state_dict(optim_state_dict_to_load(model, opt, osd))
        assert get_state_dict_type(model).state_dict_type is FULL
        assert type(model.state_dict()["head.weight"]) is torch.Tensor
    assert "state_dict" not in model.__dict__ and "load_state_dict" not in model.__dict__
    assert get_state_dict_type(model).state_dict_type is SHARDED
    assert isinstance(model.state_dict()["head.weight"], DTensor)

    with pytest.raises(RuntimeError, match="boom"):
        with state_dict_type(model, SHARDED, ShardedStateDictConfig(offload_to_cpu=True)):
            sharded = _clone(model.state_dict())
            assert all(isinstance(sharded[k], DTensor) for k in params)
            perturbed_then(model.load_state_dict, sharded, "SHARDED load_state_dict()")
            osd = optim_state_dict(model, opt)
            assert isinstance(osd["state"]["head.weight"]["exp_avg"], DTensor)
            raise RuntimeError("boom")
    assert (
        "state_dict" not in model.__dict__ and get_state_dict_type(model).state_dict_type is SHARDED
    )

    # torch's enum and configs are accepted
    with state_dict_type(
        model, TorchStateDictType.FULL_STATE_DICT, TorchFullStateDictConfig(rank0_only=True)
    ):
        sd = model.state_dict()
        assert (sd == {}) == (rank != 0), sorted(sd)

    previous = set_state_dict_type(model, LOCAL)
    assert previous == StateDictSettings(
        SHARDED, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
    )
    assert (
        model.state_dict()["layers.0.lin.weight"].shape
        == params["layers.0.lin.weight"].to_local().shape
    )
    assert set_state_dict_type(model, previous.state_dict_type).state_dict_type is LOCAL
    assert isinstance(model.state_dict()["head.weight"], DTensor)
    _check_params(full_params(model), want, "after all contexts")


def test_state_dict_type_context() -> None:
    run_on_ranks(2, _context_manager)


def _unsharded_groups() -> None:
    """Between a forward and its backward with ``SHARD_GRAD_OP`` the registered parameters are
    the unsharded ones (``parameters()`` gives them, as torch's); the optimizer's sharded
    parameters still get their names."""
    model = shard_model(
        build(MODEL), auto_wrap_policy={MLPBlock}, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP
    )
    opt = _adamw(model)
    _train(model, opt, 0)
    want = optim_state_dict(model, opt, state_dict_type=FULL)
    out = model(make_batch(MODEL, 1)[0])
    registered = [t for m in model.modules() for t in m._parameters.values() if t is not None]
    assert not any(isinstance(t, DTensor) for t in registered)
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    got = optim_state_dict(model, opt, state_dict_type=FULL)
    _check_osd(got, want, "while unsharded")
    opt.load_state_dict(optim_state_dict_to_load(model, opt, got, state_dict_type=FULL))
    out.sum().backward()


def test_names_while_unsharded() -> None:
    run_on_ranks(2, _unsharded_groups)


# ---------------------------------------------------------------------------------------------
# DCP checkpoints: torch's FSDP1 <-> fsdp2


def _dcp_interop(root: str) -> None:
    fsdp1_dir, fsdp2_dir = os.path.join(root, "fsdp1"), os.path.join(root, "fsdp2")
    torch_model = _torch_fsdp1()
    torch_opt = _adamw(torch_model)
    for step in range(2):
        _train(torch_model, torch_opt, step)
    with FSDP1.state_dict_type(torch_model, TorchStateDictType.SHARDED_STATE_DICT):
        saved = {
            "model": torch_model.state_dict(),
            "optim": FSDP1.optim_state_dict(torch_model, torch_opt),
        }
    dcp.save(saved, checkpoint_id=fsdp1_dir)
    probe = _ours()  # FSDP1's in-memory SHARDED state (ShardedTensors) is refused, clearly
    with pytest.raises(ValueError, match="is a ShardedTensor .* dcp.load it into"):
        optim_state_dict_to_load(probe, _adamw(probe), saved["optim"], state_dict_type=SHARDED)
    want_osd = _torch_full_osd(torch_model, torch_opt, rank0_only=False)

    ours = _ours(seed=1)
    opt = _adamw(ours)
    before = full_params(ours)
    init_optim_state(opt)  # the load target needs optimizer state
    _check_params(full_params(ours), before, "params after init_optim_state")
    assert all(isinstance(opt.state[p]["exp_avg"], DTensor) for p in ours.parameters())
    target = {
        "model": get_state_dict(ours, SHARDED),
        "optim": optim_state_dict(ours, opt, state_dict_type=SHARDED),
    }
    dcp.load(target, checkpoint_id=fsdp1_dir)
    load_state_dict(ours, target["model"], SHARDED)
    opt.load_state_dict(
        optim_state_dict_to_load(ours, opt, target["optim"], state_dict_type=SHARDED)
    )
    _check_osd(optim_state_dict(ours, opt, state_dict_type=FULL), want_osd, "loaded from FSDP1 DCP")
    for step in range(2, 5):
        want_loss = _train(torch_model, torch_opt, step)
        _close(_train(ours, opt, step), want_loss, f"resumed from FSDP1 DCP, loss {step}")
    _check_params(full_params(ours), _torch_full_params(torch_model), "after FSDP1 DCP resume")

    # the other way: an fsdp2 SHARDED checkpoint loads into torch's FSDP1
    dcp.save(
        {
            "model": get_state_dict(ours, SHARDED),
            "optim": optim_state_dict(ours, opt, state_dict_type=SHARDED),
        },
        checkpoint_id=fsdp2_dir,
    )
    torch2 = _torch_fsdp1(seed=1)
    torch2_opt = _adamw(torch2)
    _train(torch2, torch2_opt, 99)  # FSDP1's optimizer state must exist as the load target
    with FSDP1.state_dict_type(torch2, TorchStateDictType.SHARDED_STATE_DICT):
        target = {"model": torch2.state_dict(), "optim": FSDP1.optim_state_dict(torch2, torch2_opt)}
        # flatten_sharded_tensors=False: by default DCP drops the ShardedTensors that have no
        # local shard (layers.2 has 1 row: rank 1 holds none), then takes the missing keys for
        # a pre-2.4 checkpoint and fails on "optim.param_groups"; FSDP1 loading its own
        # SHARDED checkpoint fails the same way (torch 2.13)
        dcp.load(
            target,
            checkpoint_id=fsdp2_dir,
            planner=DefaultLoadPlanner(flatten_sharded_tensors=False),
        )
        torch2.load_state_dict(target["model"])
        torch2_opt.load_state_dict(
            FSDP1.optim_state_dict_to_load(torch2, torch2_opt, target["optim"])
        )
    for step in range(5, 7):
        want_loss = _train(ours, opt, step)
        _close(
            _train(torch2, torch2_opt, step), want_loss, f"FSDP1 resumed from fsdp2, loss {step}"
        )
    _check_params(_torch_full_params(torch2), full_params(ours), "FSDP1 after fsdp2 DCP resume")


def test_dcp_checkpoint_interop_with_fsdp1(tmp_path: Any) -> None:
    run_on_ranks(2, _dcp_interop, str(tmp_path))


# ---------------------------------------------------------------------------------------------
# Single process: plain modules, errors


def _plain(step: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A plain (unsharded) model and an AdamW with two param groups in a scrambled order; with
    ``step`` after one step in which ``1.bias`` got no gradient (so it has no state)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(
        [{"params": [model[1].bias, model[0].weight]}, {"params": [model[0].bias, model[1].weight]}]
    )
    if step:
        model(torch.randn(5, 3)).sum().backward()
        model[1].bias.grad = None
        opt.step()
    return model, opt


def test_plain_module_round_trip() -> None:
    model, opt = _plain()
    osd = optim_state_dict(model, opt)  # no settings: SHARDED, plain tensors stay as they are
    assert osd["param_groups"][0]["params"] == ["1.bias", "0.weight"]
    assert sorted(osd["state"]) == ["0.bias", "0.weight", "1.weight"]
    # groups listed in another order, parameters reordered, FSDP1 prefixes: all still load
    saved = _clone(osd)
    saved["param_groups"] = [
        {**saved["param_groups"][1], "params": ["1.weight", "_fsdp_wrapped_module.0.bias"]},
        {**saved["param_groups"][0], "params": ["0.weight", "1.bias"]},
    ]
    saved["param_groups"][0]["lr"] = 0.5
    fresh, fresh_opt = _plain(step=False)
    optim_state_dict_to_load(fresh, fresh_opt, saved, load_directly=True)
    assert [g["lr"] for g in fresh_opt.param_groups] == [1e-3, 0.5]
    assert fresh[1].bias not in fresh_opt.state
    fresh_opt.param_groups[1]["lr"] = 1e-3
    _check_osd(optim_state_dict(fresh, fresh_opt), osd, "plain round trip")


def test_errors() -> None:
    model, opt = _plain()
    osd = optim_state_dict(model, opt)
    with pytest.raises(TypeError, match="state_dict_type must be a StateDictType"):
        with state_dict_type(model, "FULL_STATE_DICT"):  # type: ignore[arg-type]
            pass
    with pytest.raises(TypeError, match="module must be an nn.Module"):
        set_state_dict_type(opt, FULL)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="FULL_STATE_DICT takes a FullStateDictConfig"):
        with state_dict_type(model, FULL, ShardedStateDictConfig()):
            pass
    with pytest.raises(
        TypeError, match=r"expected an OptimStateDictConfig \(for FULL_STATE_DICT: "
    ):
        set_state_dict_type(model, FULL, optim_state_dict_config=FullStateDictConfig())  # type: ignore[arg-type]
    assert "state_dict" not in model.__dict__  # a failed call changed nothing
    with pytest.raises(ValueError, match="SHARDED_STATE_DICT takes a ShardedOptimStateDictConfig"):
        optim_state_dict(
            model, opt, state_dict_type=SHARDED, config=FullOptimStateDictConfig(rank0_only=True)
        )
    with pytest.raises(TypeError, match="optim must be a torch.optim.Optimizer"):
        optim_state_dict(model, model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="group must be None or a ProcessGroup"):
        optim_state_dict(model, opt, None, "group")  # type: ignore[arg-type]
    other = torch.optim.SGD(nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="not a parameter of model"):
        optim_state_dict(model, other)
    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        optim_state_dict_to_load(model, opt, {"state": {}})
    bad = _clone(osd)
    bad["state"]["2.weight"] = bad["state"].pop("0.weight")
    with pytest.raises(ValueError, match="'2.weight', which is not a parameter of model"):
        optim_state_dict_to_load(model, opt, bad)
    bad = _clone(osd)
    bad["state"]["0.weight"]["exp_avg"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"state\['0.weight'\]\['exp_avg'\] has shape \(2, 2\)"):
        optim_state_dict_to_load(model, opt, bad)
    bad = _clone(osd)
    bad["param_groups"] = [
        {**bad["param_groups"][0], "params": ["1.bias", "0.bias"]},
        {**bad["param_groups"][1], "params": ["0.weight", "1.weight"]},
    ]
    with pytest.raises(ValueError, match="which no param group of optim_state_dict holds exactly"):
        optim_state_dict_to_load(model, opt, bad)
    with pytest.raises(ValueError, match="is_named_optimizer=True is not supported"):
        optim_state_dict_to_load(model, opt, osd, is_named_optimizer=True)
    with state_dict_type(model, FULL):
        with pytest.raises(ValueError, match="assign=True is not supported"):
            model.load_state_dict(model.state_dict(), assign=True)
    with pytest.raises(TypeError, match="init_optim_state: optim must be"):
        init_optim_state(model)  # type: ignore[arg-type]
