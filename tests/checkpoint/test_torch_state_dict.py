"""State dicts and distributed checkpoints of ``fully_shard`` models, on 2 and 4 gloo ranks.

* ``model.state_dict()``: the unsharded model's keys, in its order (tied weights under both
  names), DTensor values for parameters whose ``full_tensor()`` is the unsharded value, plain
  buffers; same keys and placements as torch's ``fully_shard``.
* ``load_state_dict``: (a) a sharded state dict of another sharded model, (b) a full plain
  state dict of an unsharded ``nn.Module`` (fp32 or bf16; each rank keeps its shard, fsdp2's
  load pre-hooks; torch's FSDP2 cannot load plain tensors into DTensor parameters, so fsdp2
  only), (c) errors: a missing or unexpected key under ``strict=True`` and a value of the wrong
  shape (plain or DTensor) raise ``RuntimeError`` naming the key (and both shapes), as with
  torch's engine. After a load the parameter objects are the same, and training continues
  from the loaded values (the loaded shards are what the next all-gather reads).
  ``assign=True`` (a sharded state dict into a materialized or a meta-device sharded model,
  as torch's FSDP2 supports; a plain one, fsdp2 only) must train from the assigned values
  with the assigned parameter objects.
* ``torch.distributed.checkpoint``: model + AdamW state via ``get_state_dict`` /
  ``dcp.save``, trained 2 steps, saved at one layout and loaded (``dcp.load`` +
  ``set_state_dict``) at another in a separate ``run_on_ranks`` call sharing a directory:
  FSDP(4) -> FSDP(2), FSDP(2) -> FSDP(4), FSDP(4) -> HSDP(2x2). Full parameters and full
  optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``) equal the saved ones exactly, and 2
  resumed steps give the uninterrupted run's losses and parameters (fp32, 1e-5: the global
  batch is split differently). Checkpoints of both engines are loaded into both engines.
* ``StateDictOptions(full_state_dict=True, cpu_offload=True)``: rank 0 gets plain CPU tensors
  equal to an unsharded reference trained alongside (other ranks get nothing);
  ``set_model_state_dict`` / ``set_optimizer_state_dict`` with ``broadcast_from_rank0=True``
  load them into a fresh sharded model, which then trains exactly like the original.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _harness import run_on_ranks
from helpers import ENGINES, TOL, hsdp_mesh, world_mesh
from models import (
    MLPStack,
    build,
    full_params,
    full_value,
    local_loss,
    make_batch,
    make_optimizer,
    mean_over_ranks,
    rank_slice,
    shard_model,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

EXACT = {"atol": 0.0, "rtol": 0.0}
MODEL_NAMES = ["mlp", "transformer"]  # uneven shards (empty ones on 4 ranks); a tied weight
# name -> (world size, mesh shape); HSDP meshes need dim names for torch's fully_shard
LAYOUTS: dict[str, tuple[int, tuple[int, ...]]] = {
    "fsdp2": (2, (2,)),
    "fsdp4": (4, (4,)),
    "hsdp2x2": (4, (2, 2)),
}
STEPS_BEFORE, STEPS_AFTER = 2, 2


def _layout_mesh(layout: str) -> DeviceMesh:
    world_size, shape = LAYOUTS[layout]
    assert dist.get_world_size() == world_size, f"{layout} needs {world_size} ranks"
    return hsdp_mesh(shape) if len(shape) == 2 else world_mesh()


def _sharded(engine: str, model_name: str, mesh: DeviceMesh, seed: int = 0) -> nn.Module:
    return shard_model(build(model_name, seed), ENGINES[engine], mesh)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, model_name: str, step: int) -> float:
    """One step on this rank's slice of the global batch; returns the rank-averaged loss.
    Every data-parallel layout here (FSDP or HSDP) has one data shard per rank."""
    x, y = make_batch(model_name, step)
    rank, ws = dist.get_rank(), dist.get_world_size()
    loss = local_loss(model, model_name, rank_slice(x, rank, ws), rank_slice(y, rank, ws))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return mean_over_ranks(loss).item()


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Full parameters and full optimizer state by parameter name (collective)."""
    names = {id(p): n for n, p in model.named_parameters()}
    optim = {}
    for p in model.parameters():  # a fixed order on every rank: full_tensor() is collective
        state = opt.state.get(p, {})
        optim[names[id(p)]] = {k: full_value(state[k]) for k in sorted(state)}
    return {"params": full_params(model), "optim": optim}


def _compare_snapshots(got: dict[str, Any], want: dict[str, Any], what: str, **tol: float) -> None:
    assert got["params"].keys() == want["params"].keys(), f"{what}: parameter names differ"
    for name, t in want["params"].items():
        torch.testing.assert_close(
            got["params"][name], t, **tol, msg=lambda m, n=name: f"{what} param {n}: {m}"
        )
    assert got["optim"].keys() == want["optim"].keys()
    for name, state in want["optim"].items():
        assert got["optim"][name].keys() == state.keys(), f"{what}: optimizer state of {name}"
        for key, value in state.items():
            torch.testing.assert_close(
                got["optim"][name][key],
                value,
                **tol,
                msg=lambda m, n=name, k=key: f"{what} optimizer {k} of {n}: {m}",
            )


def _same_parameters(before: list[nn.Parameter], model: nn.Module, what: str) -> None:
    after = list(model.parameters())
    assert len(after) == len(before) and all(p is q for p, q in zip(before, after, strict=True)), (
        f"{what}: loading replaced parameter objects"
    )


# ---------------------------------------------------------------------------------------------
# model.state_dict() and load_state_dict


def _state_dict_layout(model_name: str, layout: str) -> None:
    mesh = _layout_mesh(layout)
    ref = build(model_name)
    want_keys = list(ref.state_dict().keys())
    placements = {}
    for engine in ENGINES:
        model = _sharded(engine, model_name, mesh)
        sd = model.state_dict()
        assert list(sd.keys()) == want_keys, f"{engine}: keys {list(sd)}, want {want_keys}"
        for key, value in sd.items():
            assert isinstance(value, DTensor), f"{engine}: {key} is a {type(value).__name__}"
            torch.testing.assert_close(
                value.full_tensor(),
                ref.state_dict()[key],
                **EXACT,
                msg=lambda m, k=key, e=engine: f"{e} {k}: {m}",
            )
        placements[engine] = {
            k: (tuple(v.placements), tuple(v.to_local().shape)) for k, v in sd.items()
        }
    assert placements["fsdp2"] == placements["torch"], (
        f"placements and local shapes: fsdp2 {placements['fsdp2']}, torch {placements['torch']}"
    )


@pytest.mark.parametrize("layout", ["fsdp2", "fsdp4", "hsdp2x2"])
@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_state_dict_keys_and_values(model_name: str, layout: str) -> None:
    run_on_ranks(LAYOUTS[layout][0], _state_dict_layout, model_name, layout)


def _buffers_in_state_dict(engine: str) -> None:
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))
    ENGINES[engine](model, mesh=_layout_mesh("fsdp2"))
    sd = model.state_dict()
    assert list(sd) == list(nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4)).state_dict())
    for key in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert not isinstance(sd[key], DTensor), f"buffer {key} is a DTensor"
    src = {k: v.clone() for k, v in sd.items()}
    src["1.running_mean"] = torch.arange(4.0)
    model.load_state_dict(src)
    assert torch.equal(model[1].running_mean, torch.arange(4.0)), "buffer not loaded"


@pytest.mark.parametrize("engine", list(ENGINES))
def test_buffers_plain_in_state_dict(engine: str) -> None:
    run_on_ranks(2, _buffers_in_state_dict, engine)


def _load_sharded(engine: str, model_name: str, layout: str) -> None:
    mesh = _layout_mesh(layout)
    src = _sharded(engine, model_name, mesh, seed=0)
    opt = make_optimizer("adamw", src.parameters())
    _train_step(src, opt, model_name, 0)
    dst = _sharded(engine, model_name, mesh, seed=1)
    before = list(dst.parameters())
    result = dst.load_state_dict(src.state_dict())
    assert not result.missing_keys and not result.unexpected_keys, result
    _same_parameters(before, dst, engine)
    for (name, got), want in zip(full_params(dst).items(), full_params(src).values(), strict=True):
        torch.testing.assert_close(got, want, **EXACT, msg=lambda m, n=name: f"{n}: {m}")
    # Fresh optimizers: both must now follow the same trajectory, bit for bit.
    opts = [make_optimizer("adamw", m.parameters()) for m in (src, dst)]
    for step in (1, 2):
        losses = [
            _train_step(m, o, model_name, step) for m, o in zip((src, dst), opts, strict=True)
        ]
        assert losses[0] == losses[1], f"step {step}: losses {losses}"
    for (name, got), want in zip(full_params(dst).items(), full_params(src).values(), strict=True):
        torch.testing.assert_close(got, want, **EXACT, msg=lambda m, n=name: f"trained {n}: {m}")


@pytest.mark.parametrize("layout", ["fsdp2", "fsdp4", "hsdp2x2"])
@pytest.mark.parametrize("model_name", MODEL_NAMES)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_load_sharded_state_dict(engine: str, model_name: str, layout: str) -> None:
    run_on_ranks(LAYOUTS[layout][0], _load_sharded, engine, model_name, layout)


def _load_full_plain(model_name: str, layout: str, dtype: torch.dtype) -> None:
    mesh = _layout_mesh(layout)
    ckpt = build(model_name, seed=1)  # an unsharded model, identical on every rank
    plain = {k: v.to(dtype) for k, v in ckpt.state_dict().items()}
    model = _sharded("fsdp2", model_name, mesh, seed=0)
    before = list(model.parameters())
    layout_before = [(tuple(p.placements), tuple(p.to_local().shape)) for p in before]
    result = model.load_state_dict(plain)
    assert not result.missing_keys and not result.unexpected_keys, result
    _same_parameters(before, model, "fsdp2")
    assert [
        (tuple(p.placements), tuple(p.to_local().shape)) for p in model.parameters()
    ] == layout_before
    with torch.no_grad():  # the reference holds what was loaded (bf16-rounded for bf16)
        for name, p in ckpt.named_parameters():
            p.copy_(plain[name])
    for name, full in full_params(model).items():
        assert full.dtype == torch.float32, f"{name} became {full.dtype}"
        torch.testing.assert_close(
            full, ckpt.get_parameter(name).detach(), **EXACT, msg=lambda m, n=name: f"{n}: {m}"
        )
    opt, ref_opt = (make_optimizer("adamw", m.parameters()) for m in (model, ckpt))
    for step in range(2):
        x, y = make_batch(model_name, step)
        ref_loss = local_loss(ckpt, model_name, x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = _train_step(model, opt, model_name, step)
        torch.testing.assert_close(loss, ref_loss.item(), **TOL)
    for name, full in full_params(model).items():
        torch.testing.assert_close(
            full,
            ckpt.get_parameter(name).detach(),
            **TOL,
            msg=lambda m, n=name: f"trained {n}: {m}",
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["fsdp2", "fsdp4", "hsdp2x2"])
@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_load_full_plain_state_dict(model_name: str, layout: str, dtype: torch.dtype) -> None:
    run_on_ranks(LAYOUTS[layout][0], _load_full_plain, model_name, layout, dtype)


def _load_errors(engine: str, case: str) -> None:
    mesh = _layout_mesh("fsdp2")
    key = "layers.0.lin.weight"  # (5, 7) in MLPStack((7, 5, 3, 1))
    model = _sharded(engine, "mlp", mesh)
    sd = model.state_dict()
    if case == "missing_key":
        del sd[key]
        match = rf'Missing key\(s\) in state_dict: "{key}"'
    elif case == "unexpected_key":
        sd["layers.0.lin.extra"] = torch.zeros(2)
        match = r'Unexpected key\(s\) in state_dict: "layers\.0\.lin\.extra"'
    elif case == "wrong_shape_plain":
        sd[key] = torch.zeros(3, 7)
        match = (
            rf"size mismatch for {key}: copying a param with shape torch.Size\(\[3, 7\]\) "
            r"from checkpoint, the shape in current model is torch.Size\(\[5, 7\]\)"
        )
    else:
        assert case == "wrong_shape_dtensor", case
        other = shard_model(MLPStack((7, 6, 3, 1)), ENGINES[engine], mesh)
        sd[key] = other.state_dict()[key]
        match = (
            rf"size mismatch for {key}: copying a param with shape torch.Size\(\[6, 7\]\) "
            r"from checkpoint, the shape in current model is torch.Size\(\[5, 7\]\)"
        )
    with pytest.raises(RuntimeError, match=match):
        model.load_state_dict(sd, strict=True)


@pytest.mark.parametrize(
    "case", ["missing_key", "unexpected_key", "wrong_shape_plain", "wrong_shape_dtensor"]
)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_load_state_dict_errors(engine: str, case: str) -> None:
    run_on_ranks(2, _load_errors, engine, case)


# ---------------------------------------------------------------------------------------------
# torch.distributed.checkpoint across world sizes and layouts


def _dcp_save(root: str, model_name: str, layout: str) -> dict[str, Any] | None:
    """Train STEPS_BEFORE steps, save model + optimizer with each engine, then keep training
    STEPS_AFTER steps (the uninterrupted run). Rank 0 returns what was saved and what came
    after, per engine."""
    mesh = _layout_mesh(layout)
    out = {}
    for engine in ENGINES:
        model = _sharded(engine, model_name, mesh)
        opt = make_optimizer("adamw", model.parameters())
        for step in range(STEPS_BEFORE):
            _train_step(model, opt, model_name, step)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, engine))
        saved = _snapshot(model, opt)
        losses = [
            _train_step(model, opt, model_name, s)
            for s in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)
        ]
        out[engine] = {"saved": saved, "losses": losses, "final": full_params(model)}
    return out if dist.get_rank() == 0 else None


def _dcp_load(root: str, model_name: str, layout: str, expected: dict[str, Any]) -> None:
    """Load each engine's checkpoint into each engine at ``layout``; compare with the saving
    run and resume training."""
    mesh = _layout_mesh(layout)
    for saver in ENGINES:
        want = expected[saver]
        for loader in ENGINES:
            what = f"{saver} checkpoint -> {loader}"
            model = _sharded(loader, model_name, mesh, seed=1)  # init differs from the saved
            opt = make_optimizer("adamw", model.parameters())
            before = list(model.parameters())
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=os.path.join(root, saver))
            set_state_dict(
                model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
            _same_parameters(before, model, what)
            assert all(
                p is q for p, q in zip(before, opt.param_groups[0]["params"], strict=True)
            ), f"{what}: the optimizer no longer holds the model's parameters"
            _compare_snapshots(_snapshot(model, opt), want["saved"], what, **EXACT)
            losses = [
                _train_step(model, opt, model_name, s)
                for s in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)
            ]
            torch.testing.assert_close(
                losses, want["losses"], **TOL, msg=lambda m, w=what: f"{w} resumed losses: {m}"
            )
            for name, full in full_params(model).items():
                torch.testing.assert_close(
                    full, want["final"][name], **TOL, msg=lambda m, n=name, w=what: f"{w} {n}: {m}"
                )


# (model, save layout) -> (checkpoint folder, what rank 0 returned): a save two cases load
# (FSDP(4) -> FSDP(2) and -> HSDP(2x2)) runs once; loading only reads the folder.
_SAVED: dict[tuple[str, str], tuple[str, Any]] = {}


@pytest.mark.parametrize(
    "save_layout, load_layout",
    [("fsdp4", "fsdp2"), ("fsdp2", "fsdp4"), ("fsdp4", "hsdp2x2")],
    ids=["fsdp4-to-fsdp2", "fsdp2-to-fsdp4", "fsdp4-to-hsdp2x2"],
)
@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_dcp_reshard_on_load(
    model_name: str, save_layout: str, load_layout: str, tmp_path_factory
) -> None:
    if (model_name, save_layout) not in _SAVED:
        root = str(tmp_path_factory.mktemp("dcp"))
        results = run_on_ranks(LAYOUTS[save_layout][0], _dcp_save, root, model_name, save_layout)
        _SAVED[(model_name, save_layout)] = (root, results[0])
    root, saved = _SAVED[(model_name, save_layout)]
    run_on_ranks(LAYOUTS[load_layout][0], _dcp_load, root, model_name, load_layout, saved)


# ---------------------------------------------------------------------------------------------
# Full state dicts (StateDictOptions)


def _full_state_dict(engine: str, model_name: str, layout: str) -> None:
    mesh = _layout_mesh(layout)
    rank = dist.get_rank()
    ref = build(model_name)
    ref_opt = make_optimizer("adamw", ref.parameters())
    model = _sharded(engine, model_name, mesh)
    opt = make_optimizer("adamw", model.parameters())
    for step in range(2):
        x, y = make_batch(model_name, step)
        local_loss(ref, model_name, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _train_step(model, opt, model_name, step)
    ref_sd = ref.state_dict()
    get_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    set_options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    model_sd = get_model_state_dict(model, options=get_options)
    optim_sd = get_optimizer_state_dict(model, opt, options=get_options)
    if rank == 0:
        assert list(model_sd) == list(ref_sd), f"keys {list(model_sd)}"
        for key, value in model_sd.items():
            assert type(value) is torch.Tensor and value.device.type == "cpu", (
                f"{key} is a {type(value).__name__} on {value.device}"
            )
            torch.testing.assert_close(value, ref_sd[key], **TOL, msg=lambda m, k=key: f"{k}: {m}")
        assert optim_sd["state"], "rank 0 got no optimizer state"
    else:
        assert model_sd == {}, f"rank {rank} got {list(model_sd)} with cpu_offload"
    fresh = _sharded(engine, model_name, mesh, seed=1)
    fresh_opt = make_optimizer("adamw", fresh.parameters())
    before = list(fresh.parameters())
    # Copies: the state dict can hold the live optimizer's own tensors (e.g. its plain
    # ``step``), which the two optimizers would then both increment.
    set_model_state_dict(fresh, copy.deepcopy(model_sd), options=set_options)
    set_optimizer_state_dict(fresh, fresh_opt, copy.deepcopy(optim_sd), options=set_options)
    _same_parameters(before, fresh, engine)
    _compare_snapshots(_snapshot(fresh, fresh_opt), _snapshot(model, opt), "reloaded", **EXACT)
    for step in (2, 3):
        got = _train_step(fresh, fresh_opt, model_name, step)
        want = _train_step(model, opt, model_name, step)
        assert got == want, f"step {step}: reloaded loss {got}, original {want}"


@pytest.mark.parametrize("layout", ["fsdp2", "fsdp4", "hsdp2x2"])
@pytest.mark.parametrize("model_name", MODEL_NAMES)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_full_state_dict_options(engine: str, model_name: str, layout: str) -> None:
    run_on_ranks(LAYOUTS[layout][0], _full_state_dict, engine, model_name, layout)


# ---------------------------------------------------------------------------------------------
# load_state_dict(assign=True)


def _load_assign(engine: str, source: str) -> None:
    mesh = _layout_mesh("fsdp2")
    src = _sharded(engine, "mlp", mesh, seed=0)
    if source == "plain":
        sd = build("mlp", seed=0).state_dict()
    else:  # clones: assigned parameters must not share storage with src's
        sd = {k: v.detach().clone() for k, v in src.state_dict().items()}
    if source == "meta_sharded":  # the usual way to load a checkpoint without init
        with torch.device("meta"):
            dst = build("mlp", seed=1)
        shard_model(dst, ENGINES[engine], mesh)
    else:
        dst = _sharded(engine, "mlp", mesh, seed=1)
    dst.load_state_dict(sd, assign=True)
    for name, p in dst.named_parameters():
        assert isinstance(p, DTensor) and not p.is_meta, f"{name} after assign"
    src_opt = make_optimizer("adamw", src.parameters())
    dst_opt = make_optimizer("adamw", dst.parameters())
    for step in range(2):
        got = _train_step(dst, dst_opt, "mlp", step)
        want = _train_step(src, src_opt, "mlp", step)
        assert got == want, f"step {step}: loss {got} after assign, want {want}"
        registered = list(dst.parameters())
        held = dst_opt.param_groups[0]["params"]
        assert all(p is q for p, q in zip(registered, held, strict=True)), (
            f"step {step}: the registered parameters are no longer the assigned ones the "
            "optimizer holds"
        )
    for (name, got), want in zip(full_params(dst).items(), full_params(src).values(), strict=True):
        torch.testing.assert_close(got, want, **EXACT, msg=lambda m, n=name: f"trained {n}: {m}")


@pytest.mark.parametrize(
    "engine, source",
    [
        pytest.param("fsdp2", "sharded"),
        pytest.param("torch", "sharded"),
        pytest.param("fsdp2", "meta_sharded"),
        pytest.param("torch", "meta_sharded"),
        # torch's FSDP2 cannot take plain tensors (AttributeError: no _local_tensor).
        pytest.param("fsdp2", "plain"),
    ],
)
def test_load_state_dict_assign(engine: str, source: str) -> None:
    run_on_ranks(2, _load_assign, engine, source)
