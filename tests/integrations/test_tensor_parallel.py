"""FSDP + tensor parallelism (2D and HSDP + TP 3D meshes) on 4 gloo ranks.

``tp_models.TPModel`` (a small transformer) is tensor-parallelized with ``parallelize_module``
on ``mesh["tp"]`` (``ColwiseParallel`` / ``RowwiseParallel``; the ``tp_sp`` plan also puts the
norms under ``SequenceParallel``, so every parameter is a DTensor on the TP mesh), then sharded
with ``fully_shard(block, mesh=dp_mesh)`` per block and on the root. The same is done with
``torch.distributed.fsdp.fully_shard`` in the same rank function. Checked:

* layout: every parameter's mesh dims, placements and local shape equal torch's (e.g.
  ``(_StridedShard(dim=0, sf=2), Shard(dim=0))`` for a colwise weight on ``(dp, tp)``), and
  ``full_tensor()`` equals the unsharded model's parameter after init;
* training: 2 AdamW steps, each rank on its data-parallel slice of a global batch: loss, full
  gradients and full parameters match a replicated unsharded model (fp32 tolerance) and
  torch's engine (bitwise, as in ``tests/core/test_parity.py``);
* meshes: FSDP ``(dp, tp) = (2, 2)`` with both plans, and HSDP ``(replicate, shard, tp) =
  (1, 2, 2)`` (``tp_sp``) and ``(2, 1, 2)`` (``tp``), each with the other plan ``long``;
* meta-device init (``parallelize_module`` and ``fully_shard`` on meta, ``to_empty``,
  ``reset_parameters``): same layout and same values as torch, then training parity;
* errors: a DTensor parameter on a mesh that is not another dimension of the data-parallel
  mesh's root raises ``ValueError`` naming the parameter (torch raises too, other types);
* state: a full plain state dict of the unsharded model loads into the sharded model (fsdp2
  only) and training continues like the reference; DCP checkpoints (model + AdamW) of either
  engine's FSDP + TP model load exactly into either engine, as FSDP + TP or as plain FSDP(4);
* ``.double()`` after ``fully_shard`` (fsdp2 only: torch's FSDP2 has no ``.to(dtype)`` after
  sharding) gives float64 unsharded TP parameters in forward and float64-exact gradients.

Gradient clipping with FSDP + TP is in ``tests/test_clip_grad_norm.py``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _harness import run_on_ranks
from helpers import ENGINES, check_close, train_and_compare
from models import full_grads, full_params, mean_over_ranks, rank_slice, shard_model
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from tp_models import (
    MESHES,
    TPModel,
    build_tp_model,
    dp_rank_and_size,
    make_meshes,
    parallelize,
    tp_batch,
    tp_loss,
)

import fsdp2
from fsdp2 import FSDPModule

WORLD_SIZE = 4
STEPS = 2  # the second step runs on AdamW's state of the first


def _layout(model: nn.Module) -> dict[str, tuple[Any, str, tuple[int, ...]]]:
    """name -> (mesh dim names, placements as text, local shape); text so that a
    ``_StridedShard`` never compares equal to a ``Shard``."""
    return {
        n: (p.device_mesh.mesh_dim_names, repr(tuple(p.placements)), tuple(p.to_local().shape))
        for n, p in model.named_parameters()
    }


def _expected_placements(plan: str, hsdp: bool) -> dict[str, tuple[Any, ...]]:
    """Placements of representative parameters, as torch documents them for FSDP + TP."""
    rep = (Replicate(),) if hsdp else ()
    colwise = (*rep, _StridedShard(0, split_factor=2), Shard(0))
    rowwise = (*rep, Shard(0), Shard(1))
    replicated_on_tp = (*rep, Shard(0), Replicate())
    norm = replicated_on_tp if plan == "tp_sp" else (*rep, Shard(0))
    return {
        "tok_emb.weight": colwise,  # RowwiseParallel on an embedding shards its rows
        "layers.0.attn.wq.weight": colwise,
        "layers.0.attn.wo.weight": rowwise,
        "layers.0.attn.wo.bias": replicated_on_tp,
        "layers.1.w1.weight": colwise,
        "layers.1.w1.bias": colwise,
        "layers.1.w2.weight": rowwise,
        "layers.1.mlp_norm.bias": norm,
        "norm.weight": norm,
        "head.weight": colwise,
    }


# ---------------------------------------------------------------------------------------------
# Layout and training parity


def _tp_parity(mesh_name: str, plan: str) -> None:
    mesh, dp_mesh, tp_mesh = make_meshes(mesh_name)
    ref = build_tp_model()
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    models: dict[str, nn.Module] = {}
    for engine, fn in ENGINES.items():
        model = parallelize(build_tp_model(), tp_mesh, plan)
        models[engine] = shard_model(model, fn, dp_mesh)
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), f"{engine}: {name} is not a DTensor"
        for name, full in full_params(model).items():
            torch.testing.assert_close(
                full,
                ref_params[name],
                rtol=0,
                atol=0,
                msg=lambda m, n=name, e=engine: f"{e} init {n}: {m}",
            )

    ours, theirs = _layout(models["fsdp2"]), _layout(models["torch"])
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name] == theirs[name], f"{name}: fsdp2 {ours[name]}, torch {theirs[name]}"
    named = dict(models["fsdp2"].named_parameters())
    for name, want in _expected_placements(plan, hsdp=len(dp_mesh.shape) == 2).items():
        got = tuple(named[name].placements)
        assert repr(got) == repr(want), f"{name}: placements {got}, want {want}"

    _train_and_compare(ref, models, mesh)


def _train_and_compare(
    ref: nn.Module, models: dict[str, nn.Module], mesh: DeviceMesh, steps: int = STEPS
) -> None:
    """``helpers.train_and_compare`` with AdamW: ``ref`` on the global batch, each engine's
    model on its data-parallel slice; loss, full grads and full params against ``ref``,
    fsdp2 against torch bitwise (same TP ops, same padding, same flat reduce-scatter). Every
    TP rank of a data-parallel rank holds the same loss: the mean over all ranks is the mean
    over data-parallel ranks."""
    train_and_compare(
        ref,
        models,
        batch=tp_batch,
        loss=tp_loss,
        steps=steps,
        data_parallel=dp_rank_and_size(mesh),
    )


# Both plans on the 2D mesh; each HSDP + TP mesh with one plan in the main suite, the other
# plan in `make test-long` (its layout and code path run on fsdp2x2).
_PARITY_LONG = {("hsdp1x2x2", "tp"), ("hsdp2x1x2", "tp_sp")}


@pytest.mark.parametrize(
    "mesh_name, plan",
    [
        pytest.param(
            mesh_name,
            plan,
            id=f"{mesh_name}-{plan}",
            marks=pytest.mark.long if (mesh_name, plan) in _PARITY_LONG else (),
        )
        for plan in ("tp", "tp_sp")
        for mesh_name in MESHES
    ],
)
def test_fsdp_tp_layout_and_parity(mesh_name: str, plan: str) -> None:
    run_on_ranks(WORLD_SIZE, _tp_parity, mesh_name, plan)


def _meta_init_tp(plan: str) -> None:
    mesh, dp_mesh, tp_mesh = make_meshes("fsdp2x2")
    models: dict[str, nn.Module] = {}
    inits: dict[str, dict[str, torch.Tensor]] = {}
    for engine, fn in ENGINES.items():
        with torch.device("meta"):
            model = TPModel()
        shard_model(parallelize(model, tp_mesh, plan), fn, dp_mesh)
        params = list(model.parameters())
        model.to_empty(device="cpu")
        assert all(p is q for p, q in zip(params, model.parameters(), strict=True)), engine
        torch.manual_seed(0)
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) and not p.to_local().is_meta, f"{engine}: {name}"
        models[engine], inits[engine] = model, full_params(model)
    ours, theirs = _layout(models["fsdp2"]), _layout(models["torch"])
    assert ours == theirs, "meta-initialized layouts differ between the engines"
    for name, want in inits["torch"].items():
        assert torch.equal(inits["fsdp2"][name], want), f"{name}: re-init differs from torch's"
    ref = TPModel()
    ref.load_state_dict(inits["fsdp2"])
    _train_and_compare(ref, models, mesh, steps=2)


@pytest.mark.parametrize("plan", ["tp", "tp_sp"])
def test_meta_init_fsdp_tp(plan: str) -> None:
    """Meta device -> parallelize_module -> fully_shard -> to_empty -> reset_parameters."""
    run_on_ranks(WORLD_SIZE, _meta_init_tp, plan)


# ---------------------------------------------------------------------------------------------
# A DTensor parameter on a mesh that does not compose with the data-parallel mesh


def _unrelated_mesh(engine: str, case: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    if case == "world_1d":  # (dp, world) would need 8 ranks
        other = init_device_mesh("cpu", (WORLD_SIZE,))
    elif case == "other_root_overlapping":  # ranks {0, 2} / {1, 3}: the dp dimension again
        other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))["x"]
    else:
        assert case == "dp_mesh_itself", case
        other = mesh["dp"]
    fn = ENGINES[engine]
    lin = nn.Linear(4, 4, bias=False)
    weight = nn.Parameter(distribute_tensor(lin.weight.detach(), other, [Shard(0)]))
    lin.weight = weight
    if engine == "fsdp2":
        with pytest.raises(
            ValueError, match=r"parameter weight is a DTensor on mesh .*not another dimension"
        ):
            fn(lin, mesh=mesh["dp"])
        assert lin.weight is weight, "a failed fully_shard replaced the parameter"
        assert not isinstance(lin, FSDPModule), "a failed fully_shard swapped the class"
    else:  # torch raises too, though not a ValueError (TypeError / RuntimeError)
        with pytest.raises(Exception):  # noqa: B017
            fn(lin, mesh=mesh["dp"])


@pytest.mark.parametrize("case", ["world_1d", "other_root_overlapping", "dp_mesh_itself"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_dtensor_param_on_unrelated_mesh_raises(engine: str, case: str) -> None:
    run_on_ranks(WORLD_SIZE, _unrelated_mesh, engine, case)


# ---------------------------------------------------------------------------------------------
# State dicts and checkpoints of FSDP + TP models


def _full_plain_into_tp(plan: str) -> None:
    mesh, dp_mesh, tp_mesh = make_meshes("fsdp2x2")
    dp_rank, dp_size = dp_rank_and_size(mesh)
    torch.manual_seed(5)
    ckpt = TPModel()  # an unsharded checkpoint, identical on every rank
    model = shard_model(parallelize(build_tp_model(), tp_mesh, plan), fsdp2.fully_shard, dp_mesh)
    before = _layout(model)
    params = list(model.parameters())
    result = model.load_state_dict(ckpt.state_dict())
    assert not result.missing_keys and not result.unexpected_keys, result
    assert _layout(model) == before, "loading changed placements or local shapes"
    assert all(p is q for p, q in zip(params, model.parameters(), strict=True))
    for name, full in full_params(model).items():
        torch.testing.assert_close(
            full,
            ckpt.get_parameter(name).detach(),
            rtol=0,
            atol=0,
            msg=lambda m, n=name: f"{n}: {m}",
        )
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ckpt))
    for step in range(2):
        x, y = tp_batch(step)
        ref_loss = tp_loss(ckpt, x, y)
        ref_loss.backward()
        loss = tp_loss(model, rank_slice(x, dp_rank, dp_size), rank_slice(y, dp_rank, dp_size))
        loss.backward()
        check_close(mean_over_ranks(loss), ref_loss.detach(), f"step {step} loss")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for name, full in full_params(model).items():
        check_close(full, ckpt.get_parameter(name).detach(), f"trained {name}")


@pytest.mark.parametrize("plan", ["tp", "tp_sp"])
def test_full_plain_state_dict_loads_into_fsdp_tp(plan: str) -> None:
    """fsdp2 only: torch's FSDP2 does not load plain tensors into DTensor parameters."""
    run_on_ranks(WORLD_SIZE, _full_plain_into_tp, plan)


def _tp_dcp(root: str) -> None:
    mesh, dp_mesh, tp_mesh = make_meshes("fsdp2x2")
    dp_rank, dp_size = dp_rank_and_size(mesh)
    saved: dict[str, dict[str, torch.Tensor]] = {}
    for engine, fn in ENGINES.items():
        model = shard_model(parallelize(build_tp_model(), tp_mesh, "tp"), fn, dp_mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = tp_batch(0)
        tp_loss(model, rank_slice(x, dp_rank, dp_size), rank_slice(y, dp_rank, dp_size)).backward()
        opt.step()
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, engine))
        saved[engine] = {**full_params(model), **_full_optim_state(model, opt)}
    plain_fsdp = init_device_mesh("cpu", (WORLD_SIZE,))
    for saver in ENGINES:
        for loader, fn in ENGINES.items():
            for target in ("fsdp_tp", "fsdp_1d"):
                what = f"{saver} FSDP+TP checkpoint -> {loader} {target}"
                torch.manual_seed(3)  # an init that differs from the saved one
                model = TPModel()
                if target == "fsdp_tp":
                    shard_model(parallelize(model, tp_mesh, "tp"), fn, dp_mesh)
                else:
                    shard_model(model, fn, plain_fsdp)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                model_sd, optim_sd = get_state_dict(model, opt)
                state = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, checkpoint_id=os.path.join(root, saver))
                set_state_dict(
                    model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
                )
                got = {**full_params(model), **_full_optim_state(model, opt)}
                assert got.keys() == saved[saver].keys(), what
                for key, want in saved[saver].items():
                    torch.testing.assert_close(
                        got[key], want, rtol=0, atol=0, msg=lambda m, k=key, w=what: f"{w} {k}: {m}"
                    )


def _full_optim_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        for key, value in sorted(opt.state[p].items()):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            out[f"{key} of {name}"] = full.detach().clone()
    return out


def test_dcp_fsdp_tp_across_engines_and_layouts(tmp_path) -> None:
    """Each engine's FSDP+TP checkpoint loads into each engine, as FSDP+TP and as plain FSDP."""
    run_on_ranks(WORLD_SIZE, _tp_dcp, str(tmp_path))


# ---------------------------------------------------------------------------------------------
# Conversions after fully_shard


def _double_tp(plan: str) -> None:
    mesh, dp_mesh, tp_mesh = make_meshes("fsdp2x2")
    dp_rank, dp_size = dp_rank_and_size(mesh)
    ref = build_tp_model().double()
    model = shard_model(parallelize(build_tp_model(), tp_mesh, plan), fsdp2.fully_shard, dp_mesh)
    model.double()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float64 and p.to_local().dtype == torch.float64, name
    seen: dict[str, tuple[torch.dtype, torch.dtype]] = {}

    def record(block: nn.Module, args: Any) -> None:
        for name, p in block.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            seen[name] = (p.dtype, local.dtype)

    model.layers[0].register_forward_pre_hook(record)  # runs after fsdp2's (prepended) unshard
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    tight = {"rtol": 1e-10, "atol": 1e-10}
    for step in range(2):
        x, y = tp_batch(step)
        ref_loss = tp_loss(ref, x, y)
        ref_loss.backward()
        loss = tp_loss(model, rank_slice(x, dp_rank, dp_size), rank_slice(y, dp_rank, dp_size))
        loss.backward()
        torch.testing.assert_close(mean_over_ranks(loss), ref_loss.detach(), **tight)
        wrong = {n: d for n, d in seen.items() if d != (torch.float64, torch.float64)}
        grad_err = {
            name: (grad - ref.get_parameter(name).grad).abs().max().item()
            for name, grad in full_grads(model).items()
        }
        bad_grads = {n: f"{e:.1e}" for n, e in grad_err.items() if e > tight["atol"]}
        assert not wrong and not bad_grads, (
            f"step {step}: unsharded parameters in forward as (dtype, local dtype): {wrong}; "
            f"gradients off the float64 reference by (max abs): {bad_grads}"
        )
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()


@pytest.mark.parametrize("plan", ["tp", "tp_sp"])
def test_double_after_fully_shard_fsdp_tp(plan: str) -> None:
    """fsdp2 only: torch's FSDP2 has no ``.to(dtype)`` after sharding. The unsharded TP
    parameters seen in forward must be float64 DTensors, gradients float64-exact."""
    run_on_ranks(WORLD_SIZE, _double_tp, plan)
