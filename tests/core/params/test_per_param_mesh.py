"""Per-parameter meshes: ``shard_placement_fn`` returning a ``ShardPlacementResult`` (4 ranks).

One ``fully_shard`` call then holds one parameter group per process group. The dense model
(``models.TinyTransformer``) puts each block's MLP weights on a 2D HSDP mesh (2 x 2, ``fc1``
on ``Shard(1)``) and everything else on the call's 1D mesh over the 4 ranks: every block and
the root have groups on both meshes, or one. torch's FSDP2 (torch 2.13's
``ShardPlacementResult(placement, mesh_info)``) runs the same layout in the same worker.
Checked:

* training: 3 AdamW steps with ``reshard_after_forward`` True / False / 2, with
  ``set_bucket_bytes``, and with a float64 ``MixedPrecisionPolicy`` and CPU offload (every
  group its own policies' buffers): losses, full gradients and full parameters match a replicated
  reference (fp32 tolerance) and torch's engine (bitwise);
* layout: each parameter a DTensor on its own mesh with torch's placements and local shape;
* collectives: per module and step, one all-gather and one reduce-scatter per group (plus
  the HSDP group's all-reduce), on that group's process group;
* torch's result objects and a ``dp_mesh_dims`` mesh passed to ``fsdp2.fully_shard``;
* setters and methods over several groups: ``unshard(async_op=True)`` / ``UnshardHandle``,
  ``reshard``, gradient accumulation without sync, ``set_reduce_scatter_unused_params``;
  custom collectives and the all-reduce hook refused as torch refuses them;
* state: ``state_dict`` keys and full values as the unsharded model's, a full state dict
  loads, DCP saves on this layout and loads on plain FSDP (and back);
* timeline lanes and debug mode name each group by its mesh;
* the FSDP1 layer: ``summon_full_params``, a FULL state dict, a FULL optimizer state dict
  saved and loaded into another such model;
* errors, raised before any collective with the model left unsharded and naming the
  parameter: a dim the parameter lacks, an uneven ``Shard(1)``, two mesh objects over the
  same process groups, a mesh without this rank, a mesh info fsdp2 cannot read, a result of
  the wrong type.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from comm_counter import Call, CommCounter
from helpers import ENGINES, check_close, expect_raises, train_and_compare
from models import build, full_params, local_loss, make_batch, make_optimizer, rank_slice
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp2
from fsdp2 import FSDPModule

try:  # torch 2.13+: torch's fully_shard takes per-parameter meshes too
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDataParallelMeshDims
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
except ImportError:  # older torch: fsdp2 alone, against the reference
    ShardPlacementResult = None

WORLD = 4
NAME = "transformer"
# the engines that have per-parameter meshes on this torch
HERE = ENGINES if ShardPlacementResult is not None else {"fsdp2": ENGINES["fsdp2"]}
needs_torch_results = pytest.mark.skipif(
    ShardPlacementResult is None, reason="torch's ShardPlacementResult is torch 2.13+"
)


def _meshes() -> tuple[DeviceMesh, DeviceMesh]:
    """The call's 1D mesh over the 4 ranks, and the 2D HSDP mesh of the MLP weights."""
    flat = init_device_mesh("cpu", (WORLD,))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return flat, hsdp


def _on_hsdp(model: nn.Module) -> dict[int, Shard]:
    """The parameters that shard over the HSDP mesh, with their placement."""
    out = {}
    for block in model.layers:
        out[id(block.fc1.weight)] = Shard(1)
        out[id(block.fc2.weight)] = Shard(0)
    return out


class _Results:
    """Builds each engine's ``ShardPlacementResult`` (torch's: one mesh info per mesh)."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.infos: dict[int, Any] = {}

    def __call__(self, placement: Shard, mesh: DeviceMesh) -> Any:
        if self.engine == "fsdp2":
            return fsdp2.ShardPlacementResult(placement, mesh)
        info = self.infos.get(id(mesh))
        if info is None:
            if mesh.ndim == 1:
                info = FSDPMeshInfo(mesh, shard_mesh_dim=0)
            else:
                info = HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
            self.infos[id(mesh)] = info
        return ShardPlacementResult(placement=placement, mesh_info=info)


def _shard(
    engine: str,
    model: nn.Module,
    results: str | None = None,
    root_kw: dict[str, Any] | None = None,
    **kw: Any,
) -> nn.Module:
    """Every block and the root with the MLP weights on the HSDP mesh (``results``: the
    engine whose result objects ``shard_placement_fn`` returns; the engine's own by default)."""
    flat, hsdp = _meshes()
    picked = _on_hsdp(model)
    make = _Results(results or engine)

    def fn(p: nn.Parameter) -> Any:
        return make(picked[id(p)], hsdp) if id(p) in picked else None

    for block in model.layers:
        ENGINES[engine](block, mesh=flat, shard_placement_fn=fn, **kw)
    ENGINES[engine](model, mesh=flat, shard_placement_fn=fn, **(root_kw or {}))
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return make_batch(NAME, step)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return local_loss(model, NAME, x, y)


# ---------------------------------------------------------------------------------------------
# Training parity and layout


def _parity(raf: bool | int, bucket: bool, policies: bool = False) -> None:
    def kw(engine: str, root: bool = False) -> dict[str, Any]:
        if not policies:
            return {}
        mp, off = (
            (fsdp2.MixedPrecisionPolicy, fsdp2.CPUOffloadPolicy)
            if engine == "fsdp2"
            else (TorchMixedPrecisionPolicy, TorchCPUOffloadPolicy)
        )
        out = torch.float32 if root else None  # the loss in the reference's dtype
        return {
            "mp_policy": mp(torch.float64, torch.float64, output_dtype=out),
            "offload_policy": off(pin_memory=False),
        }

    models = {
        e: _shard(e, build(NAME), reshard_after_forward=raf, root_kw=kw(e, True), **kw(e))
        for e in HERE
    }
    if bucket:
        models["fsdp2"].set_bucket_bytes(1 << 20)  # fsdp2 only
        models.pop("torch", None)
    ours = models["fsdp2"]
    for name, p in ours.named_parameters():
        assert isinstance(p, DTensor), name
    fc1 = ours.layers[0].fc1.weight
    assert fc1.device_mesh.ndim == 2 and fc1.placements == (Replicate(), Shard(1)), fc1.placements
    attn = ours.layers[0].attn.qkv.weight
    assert attn.device_mesh.ndim == 1 and attn.placements == (Shard(0),), attn.placements
    if "torch" in models:
        theirs = dict(models["torch"].named_parameters())
        for name, p in ours.named_parameters():
            t = theirs[name]
            assert p.placements == t.placements, (name, p.placements, t.placements)
            assert p.device_mesh.mesh.tolist() == t.device_mesh.mesh.tolist(), name
            assert p.to_local().shape == t.to_local().shape, name
    train_and_compare(build(NAME), models, batch=_batch, loss=_loss, check_init=True)


@pytest.mark.parametrize(
    "raf, bucket, policies",
    [
        (True, False, False),
        (False, False, False),
        (2, False, False),
        (True, True, False),
        (True, False, True),
    ],
    ids=["raf-True", "raf-False", "raf-2", "bucketed", "fp64-params-cpu-offload"],
)
def test_training_parity(raf: bool | int, bucket: bool, policies: bool) -> None:
    run_on_ranks(WORLD, _parity, raf, bucket, policies)


def _torch_objects_and_spmd() -> None:
    # torch's result objects, read by attribute
    ref = build(NAME)
    models = {"fsdp2": _shard("fsdp2", build(NAME), results="torch")}
    train_and_compare(ref, models, batch=_batch, loss=_loss, steps=2)
    # a full SPMD mesh with dp_mesh_dims as a per-parameter mesh: the MLP weights are
    # DTensors (Replicate) on a 2D mesh whose dims are named as data parallel (HSDP)
    spmd = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    flat = init_device_mesh("cpu", (WORLD,))
    model = build(NAME)
    for block in model.layers:
        block.fc1.weight = nn.Parameter(
            DTensor.from_local(block.fc1.weight.detach(), spmd, [Replicate(), Replicate()])
        )
        block.fc1.forward = _LocalLinear(block.fc1)  # computes on the local (full) weight
    dims = fsdp2.DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
    spmd_ids = {id(b.fc1.weight) for b in model.layers}
    # block 0 names the SPMD mesh with fsdp2's result, block 1 with torch's (a mesh info
    # built from torch's DataParallelMeshDims, as torchtitan builds it)
    theirs = ShardPlacementResult(
        placement=None,
        mesh_info=_get_mesh_info(
            spmd, TorchDataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
        ),
    )
    first = id(model.layers[0].fc1.weight)

    def fn(p: nn.Parameter) -> Any:
        if id(p) not in spmd_ids:
            return None
        return fsdp2.ShardPlacementResult(None, spmd, dims) if id(p) == first else theirs

    for block in model.layers:
        fsdp2.fully_shard(block, mesh=flat, shard_placement_fn=fn)
    fsdp2.fully_shard(model, mesh=flat)
    for block in model.layers:
        assert block.fc1.weight.device_mesh is spmd
        assert block.fc1.weight.placements == (Replicate(), Shard(0)), block.fc1.weight.placements
    train_and_compare(build(NAME), {"fsdp2": model}, batch=_batch, loss=_loss, steps=2)


class _LocalLinear:
    """``linear.forward`` on its weight's local tensor (the weight is a replicated DTensor)."""

    def __init__(self, linear: nn.Linear) -> None:
        self.linear = linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.linear.weight
        return F.linear(x, w.to_local() if isinstance(w, DTensor) else w, self.linear.bias)


@needs_torch_results
def test_torch_results_and_spmd_mesh() -> None:
    run_on_ranks(WORLD, _torch_objects_and_spmd)


# ---------------------------------------------------------------------------------------------
# Collectives per group


def _counts(engine: str) -> None:
    model = _shard(engine, build(NAME))
    x, y = make_batch(NAME, 0)
    rank = dist.get_rank()
    steps = []
    with CommCounter() as counter:
        for _ in range(2):
            model.zero_grad()
            counter.phase = "forward"
            loss = _loss(model, rank_slice(x, rank, WORLD), rank_slice(y, rank, WORLD))
            counter.phase = "backward"
            loss.backward()
            steps.append(
                Counter(
                    (c.phase, c.kind, c.group_size) for c in counter.take() if isinstance(c, Call)
                )
            )
    n = len(model.layers)
    # forward: each block gathers its 1D group (4 ranks) and its HSDP group (2 ranks), the
    # root its 1D group; backward: the blocks gather both again (resharded after forward),
    # and every group reduce-scatters once, the HSDP groups all-reduce once
    want = Counter(
        {
            ("forward", "AG", 4): n + 1,
            ("forward", "AG", 2): n,
            ("backward", "AG", 4): n,
            ("backward", "AG", 2): n,
            ("backward", "RS", 4): n + 1,
            ("backward", "RS", 2): n,
            ("backward", "AR", 2): n,
        }
    )
    for i, got in enumerate(steps):
        assert got == want, f"{engine} step {i}: got {dict(got)}, want {dict(want)}"


@pytest.mark.parametrize("engine", list(HERE))
def test_one_collective_per_group(engine: str) -> None:
    run_on_ranks(WORLD, _counts, engine)


# ---------------------------------------------------------------------------------------------
# Methods and setters over several groups


def _methods() -> None:
    model = _shard("fsdp2", build(NAME))
    block = model.layers[0]
    assert isinstance(block, FSDPModule)
    handle = block.unshard(async_op=True)
    assert handle is not None
    handle.wait()
    for name, p in block.named_parameters():
        assert not isinstance(p, DTensor), f"{name} still sharded after unshard()"
    block.reshard()
    for name, p in block.named_parameters():
        assert isinstance(p, DTensor), f"{name} not sharded after reshard()"

    # gradient accumulation without sync, then a synced backward: the reference sees both
    # microbatches' mean
    def accumulate(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        half = x.size(0) // 2
        if isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(False)
        first = _loss(m, x[:half], y[:half]) / 2
        first.backward()
        if isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(True)
        second = _loss(m, x[half:], y[half:]) / 2
        second.backward()
        return (first + second).detach()

    train_and_compare(
        build(NAME),
        {"fsdp2": _shard("fsdp2", build(NAME))},
        batch=_batch,
        forward_backward=accumulate,
        steps=2,
    )
    # unused parameters reduced as zeros on both meshes
    unused = _shard("fsdp2", build(NAME))
    unused.set_reduce_scatter_unused_params(True)
    x, y = make_batch(NAME, 0)
    rank = dist.get_rank()
    _loss(unused, rank_slice(x, rank, WORLD), rank_slice(y, rank, WORLD)).backward()
    for name, p in unused.named_parameters():
        assert p.grad is not None, name
    # one comm for several meshes is ambiguous: refused, as torch refuses it (the
    # all-reduce hook is not: see test_all_reduce_hook_on_several_groups)
    for method, arg in [
        ("set_custom_all_gather", _NoComm()),
        ("set_custom_reduce_scatter", _NoReduce()),
    ]:
        with expect_raises(method, ValueError, match="2 parameter groups on different meshes"):
            getattr(block, method)(arg)


class _NoComm(fsdp2.AllGather):
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("never called")


class _NoReduce(fsdp2.ReduceScatter):
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("never called")


def test_methods_over_several_groups() -> None:
    run_on_ranks(WORLD, _methods)


def _hook_on_several_groups() -> dict[str, int]:
    flat, hsdp = _meshes()
    x, y = make_batch(NAME, 0)
    rank = dist.get_rank()
    xs, ys = rank_slice(x, rank, WORLD), rank_slice(y, rank, WORLD)
    plain, every, per = (_shard("fsdp2", build(NAME)) for _ in range(3))
    calls: dict[str, int] = {"every": 0, "hsdp": 0}

    def double(t: torch.Tensor, key: str) -> None:
        calls[key] += 1
        t.mul_(2)

    for m in every.modules():
        if isinstance(m, FSDPModule):  # no mesh=: every group of the call
            m.set_all_reduce_hook(lambda t: double(t, "every"))
    for block in per.layers:  # mesh=: the MLP weights' group only
        block.set_all_reduce_hook(lambda t: double(t, "hsdp"), mesh=hsdp)
    with expect_raises("set_all_reduce_hook", ValueError, match="no parameter group of"):
        per.set_all_reduce_hook(lambda t: None, mesh=hsdp)  # the root's group is flat
    if ShardPlacementResult is not None:  # torch's per-parameter meshes (2.13+) refuse it
        theirs = _shard("torch", build(NAME))
        with pytest.raises(Exception) as refused:
            theirs.layers[0].set_all_reduce_hook(lambda t: None)
        calls["torch refuses"] = int("group" in str(refused.value).lower())
    for model in (plain, every, per):
        _loss(model, xs, ys).backward()
    doubled = 0
    params = zip(plain.named_parameters(), every.parameters(), per.parameters(), strict=True)
    for (name, p), q, r in params:
        want = p.grad.to_local()
        assert torch.equal(q.grad.to_local(), want * 2), name
        on_hsdp = p.device_mesh.ndim == 2
        doubled += on_hsdp
        assert torch.equal(r.grad.to_local(), want * 2 if on_hsdp else want), name
    return calls | {"doubled": doubled}


def test_all_reduce_hook_on_several_groups() -> None:
    # torch's FSDP2 refuses a hook on a call with several groups (torchtitan issues 4208,
    # 4664: no torchft with expert parallelism); fsdp2 calls it once per group, or only on
    # the group of ``mesh``.
    for out in run_on_ranks(WORLD, _hook_on_several_groups):
        blocks = len(build(NAME).layers)
        assert out["hsdp"] == blocks and out["every"] > out["hsdp"] and out["doubled"] > 0, out
        assert out.get("torch refuses", 1) == 1, out


# ---------------------------------------------------------------------------------------------
# State dicts and DCP


def _state(path: str) -> None:
    ref = build(NAME)
    model = _shard("fsdp2", build(NAME))
    sd = model.state_dict()
    assert sd.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        full = sd[k].full_tensor() if isinstance(sd[k], DTensor) else sd[k]
        check_close(full, v, k)
    # a full state dict of another init loads into the sharded model
    other = build(NAME, seed=3)
    model.load_state_dict(other.state_dict())
    for k, v in full_params(model).items():
        check_close(v, dict(other.named_parameters())[k], f"loaded {k}")
    # DCP: save on this layout (a step taken), load into plain FSDP over the 4 ranks
    opt = make_optimizer("adamw", model.parameters())
    x, y = make_batch(NAME, 0)
    rank = dist.get_rank()
    _loss(model, rank_slice(x, rank, WORLD), rank_slice(y, rank, WORLD)).backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    plain = build(NAME, seed=7)
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in plain.layers:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(plain, mesh=mesh)
    plain_opt = make_optimizer("adamw", plain.parameters())
    pm, po = get_state_dict(plain, plain_opt)
    dcp.load({"model": pm, "optim": po}, checkpoint_id=path)
    set_state_dict(plain, plain_opt, model_state_dict=pm, optim_state_dict=po)
    want = full_params(model)
    for k, v in full_params(plain).items():
        check_close(v, want[k], f"DCP-loaded {k}")
    # and back onto the per-parameter layout
    again = _shard("fsdp2", build(NAME, seed=9))
    am, _ = get_state_dict(again, make_optimizer("adamw", again.parameters()))
    dcp.load({"model": am}, checkpoint_id=path)
    set_model_state_dict(again, am)
    for k, v in full_params(again).items():
        check_close(v, want[k], f"reloaded {k}")


def test_state_dict_and_dcp(tmp_path: Any) -> None:
    run_on_ranks(WORLD, _state, os.fspath(tmp_path / "ckpt"))


# ---------------------------------------------------------------------------------------------
# Timeline and debug mode


def _observed() -> None:
    model = _shard("fsdp2", build(NAME))
    x, y = make_batch(NAME, 0)
    rank = dist.get_rank()
    xs, ys = rank_slice(x, rank, WORLD), rank_slice(y, rank, WORLD)
    fsdp2.set_debug(True)
    try:
        for _ in range(2):
            _loss(model, xs, ys).backward()
    finally:
        fsdp2.set_debug(False)
    with fsdp2.timeline() as tl:
        _loss(model, xs, ys).backward()
    lanes = set(tl.lanes)
    assert "layers.0 (mesh replicate/shard)" in lanes, lanes
    assert "layers.0 (mesh 4)" in lanes, lanes


def test_timeline_and_debug_name_groups() -> None:
    run_on_ranks(WORLD, _observed)


# ---------------------------------------------------------------------------------------------
# Errors


def _errors() -> None:
    flat, hsdp = _meshes()
    rank = dist.get_rank()

    def check(fn: Any, exc: type[BaseException], match: str, small: bool = False) -> None:
        block = nn.Linear(3, 5) if small else build(NAME).layers[0]
        with expect_raises(match, exc, match=match):
            fsdp2.fully_shard(block, mesh=flat, shard_placement_fn=fn)
        assert not isinstance(block, FSDPModule), "half-sharded after an error"
        assert not any(isinstance(p, DTensor) for p in block.parameters()), "half-sharded"

    def on_fc1(result: Any) -> Any:
        return lambda p: result if p.dim() == 2 and p.shape == (40, 24) else None

    check(on_fc1(fsdp2.ShardPlacementResult(Shard(2), hsdp)), ValueError, r"fc1\.weight")
    check(
        lambda p: fsdp2.ShardPlacementResult(Shard(1), flat),
        ValueError,
        r"weight has size 3 on dim 1, not divisible by the shard world size 4",
        small=True,
    )
    # another mesh object over the same process groups as the call's
    twin = DeviceMesh.from_group(flat.get_group(), "cpu")
    check(
        on_fc1(fsdp2.ShardPlacementResult(Shard(0), twin)),
        ValueError,
        r"fc1\.weight shards over mesh .* a different mesh object",
    )
    # torch's DDPMeshInfo-like info (no shard dim) cannot be read
    if ShardPlacementResult is not None:
        info = FSDPMeshInfo(hsdp, shard_mesh_dim=0)
        bad = ShardPlacementResult(placement=Shard(0), mesh_info=info)
        check(on_fc1(bad), ValueError, r"shard_mesh_dim=0, replicate_mesh_dim=None on a 2D mesh")
    check(on_fc1("dim 0"), TypeError, r"returned 'dim 0' for fc1\.weight")
    # a mesh over ranks 0 and 1 only (created on every rank: mesh creation is collective)
    pair = DeviceMesh("cpu", torch.tensor([0, 1]))
    if rank >= 2:
        check(
            on_fc1(fsdp2.ShardPlacementResult(None, pair)),
            ValueError,
            r"fc1\.weight shards over mesh .* does not include this rank",
        )
    # an int reshard_after_forward that one mesh's shard size does not take
    model = build(NAME)
    with expect_raises("raf=4", ValueError, match="a mesh named by shard_placement_fn has 2"):
        fsdp2.fully_shard(
            model.layers[0],
            mesh=flat,
            reshard_after_forward=4,
            shard_placement_fn=on_fc1(fsdp2.ShardPlacementResult(None, hsdp)),
        )
    assert not isinstance(model.layers[0], FSDPModule)


def test_errors_before_any_collective() -> None:
    run_on_ranks(WORLD, _errors)


# ---------------------------------------------------------------------------------------------
# The FSDP1 layer over several groups per module


def _fsdp1() -> None:
    from fsdp2 import fsdp1

    ref = build(NAME)
    model = _shard("fsdp2", build(NAME))
    with fsdp1.summon_full_params(model):
        for name, p in model.named_parameters():
            check_close(p.detach(), dict(ref.named_parameters())[name], f"summoned {name}")
    full = fsdp1.get_state_dict(model, fsdp1.StateDictType.FULL_STATE_DICT)
    for k, v in ref.state_dict().items():
        check_close(full[k], v, f"FULL_STATE_DICT {k}")
    opt = make_optimizer("adamw", model.parameters())
    x, y = make_batch(NAME, 0)
    rank = dist.get_rank()
    _loss(model, rank_slice(x, rank, WORLD), rank_slice(y, rank, WORLD)).backward()
    opt.step()
    osd = fsdp1.optim_state_dict(model, opt, state_dict_type=fsdp1.StateDictType.FULL_STATE_DICT)
    assert osd["state"].keys() == {n for n, _ in ref.named_parameters()}
    for name, st in osd["state"].items():
        assert st["exp_avg"].shape == dict(ref.named_parameters())[name].shape, name
    other = _shard("fsdp2", build(NAME, seed=5))
    other_opt = make_optimizer("adamw", other.parameters())
    loadable = fsdp1.optim_state_dict_to_load(
        other, other_opt, osd, state_dict_type=fsdp1.StateDictType.FULL_STATE_DICT
    )
    other_opt.load_state_dict(loadable)
    for (name, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
        a, b = opt.state[p]["exp_avg"], other_opt.state[q]["exp_avg"]
        check_close(b.full_tensor(), a.full_tensor(), f"reloaded exp_avg of {name}")


def test_fsdp1_layer_over_several_groups() -> None:
    run_on_ranks(WORLD, _fsdp1)
