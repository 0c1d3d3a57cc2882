"""``fsdp2.replicate`` and ``Replicate()`` from ``shard_placement_fn`` (2 gloo ranks).

``replicate(module, mesh=...)`` keeps parameters whole (``Replicate()`` DTensors) and
all-reduces gradients, on fully_shard's engine; it mixes with ``fully_shard`` in one model.
torch's ``replicate`` (``torch.distributed._composable.replicate_with_fsdp``) runs the same
layouts in the same worker. Checked:

* training, 3 AdamW steps against a replicated reference (fp32 tolerance) and torch's engine
  (bitwise): every module replicated, sharded first block with replicated rest, replicated
  blocks under a sharded root; bf16 ``MixedPrecisionPolicy`` (fp32 reduce); accumulation
  without gradient sync; ``set_gradient_divide_factor``;
* layout: ``Replicate()`` on the 1D mesh, whole local tensors, ``Replicate<Class>`` classes
  that are ``ReplicateModule`` and ``FSDPModule``; forward reads the parameters in place (the
  unsharded parameter's storage is the sharded one's: no copy); no all-gather, one
  all-reduce per replicated group per backward;
* call orders: an optimizer built after a forward, evaluation mid-run, freezing a replicated
  block mid-run, a cast to float64 after a step, an optimizer step between a forward and its
  backward (fails as on the plain module, never silently); ``clip_grad_norm_`` over sharded
  and replicated gradients; ``set_all_reduce_hook``;
* ``Replicate()`` per parameter (1-D parameters of fully_shard blocks, also through
  ``ShardPlacementResult``): placements, all-gathers without them, training like the
  reference;
* checkpoints: ``state_dict`` keys and values, DCP saved replicated and loaded sharded and back
  (model and optimizer), ``fsdp2.checkpoint`` full checkpoints and ``iter_full_tensors``;
* ``estimate_memory`` and the timeline on replicated groups; the framework switch's names;
* errors, before any collective: a 2D mesh, shard dims in ``dp_mesh_dims``, a module already
  managed by the other API, a container.

TP with ``dp_mesh_dims`` and HSDP meshes are in test_dp_mesh_dims.py; FSDP1's ``NO_SHARD``
in tests/fsdp1.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _harness import run_on_ranks
from comm_counter import CommCounter
from helpers import ENGINES, check_close, train_and_compare
from models import (
    build,
    full_grads,
    full_params,
    local_loss,
    make_batch,
    make_optimizer,
    rank_slice,
)
from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp2
from fsdp2 import FSDPModule, ReplicateModule

NAME = "mlp_head"  # blocks 7->5->3->1 and a head 1->2 at the root
REPLICATE = {"fsdp2": fsdp2.replicate, "torch": torch_replicate}
BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}


def _apply(engine: str, model: nn.Module, layout: str, **kw: Any) -> nn.Module:
    """Shard and/or replicate ``model``'s blocks and root as ``layout`` says."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rep, shard = REPLICATE[engine], ENGINES[engine]
    blocks = list(model.layers)
    if layout == "replicate":
        for b in blocks:
            rep(b, mesh=mesh, **kw)
        rep(model, mesh=mesh, **kw)
    elif layout == "sharded_first":  # the first block sharded, the rest replicated
        shard(blocks[0], mesh=mesh, **kw)
        for b in blocks[1:]:
            rep(b, mesh=mesh, **kw)
        rep(model, mesh=mesh, **kw)
    elif layout == "sharded_root":  # replicated blocks under a sharded root
        for b in blocks:
            rep(b, mesh=mesh, **kw)
        shard(model, mesh=mesh, **kw)
    else:
        raise AssertionError(layout)
    return model


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return local_loss(model, NAME, x, y)


def _parity() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layout in ("replicate", "sharded_first", "sharded_root"):
        models = {e: _apply(e, build(NAME), layout) for e in ("fsdp2", "torch")}
        train_and_compare(build(NAME), models, batch=lambda s: make_batch(NAME, s), loss=_loss)
    # mixed precision: bf16 compute, fp32 reduce
    mp = {
        "fsdp2": fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    }
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    mp["torch"] = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = {e: _apply(e, build(NAME), "sharded_first", mp_policy=mp[e]) for e in mp}
    train_and_compare(
        build(NAME), models, batch=lambda s: make_batch(NAME, s), loss=_loss, tol=BF16_TOL
    )

    # accumulation without sync (two micro-steps of one row per rank): like torch's,
    # bitwise, and like the reference's whole batch (a mean over rows)
    def micro(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model.set_requires_gradient_sync(False)
        loss_a = _loss(model, x[:1], y[:1]) / 2
        loss_a.backward()
        model.set_requires_gradient_sync(True)
        loss_b = _loss(model, x[1:], y[1:]) / 2
        loss_b.backward()
        return loss_a.detach() + loss_b.detach()

    def plain(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = _loss(model, x, y)
        loss.backward()
        return loss

    ref = build(NAME)
    models = {e: _apply(e, build(NAME), "replicate") for e in ("fsdp2", "torch")}
    train_and_compare(
        ref,
        models,
        batch=lambda s: make_batch(NAME, s, 4),
        forward_backward=lambda m, x, y: plain(m, x, y) if m is ref else micro(m, x, y),
    )
    summed = {e: _apply(e, build(NAME), "replicate") for e in ("fsdp2", "torch")}
    runs = {}
    for engine, model in summed.items():
        for m in model.modules():
            if isinstance(m, (FSDPModule, torch_fsdp_module())):
                m.set_gradient_divide_factor(1.0)
        x, y = make_batch(NAME, 0)
        r, w = dist.get_rank(), dist.get_world_size()
        _loss(model, rank_slice(x, r, w), rank_slice(y, r, w)).backward()
        runs[engine] = full_grads(model)
    for n, g in runs["fsdp2"].items():
        assert torch.equal(g, runs["torch"][n]), f"divide factor 1: {n}"
    out["ok"] = True
    return out


def torch_fsdp_module() -> type:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    return TorchFSDPModule


def test_replicate_trains_like_torch_and_the_reference() -> None:
    assert run_on_ranks(2, _parity)[0]["ok"]


# ---------------------------------------------------------------------------------------------
# Layout, traffic, call orders


def _behaviours() -> dict[str, Any]:
    out: dict[str, Any] = {}
    r, w = dist.get_rank(), dist.get_world_size()
    model = _apply("fsdp2", build(NAME), "sharded_first")
    block = model.layers[1]
    out["classes"] = [type(model).__name__, type(block).__name__, type(model.layers[0]).__name__]
    out["isinstance"] = (
        isinstance(block, ReplicateModule),
        isinstance(block, FSDPModule),
        isinstance(model.layers[0], ReplicateModule),
    )
    weight = block.lin.weight
    out["placements"] = (repr(tuple(weight.placements)), repr(tuple(model.head.weight.placements)))
    out["local_is_whole"] = tuple(weight.to_local().shape) == tuple(weight.shape)
    ptr = weight.to_local().data_ptr()
    seen: list[tuple[bool, bool]] = []
    block.lin.register_forward_pre_hook(
        lambda m, a: seen.append((not isinstance(m.weight, DTensor), m.weight.data_ptr() == ptr))
    )
    # an optimizer built after a forward (evaluation) and reshard() holds the sharded
    # parameters (before reshard() the groups kept unsharded register their unsharded ones,
    # as torch's: tests/core/front/test_registration.py)
    x, y = make_batch(NAME, 0)
    with torch.no_grad():
        model(rank_slice(x, r, w))
    for m in model.modules():
        if isinstance(m, fsdp2.FSDPModule):
            m.reshard()
    opt = make_optimizer("adamw", model.parameters())
    out["opt_dtensors"] = all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
    ref = build(NAME)
    ref_opt = make_optimizer("adamw", ref.parameters())
    with CommCounter() as counter:
        for step in range(4):
            if step == 2:  # freeze a replicated block mid-run
                block.requires_grad_(False)
                ref.layers[1].requires_grad_(False)
            x, y = make_batch(NAME, step)
            counter.phase = "forward"
            loss = _loss(model, rank_slice(x, r, w), rank_slice(y, r, w))
            counter.phase = "backward"
            loss.backward()
            counter.phase = "?"
            _loss(ref, x, y).backward()
            norm = fsdp2.clip_grad_norm_(model.parameters(), 0.5)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            check_close(norm, ref_norm, f"step {step} grad norm")
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            if step == 1:  # evaluation mid-run
                with torch.no_grad():
                    model(rank_slice(x, r, w))
            if step == 0:
                calls = counter.take_calls()
                out["step0_calls"] = sorted(
                    (c.kind, c.phase, c.group_size) for c in calls if c.phase != "?"
                )
    ref_params = dict(ref.named_parameters())
    for n, p in full_params(model).items():
        check_close(p, ref_params[n].detach(), f"after freezing: {n}")
    out["seen"] = seen[0]

    # an optimizer step between a forward and its backward fails in backward, as on the plain
    # module (the unsharded parameters are the sharded storage)
    plain = build(NAME)
    plain_opt = make_optimizer("sgd", plain.parameters())
    rep = _apply("fsdp2", build(NAME), "replicate")
    rep_opt = make_optimizer("sgd", rep.parameters())
    # the same through Replicate() parameters of blocks resharded after forward (their group
    # is registered sharded again by the time of the step, its views still saved)
    placed = build(NAME)
    mesh = init_device_mesh("cpu", (w,))
    for block in placed.layers:
        fsdp2.fully_shard(block, mesh=mesh, shard_placement_fn=lambda p: Replicate())
    fsdp2.fully_shard(placed, mesh=mesh)
    placed_opt = make_optimizer("sgd", placed.parameters())
    errors = []
    for m, o in ((plain, plain_opt), (rep, rep_opt), (placed, placed_opt)):
        _loss(m, x, y).backward()  # gradients for the step
        loss = _loss(m, x, y)
        o.step()
        try:
            loss.backward()
            errors.append(None)
        except RuntimeError as e:
            errors.append("modified by an inplace operation" in str(e))
    out["inplace_errors"] = errors

    # set_bucket_bytes: the replicated groups' all-reduces in one bucket, same gradients
    bucketed = _apply("fsdp2", build(NAME), "replicate")
    bucketed.set_bucket_bytes(1 << 20)
    plain_rep = _apply("fsdp2", build(NAME), "replicate")
    with CommCounter() as counter:
        _loss(bucketed, rank_slice(x, r, w), rank_slice(y, r, w)).backward()
    out["bucketed_all_reduces"] = len([c for c in counter.calls if c.kind == "AR"])
    _loss(plain_rep, rank_slice(x, r, w), rank_slice(y, r, w)).backward()
    g_b, g_p = full_grads(bucketed), full_grads(plain_rep)
    out["bucketed_equal"] = all(torch.equal(g_b[n], g) for n, g in g_p.items())

    # a cast after a step (relayout): the views follow the new buffer, training goes on
    cast, ref64 = _apply("fsdp2", build(NAME), "replicate"), build(NAME)
    for step in range(3):
        if step == 1:
            cast.to(torch.float64)
            ref64.to(torch.float64)
        opts = [make_optimizer("sgd", m.parameters()) for m in (cast, ref64)]
        x, y = (t.to(next(ref64.parameters()).dtype) for t in make_batch(NAME, step))
        _loss(cast, rank_slice(x, r, w), rank_slice(y, r, w)).backward()
        _loss(ref64, x, y).backward()
        for o in opts:
            o.step()
    ref64_params = dict(ref64.named_parameters())
    for n, p in full_params(cast).items():
        check_close(p, ref64_params[n].detach(), f"after .to(float64): {n}")
    x, y = make_batch(NAME, 0)

    # the all-reduce hook runs on the replicated gradients (after the all-reduce)
    hooked = _apply("fsdp2", build(NAME), "replicate")
    for m in hooked.modules():
        if isinstance(m, ReplicateModule):
            m.set_all_reduce_hook(lambda t: t.mul_(2))
    base = _apply("fsdp2", build(NAME), "replicate")
    for m in (hooked, base):
        _loss(m, rank_slice(x, r, w), rank_slice(y, r, w)).backward()
    g_hooked, g_base = full_grads(hooked), full_grads(base)
    out["hook_doubles"] = all(torch.equal(g_hooked[n], 2 * g) for n, g in g_base.items())
    return out


def test_replicate_layout_traffic_and_call_orders() -> None:
    out = run_on_ranks(2, _behaviours)[0]
    assert out["classes"] == ["ReplicateMLPStack", "ReplicateMLPBlock", "FSDPMLPBlock"], out
    assert out["isinstance"] == (True, True, False), out
    assert out["placements"] == ("(Replicate(),)", "(Replicate(),)"), out
    assert out["local_is_whole"] and out["opt_dtensors"], out
    assert out["seen"] == (True, True), out  # forward reads the sharded storage, unwrapped
    # one sharded block: its all-gathers (forward, backward) and reduce-scatter; each
    # replicated group (2 blocks and the root): one all-reduce in backward, nothing else
    want = sorted(
        [("AG", "forward", 2), ("AG", "backward", 2), ("RS", "backward", 2)]
        + [("AR", "backward", 2)] * 3
    )
    assert out["step0_calls"] == want, out["step0_calls"]
    assert out["inplace_errors"] == [True, True, True], out
    assert out["hook_doubles"], out
    assert out["bucketed_all_reduces"] == 1 and out["bucketed_equal"], out


# ---------------------------------------------------------------------------------------------
# Replicate() per parameter


def _per_parameter() -> dict[str, Any]:
    out: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def small(p: nn.Parameter) -> Any:
        return Replicate() if p.ndim == 1 else None

    def small_result(p: nn.Parameter) -> Any:
        return fsdp2.ShardPlacementResult(Replicate(), mesh) if p.ndim == 1 else Shard(0)

    for fn in (small, small_result):
        models = {}
        for kind in ("all", "blocks"):
            model = build("transformer")
            for block in model.layers:
                fsdp2.fully_shard(block, mesh=mesh, shard_placement_fn=fn)
            fsdp2.fully_shard(model, mesh=mesh, shard_placement_fn=fn if kind == "all" else None)
            models[kind] = model
        layout = {
            n: repr(tuple(p.placements)) for n, p in models["all"].named_parameters() if p.ndim == 1
        }
        out[f"{fn.__name__}_placements"] = sorted(set(layout.values()))
        with CommCounter() as counter:
            x, y = make_batch("transformer", 0)
            models["all"](x[:1])
        models["all"].reshard()  # the root keeps its parameters registered unsharded
        sizes = [c.numel for c in counter.calls if c.kind == "AG"]
        block0 = models["all"].layers[0]
        matrices = sum(p.to_local().numel() for p in block0.parameters() if p.ndim > 1)
        out[f"{fn.__name__}_block_gather"] = matrices in sizes
        for model in models.values():
            train_and_compare(
                build("transformer"),
                {"fsdp2": model},
                batch=lambda s: make_batch("transformer", s),
                loss=lambda m, x, y: local_loss(m, "transformer", x, y),
                steps=2,
            )
    return out


def test_replicate_per_parameter() -> None:
    out = run_on_ranks(2, _per_parameter)[0]
    for fn in ("small", "small_result"):
        assert out[f"{fn}_placements"] == ["(Replicate(),)"], out
        assert out[f"{fn}_block_gather"], out


# ---------------------------------------------------------------------------------------------
# Checkpoints, planning, the switch


def _checkpoints(path: str) -> dict[str, Any]:
    from fsdp2.checkpoint import iter_full_tensors, load_full_checkpoint, save_full_checkpoint

    out: dict[str, Any] = {}
    r, w = dist.get_rank(), dist.get_world_size()
    x, y = make_batch(NAME, 0)

    def trained(layout: str | None, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = build(NAME, seed)
        if layout is None:
            mesh = init_device_mesh("cpu", (w,))
            for b in model.layers:
                fsdp2.fully_shard(b, mesh=mesh)
            fsdp2.fully_shard(model, mesh=mesh)
        else:
            _apply("fsdp2", model, layout)
        opt = make_optimizer("adamw", model.parameters())
        _loss(model, rank_slice(x, r, w), rank_slice(y, r, w)).backward()
        opt.step()
        opt.zero_grad()
        return model, opt

    rep, rep_opt = trained("replicate", 0)
    plain = build(NAME)
    out["keys"] = list(rep.state_dict()) == list(plain.state_dict())
    out["sd_placements"] = sorted({repr(v.placements) for v in rep.state_dict().values()})
    for src_layout, dst_layout in (("replicate", None), (None, "replicate")):
        src, src_opt = trained(src_layout, 0)
        dst, dst_opt = trained(dst_layout, 1)
        msd, osd = get_state_dict(src, src_opt)
        where = os.path.join(path, f"dcp_{src_layout}")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)
        msd2, osd2 = get_state_dict(dst, dst_opt)
        state = {"model": msd2, "optim": osd2}
        dcp.load(state, checkpoint_id=where)
        set_state_dict(
            dst, dst_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        for n, p in full_params(dst).items():
            assert torch.equal(p, full_params(src)[n]), f"{src_layout}->{dst_layout} {n}"
        losses = []
        for m, o in ((src, src_opt), (dst, dst_opt)):
            loss = _loss(m, rank_slice(x, r, w), rank_slice(y, r, w))
            loss.backward()
            o.step()
            losses.append(loss.item())
        for n, p in full_params(dst).items():
            check_close(p, full_params(src)[n], f"step after load {src_layout}->{dst_layout} {n}")
        out[f"losses_{src_layout}"] = losses
    full_dir = os.path.join(path, "full")
    save_full_checkpoint(rep, full_dir)
    sharded, _ = trained(None, 1)
    load_full_checkpoint(sharded, full_dir)
    for n, p in full_params(sharded).items():
        assert torch.equal(p, full_params(rep)[n]), f"full checkpoint {n}"
    streamed = dict(iter_full_tensors(rep))
    out["iter_equal"] = all(
        torch.equal(streamed[n], v.full_tensor()) for n, v in rep.state_dict().items()
    )

    # the timeline names the replicated groups' all-reduces
    with fsdp2.timeline() as tl:
        _loss(rep, rank_slice(x, r, w), rank_slice(y, r, w)).backward()
    out["timeline"] = (dict(tl.collectives), sorted(tl.lanes))
    return out


def test_replicate_checkpoints_cross_layouts(tmp_path: Any) -> None:
    with tempfile.TemporaryDirectory(dir=tmp_path) as path:
        out = run_on_ranks(2, _checkpoints, path)[0]
    assert out["keys"] and out["iter_equal"], out
    assert out["sd_placements"] == ["(Replicate(),)"], out
    # the timeline: one all-reduce per replicated group, no reduce-scatter (none runs)
    counts, lanes = out["timeline"]
    assert counts == {"all_reduce": 4}, counts
    assert lanes == ["layers.0", "layers.1", "layers.2", "the root (MLPStack)"], lanes
    for key in ("losses_replicate", "losses_None"):
        a, b = out[key]
        assert abs(a - b) < 1e-5, out


def test_replicate_estimate_memory() -> None:
    """A replicated model's estimate holds every parameter whole, a sharded one half; the
    replicated step has no unsharded copies."""

    def build_rep(mesh: Any) -> nn.Module:
        model = build(NAME)
        for b in model.layers:
            fsdp2.replicate(b, mesh=mesh)
        return fsdp2.replicate(model, mesh=mesh)

    x, y = make_batch(NAME, 0)
    step = lambda m, batch: local_loss(m, NAME, *batch)  # noqa: E731
    rep = fsdp2.estimate_memory(build_rep, (x, y), mesh_shape=2, step_fn=step, compare=False)
    plain = sum(p.numel() * 4 for p in build(NAME).parameters())
    assert rep.parts["parameters (sharded)"] >= plain, rep
    assert rep.parts["parameters (unsharded)"] == 0, rep  # forward reads them in place


# ---------------------------------------------------------------------------------------------
# Errors


def _errors() -> dict[str, str]:
    out = {}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mesh2 = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("a", "b"))
    cases = {
        "2d": lambda: fsdp2.replicate(build(NAME), mesh=mesh2),
        "shard_dims": lambda: fsdp2.replicate(
            build(NAME), mesh=mesh2, dp_mesh_dims=fsdp2.DataParallelMeshDims(shard="b")
        ),
        "container": lambda: fsdp2.replicate(build(NAME).layers, mesh=mesh),
    }
    sharded = build(NAME)
    fsdp2.fully_shard(sharded, mesh=mesh)
    cases["after_fully_shard"] = lambda: fsdp2.replicate(sharded, mesh=mesh)
    replicated = build(NAME)
    fsdp2.replicate(replicated, mesh=mesh)
    cases["after_replicate"] = lambda: fsdp2.fully_shard(replicated, mesh=mesh)
    for key, fn in cases.items():
        try:
            fn()
            out[key] = "no error"
        except (ValueError, TypeError) as e:
            out[key] = str(e)
    return out


def test_replicate_errors() -> None:
    out = run_on_ranks(2, _errors)[0]
    assert "replicate expects a 1D DeviceMesh" in out["2d"], out
    assert "replicate-only dims" in out["shard_dims"], out
    assert "replicate cannot replicate ModuleList" in out["container"], out
    assert "already sharded by fully_shard" in out["after_fully_shard"], out
    assert "already replicated by replicate" in out["after_replicate"], out


@pytest.mark.parametrize("engine", ["fsdp2"])
def test_switch_names_replicate(engine: str) -> None:
    """``use_fsdp2`` points torch's ``replicate`` / ``ReplicateModule`` at fsdp2's, and only
    those names in torch's replicate module."""
    import torch.distributed._composable.replicate_with_fsdp as torch_rep

    from fsdp2.integrations import restore_torch_fsdp, use_fsdp2

    before = torch_rep.replicate, torch_rep.ReplicateModule, torch_rep.FSDPModule
    try:
        use_fsdp2()
        assert torch_rep.replicate is not before[0]
        assert torch_rep.replicate.__wrapped__ is fsdp2.replicate
        assert torch_rep.FSDPModule is before[2]  # torch's engine keeps its own globals
        assert issubclass(fsdp2.ReplicateModule, torch_rep.ReplicateModule)
        assert issubclass(before[1], torch_rep.ReplicateModule)
    finally:
        restore_torch_fsdp()
    assert (torch_rep.replicate, torch_rep.ReplicateModule) == before[:2]
