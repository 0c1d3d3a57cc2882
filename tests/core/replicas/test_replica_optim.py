"""``fsdp2.replica_optim``: HSDP's gradients and optimizer state sharded over the replicas.

* training on ``(2, 2)`` and ``(4, 1)`` meshes equals plain HSDP and torch's FSDP2 HSDP
  (the same sums and the same elementwise update: bitwise for two replicas; for four,
  gloo's ring adds in an order that depends on an element's place in the buffer, so to a
  rounding) and the unsharded
  replica (gradients averaged by hand), for AdamW, Adam, SGD with momentum and Adagrad,
  losses every step and full parameters at the end;
* each rank holds ``1/R`` of plain HSDP's gradient and optimizer state, and the elements
  across replicas per step equal plain HSDP's all-reduce (a reduce-scatter and an
  all-gather of as many);
* bf16 mixed precision, gradient accumulation (no-sync and repeated backwards), clipping
  (``optim.clip_grad_norm_`` and ``fsdp2.clip_grad_norm_`` equal plain HSDP's norm),
  freezing mid-run, an LR scheduler, ``replicate`` (ZeRO-2 over every rank), a 1D-mesh
  module and a plain parameter alongside, ``model.zero_grad()``;
* checkpoints move between the two layouts: ``state_dict``/``load_state_dict`` and DCP
  through ``get_state_dict``/``set_state_dict``, saved at ``(2, 2)`` and loaded at
  ``(4, 1)`` and back; FSDP1's FULL optimizer state dict is the plain optimizer's;
  ``state_dict()`` equals that of a plain AdamW over torch's FSDP2 HSDP before the first
  step, between a backward and its step and after a step, and loads torch's mid-step;
* parameter groups of their own hyperparameters, one added after a step, and a closure;
* bad input raises before any collective: matrix-wise and non-elementwise optimizers, an
  HSDP module with parameters outside the optimizer, deterministic reduction, a plain
  optimizer stepping a parameter whose gradient is held in pieces.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _harness import run_on_ranks
from helpers import hsdp_mesh, world_mesh
from models import build, full_params, local_loss, make_batch, rank_slice, shard_model
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import Shard

import fsdp2
from fsdp2 import fully_shard, replicate
from fsdp2._core.support.observe import HUB, Collective, Observer
from fsdp2.api import CPUOffloadPolicy, MixedPrecisionPolicy
from fsdp2.planning.timeline import timeline
from fsdp2.reduction import set_deterministic
from fsdp2.replica_optim import ReplicaShardedOptimizer, shard_over_replicas

MODEL = "transformer"
STEPS = 3


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-4)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2, eps=1e-4, amsgrad=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=0.1)
    raise ValueError(kind)


def _model(engine: str, shape: tuple[int, int], seed: int = 0, **kw: Any) -> torch.nn.Module:
    model = build(MODEL, seed)
    if engine == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        return shard_model(model, torch_fully_shard, hsdp_mesh(shape), **kw)
    if engine == "replicate":
        replicate(model, mesh=world_mesh())
        return model
    return shard_model(model, fully_shard, hsdp_mesh(shape), **kw)


def _step(model: torch.nn.Module, optim: Any, step: int, micro: int = 1) -> float:
    """One step on this rank's slice of the global batch, in ``micro`` backwards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = make_batch(MODEL, step)
    xs, ys = rank_slice(x, rank, world), rank_slice(y, rank, world)
    total = 0.0
    for m in range(micro):
        if isinstance(model, fsdp2.FSDPModule):
            model.set_requires_gradient_sync(m == micro - 1)
        xm, ym = rank_slice(xs, m, micro), rank_slice(ys, m, micro)
        loss = local_loss(model, MODEL, xm, ym) / micro
        loss.backward()
        total += loss.item()
    optim.step()
    optim.zero_grad()
    return total


def _run(
    engine: str,
    shape: tuple[int, int],
    kind: str,
    pieces: bool,
    steps: int = STEPS,
    **kw: Any,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model(engine, shape, **kw)
    optim = _optimizer(kind, model.parameters())
    if pieces:
        optim = shard_over_replicas(optim)
    losses = [_step(model, optim, s) for s in range(steps)]
    return losses, full_params(model)


def _reference(kind: str, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsharded model on the global batch (its mean loss: the ranks' average)."""
    model = build(MODEL)
    optim = _optimizer(kind, model.parameters())
    losses = []
    for s in range(steps):
        x, y = make_batch(MODEL, s)
        loss = local_loss(model, MODEL, x, y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _mean(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _same(a: Any, b: Any, what: str, bitwise: bool = True) -> None:
    if not bitwise:
        # Adagrad's first step moves an element by about lr * g / |g|: where g is near 0,
        # a rounding of the sum's order moves it by up to a few 1e-6 (seen on some CPUs)
        torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6, msg=what)
        for k, v in b[1].items():
            torch.testing.assert_close(a[1][k], v, rtol=1e-5, atol=1e-5, msg=f"{what}: {k}")
        return
    assert a[0] == b[0], f"{what}: losses {a[0]} vs {b[0]}"
    for k, v in b[1].items():
        assert torch.equal(a[1][k], v), f"{what}: {k}"


def _parity(shape: tuple[int, int]) -> None:
    # Two replicas: each sum is of two terms, in either order the same bits. More: gloo's
    # ring all-reduce (HSDP's, and the reduce-scatter's on gloo) adds in an order that
    # depends on the element's position in the buffer, which the pieces' packing changes.
    bitwise = shape[0] == 2
    for kind in ("adamw", "adam", "sgd", "adagrad"):
        ours = _run("fsdp2", shape, kind, pieces=True)
        plain = _run("fsdp2", shape, kind, pieces=False)
        _same(ours, plain, f"{kind} {shape} vs plain HSDP", bitwise)
        if kind == "adamw":
            theirs = _run("torch", shape, kind, pieces=False)
            _same(ours, theirs, f"{shape} vs torch's HSDP", bitwise)
        ref = _reference(kind)
        for mine, theirs in zip(ours[0], ref[0], strict=True):
            assert abs(_mean(mine) - theirs) < 1e-5, (kind, mine, theirs)
        for k, v in ref[1].items():
            torch.testing.assert_close(ours[1][k], v, rtol=1e-4, atol=1e-5, msg=f"{kind} {k}")


def test_equals_plain_hsdp_and_replica_2x2() -> None:
    run_on_ranks(4, _parity, (2, 2))


def test_equals_plain_hsdp_and_replica_4x1() -> None:
    run_on_ranks(4, _parity, (4, 1))


# ---- memory and traffic ----------------------------------------------------------------


class _Across(Observer):
    """The collectives over groups of ``size`` ranks other than the shard group's."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.seen: list[tuple[str, int, str]] = []

    def collective(self, c: Collective) -> None:
        if c.group_size == self.size and (c.what.startswith("replicas") or c.kind == "all-reduce"):
            self.seen.append((c.kind, c.numel, c.what))


def _held(optim: Any, model: torch.nn.Module) -> tuple[int, int]:
    """Elements of gradients and of optimizer state this rank holds."""
    state = sum(
        v.numel() if not hasattr(v, "_local_tensor") else v._local_tensor.numel()
        for st in optim.state.values()
        for k, v in st.items()
        if torch.is_tensor(v) and k != "step"
    )
    if isinstance(optim, ReplicaShardedOptimizer):
        grads = sum(g.numel() for g in optim.piece_grads())
    else:
        grads = sum(p.grad._local_tensor.numel() for p in model.parameters() if p.grad is not None)
    return grads, state


def _memory_and_traffic() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pieces in (False, True):
        model = _model("fsdp2", (2, 2))
        optim = _optimizer("adamw", model.parameters())
        if pieces:
            optim = shard_over_replicas(optim)
        _step(model, optim, 0)
        x, y = make_batch(MODEL, 1)
        r, w = dist.get_rank(), dist.get_world_size()
        local_loss(model, MODEL, rank_slice(x, r, w), rank_slice(y, r, w)).backward()
        seen = _Across(2)
        with HUB.observing(seen):
            held = _held(optim, model)
            optim.step()
        held_state = _held(optim, model)[1]
        out[f"pieces={pieces}"] = (held[0], held_state, seen.seen)
    return out


def test_memory_divided_and_traffic_equal() -> None:
    results = run_on_ranks(4, _memory_and_traffic)
    for res in results:
        plain_g, plain_s, _ = res["pieces=False"]
        ours_g, ours_s, across = res["pieces=True"]
        nparams = 30  # slack: each parameter's piece is rounded up
        assert plain_g / 2 - nparams <= ours_g <= plain_g / 2 + nparams, (ours_g, plain_g)
        assert plain_s / 2 - 2 * nparams <= ours_s <= plain_s / 2 + 2 * nparams, (ours_s, plain_s)
    model_numel = sum(p.numel() for p in build(MODEL).parameters())
    # the step's all-gather over the replicas: the whole of this rank's shard, once
    for res in results:
        gathers = [n for kind, n, _ in res["pieces=True"][2] if kind == "all-gather"]
        assert gathers and abs(sum(gathers) - model_numel / 2) <= 60, (gathers, model_numel)


def _traffic_in_backward() -> tuple[int, int]:
    totals = []
    for pieces in (False, True):
        model = _model("fsdp2", (2, 2))
        optim = _optimizer("adamw", model.parameters())
        if pieces:
            optim = shard_over_replicas(optim)
        seen = _Across(2)
        with HUB.observing(seen):
            _step(model, optim, 0)
        totals.append(seen.seen)
    plain, ours = totals
    reduced = sum(n for kind, n, _ in plain if kind == "all-reduce")
    scattered = sum(n for kind, n, _ in ours if kind == "reduce-scatter")
    gathered = sum(n for kind, n, _ in ours if kind == "all-gather")
    assert not [c for c in ours if c[0] == "all-reduce"], ours
    return reduced, scattered, gathered


def test_bytes_across_replicas_equal_the_all_reduce() -> None:
    for reduced, scattered, gathered in run_on_ranks(4, _traffic_in_backward):
        # an all-reduce of N moves what a reduce-scatter of N and an all-gather of N move
        assert abs(scattered - reduced) <= 60 and abs(gathered - reduced) <= 60, (
            reduced,
            scattered,
            gathered,
        )


# ---- composition and call orders ---------------------------------------------------------


def _compose() -> None:
    mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
    for kw in ({}, mp):
        runs = []
        for pieces in (False, True):
            model = _model("fsdp2", (2, 2), **kw)
            optim = _optimizer("adamw", model.parameters())
            if pieces:
                optim = shard_over_replicas(optim)
            sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
            losses, norms = [], []
            for s in range(4):
                rank, world = dist.get_rank(), dist.get_world_size()
                x, y = make_batch(MODEL, s)
                xs, ys = rank_slice(x, rank, world), rank_slice(y, rank, world)
                micro = 2 if s % 2 else 1
                for m in range(micro):  # no-sync, no all-reduce, then a repeated backward
                    last = m == micro - 1
                    model.set_requires_gradient_sync(last or s != 1)
                    model.set_requires_all_reduce(last or s != 3)
                    loss = local_loss(
                        model, MODEL, rank_slice(xs, m, micro), rank_slice(ys, m, micro)
                    )
                    loss.backward()
                    losses.append(loss.item())
                if s == 2:  # freeze a block mid-run: its parameters get no gradient
                    for p in model.layers[0].parameters():
                        p.requires_grad_(False)
                clip = optim.clip_grad_norm_ if pieces and s % 2 else fsdp2.clip_grad_norm_
                norms.append(
                    clip(0.5)
                    if clip is not fsdp2.clip_grad_norm_
                    else clip(model.parameters(), 0.5)
                )
                optim.step()
                sched.step()
                (model if s % 2 else optim).zero_grad()
            runs.append((losses, norms, full_params(model)))
        (l0, n0, p0), (l1, n1, p1) = runs
        # the clipped steps differ by the norm's rounding: its sums go in another order
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6, msg=str(kw))
        for a, b in zip(n0, n1, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)  # the norm's sums' order
        for k, v in p0.items():
            torch.testing.assert_close(p1[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_mixed_precision_accumulation_clipping_freezing_scheduler() -> None:
    run_on_ranks(4, _compose)


def _mixed_meshes() -> None:
    """replicate() (ZeRO-2 over all ranks), and a 1D-mesh block beside HSDP blocks."""
    for layout in ("replicate", "mixed"):
        runs = []
        for pieces in (False, True):
            model = build(MODEL)
            if layout == "replicate":
                replicate(model, mesh=world_mesh())
            else:
                fully_shard(model.layers[0], mesh=world_mesh())
                for block in model.layers[1:]:
                    fully_shard(block, mesh=hsdp_mesh((2, 2)))
                fully_shard(model, mesh=hsdp_mesh((2, 2)))
            optim = _optimizer("sgd", model.parameters())
            if pieces:
                optim = shard_over_replicas(optim)
            runs.append(([_step(model, optim, s) for s in range(STEPS)], full_params(model)))
        _same(runs[1], runs[0], layout, bitwise=layout == "mixed")  # replicate: 4 replicas


def test_replicate_and_a_1d_mesh_alongside() -> None:
    run_on_ranks(4, _mixed_meshes)


def _offload_and_own_meshes() -> None:
    """CPU offload of the shards (the step on the host), and per-parameter meshes: the MLP
    weights on the HSDP mesh, the rest on a 1D mesh of the same fully_shard calls."""
    flat, hsdp = world_mesh(), hsdp_mesh((2, 2))

    for layout in ("offload", "own meshes"):
        runs = []
        for pieces in (False, True):
            model = build(MODEL)
            if layout == "offload":
                shard_model(
                    model, fully_shard, hsdp, offload_policy=CPUOffloadPolicy(pin_memory=False)
                )
            else:
                mlp = {id(b.fc1.weight) for b in model.layers} | {
                    id(b.fc2.weight) for b in model.layers
                }

                def own(p: torch.nn.Parameter, mlp: set[int] = mlp) -> Any:
                    return fsdp2.ShardPlacementResult(Shard(0), hsdp) if id(p) in mlp else None

                shard_model(model, fully_shard, flat, shard_placement_fn=own)
            optim = _optimizer("adamw", model.parameters())
            if pieces:
                optim = shard_over_replicas(optim)
            runs.append(([_step(model, optim, s) for s in range(STEPS)], full_params(model)))
        _same(runs[1], runs[0], layout)


def test_offload_and_per_parameter_meshes() -> None:
    run_on_ranks(4, _offload_and_own_meshes)


def _timeline() -> dict[str, int]:
    model = _model("fsdp2", (2, 2))
    optim = shard_over_replicas(_optimizer("adamw", model.parameters()))
    _step(model, optim, 0)
    with timeline(None, png=False) as tl:
        _step(model, optim, 1)
    for path, lane in tl.lanes.items():
        ops = [op for op, *_ in lane]
        assert "replica_reduce_scatter" in ops and "replica_all_gather" in ops, (path, ops)
        assert "all_reduce" not in ops, (path, ops)
    return tl.collectives


def test_timeline_shows_the_replica_collectives() -> None:
    counts = run_on_ranks(4, _timeline)[0]
    assert counts["replica_reduce_scatter"] == counts["replica_all_gather"] == 3, counts


# ---- checkpoints -----------------------------------------------------------------------------


def _save(root: str, shape: tuple[int, int], pieces: bool) -> Any:
    model = _model("fsdp2", shape)
    optim = _optimizer("adamw", model.parameters())
    if pieces:
        optim = shard_over_replicas(optim)
    for s in range(2):
        _step(model, optim, s)
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)
    return [_step(model, optim, s) for s in range(2, 4)], full_params(model)


def _load(root: str, shape: tuple[int, int], pieces: bool) -> Any:
    model = _model("fsdp2", shape, seed=1)
    optim = _optimizer("adamw", model.parameters())
    if pieces:
        optim = shard_over_replicas(optim)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=root)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return [_step(model, optim, s) for s in range(2, 4)], full_params(model)


def _checkpoints(root: str) -> None:
    cases = [
        ((2, 2), True, (4, 1), False),
        ((4, 1), False, (2, 2), True),
        ((2, 2), True, (2, 2), True),
    ]
    for i, (save_shape, save_pieces, load_shape, load_pieces) in enumerate(cases):
        where = os.path.join(root, str(i))
        want = _save(where, save_shape, save_pieces)
        got = _load(where, load_shape, load_pieces)
        what = f"saved {save_shape} pieces={save_pieces}, loaded {load_shape} pieces={load_pieces}"
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6, msg=what)
        for k, v in want[1].items():
            torch.testing.assert_close(got[1][k], v, rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")
    # state_dict() is the usual layout: loaded into a plain optimizer, it steps the same
    model = _model("fsdp2", (2, 2))
    optim = shard_over_replicas(_optimizer("adamw", model.parameters()))
    _step(model, optim, 0)
    sd = optim.state_dict()
    plain = _optimizer("adamw", model.parameters())
    plain.load_state_dict(sd)
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert plain.state[p][key].placements == p.placements, key
            assert plain.state[p][key].shape == p.shape
    back = shard_over_replicas(_optimizer("adamw", model.parameters()))
    back.load_state_dict(sd)
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(back.state[p][key], optim.state[p][key]), key
    # FSDP1's FULL optimizer state dict: the plain optimizer's, value for value
    from fsdp2.fsdp1 import StateDictType, optim_state_dict

    full = StateDictType.FULL_STATE_DICT
    ours = optim_state_dict(model, optim, state_dict_type=full)
    theirs = optim_state_dict(model, plain, state_dict_type=full)
    assert ours["state"].keys() == theirs["state"].keys()
    for fqn, st in theirs["state"].items():
        for key, v in st.items():
            assert torch.equal(ours["state"][fqn][key], v), (fqn, key)


def _same_state_dict(ours: dict[str, Any], theirs: dict[str, Any], what: str) -> None:
    assert ours["param_groups"] == theirs["param_groups"], what
    assert ours["state"].keys() == theirs["state"].keys(), what
    for i, st in theirs["state"].items():
        assert st.keys() == ours["state"][i].keys(), (what, i)
        for key, v in st.items():
            mine = ours["state"][i][key]
            if isinstance(v, torch.distributed.tensor.DTensor):
                assert mine.placements == v.placements, (what, i, key)
                mine, v = mine.full_tensor(), v.full_tensor()
            assert torch.equal(mine, v), (what, i, key)


def _state_dicts_beside_torch() -> None:
    """``state_dict()`` / ``load_state_dict()`` against torch's FSDP2 HSDP with a plain AdamW,
    at each point of a step: before the first, between a backward and its step, after a
    step; a state dict of torch's loaded between a backward and its step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    theirs_model = _model("torch", (2, 2))
    ours_model = _model("fsdp2", (2, 2))
    theirs = _optimizer("adamw", theirs_model.parameters())
    ours = shard_over_replicas(_optimizer("adamw", ours_model.parameters()))
    _same_state_dict(ours.state_dict(), theirs.state_dict(), "before the first step")
    for s in range(3):
        x, y = make_batch(MODEL, s)
        xs, ys = rank_slice(x, rank, world), rank_slice(y, rank, world)
        losses = [local_loss(m, MODEL, xs, ys) for m in (ours_model, theirs_model)]
        for loss in losses:
            loss.backward()
        assert losses[0].item() == losses[1].item(), s
        _same_state_dict(ours.state_dict(), theirs.state_dict(), f"step {s}, after backward")
        if s == 1:  # torch's state loaded between a backward and its step
            ours.load_state_dict(theirs.state_dict())
        for opt in (ours, theirs):
            opt.step()
            opt.zero_grad()
        _same_state_dict(ours.state_dict(), theirs.state_dict(), f"after step {s}")
    mine, want = full_params(ours_model), full_params(theirs_model)
    for k, v in want.items():
        assert torch.equal(mine[k], v), k


def test_state_dicts_beside_torchs_fsdp2() -> None:
    run_on_ranks(4, _state_dicts_beside_torch)


def test_checkpoints_move_between_layouts() -> None:
    with tempfile.TemporaryDirectory() as root:
        run_on_ranks(4, _checkpoints, root)


# ---- errors ----------------------------------------------------------------------------------


def _errors() -> None:
    model = _model("fsdp2", (2, 2))
    with pytest.raises(TypeError, match="updates whole matrices"):
        shard_over_replicas(
            fsdp2.optim.Muon([p for p in model.parameters() if p.dim() == 2], lr=0.1)
        )
    with pytest.raises(TypeError, match="not one of the elementwise"):
        shard_over_replicas(torch.optim.LBFGS(model.parameters()))
    params = list(model.parameters())
    with pytest.raises(ValueError, match="is not in the optimizer"):
        shard_over_replicas(torch.optim.SGD(params[:-1], lr=0.1))
    torch.optim.SGD(params, lr=0.1).step()  # the failed wrap changed nothing
    det = _model("fsdp2", (2, 2))
    set_deterministic(det)
    with pytest.raises(ValueError, match="reduces deterministically"):
        shard_over_replicas(torch.optim.SGD(det.parameters(), lr=0.1))
    ours = shard_over_replicas(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="shards its gradients over the replicas"):
        set_deterministic(model)  # the other order
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="sharded over the replicas"):
        plain.step()
    from fsdp2.integrations.torchft import wire

    with pytest.raises(ValueError, match="ReplicaShardedOptimizer"):
        wire(None, model, ours)
    _step(model, ours, 0)  # still trains


def _call_orders() -> None:
    runs = []
    for pieces in (False, True):
        model = _model("fsdp2", (2, 2))

        def make(model: torch.nn.Module = model) -> torch.optim.Optimizer:
            return _optimizer("adamw", model.parameters())

        optim = shard_over_replicas(make()) if pieces else make()
        model.to(torch.float64)  # a cast after building the optimizer: the pieces follow
        losses = [_step(model, optim, 0)]
        x, _ = make_batch(MODEL, 9)
        with torch.no_grad():  # evaluation mid-run
            model.eval()
            model(x)
            model.train()
        losses.append(_step(model, optim, 1))
        # the optimizer rebuilt between a backward and its step (its state starts afresh)
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = make_batch(MODEL, 2)
        loss = local_loss(model, MODEL, rank_slice(x, rank, world), rank_slice(y, rank, world))
        loss.backward()
        optim = shard_over_replicas(make()) if pieces else make()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
        if pieces:  # an optimizer built between a forward and its backward is refused
            x, y = make_batch(MODEL, 3)
            loss = local_loss(model, MODEL, x.to(torch.float64) if x.is_floating_point() else x, y)
            with pytest.raises(ValueError, match="unsharded parameter"):
                shard_over_replicas(make())
            loss.backward()
            optim.zero_grad()
        runs.append((losses, full_params(model)))
    _same(runs[1], runs[0], "call orders")


def test_call_orders() -> None:
    run_on_ranks(4, _call_orders)


def _param_groups_and_closure() -> None:
    """Parameter groups of their own hyperparameters, one added after a step (its HSDP
    module switched then), and a closure."""
    runs = []
    for pieces in (False, True):
        model = _model("fsdp2", (2, 2))
        first = [p for n, p in model.named_parameters() if not n.startswith("layers.1.")]
        later = [p for n, p in model.named_parameters() if n.startswith("layers.1.")]
        decay = [p for p in first if p.dim() == 2]
        optim = torch.optim.AdamW(
            [{"params": decay}, {"params": [p for p in first if p.dim() < 2], "weight_decay": 0.0}],
            lr=1e-2,
            weight_decay=0.1,
            eps=1e-4,
        )
        if pieces:
            optim = shard_over_replicas(optim)
        losses = [_step(model, optim, 0)]
        optim.add_param_group({"params": later, "lr": 5e-3})
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = make_batch(MODEL, 1)
        xs, ys = rank_slice(x, rank, world), rank_slice(y, rank, world)

        def closure(
            optim: Any = optim,
            model: torch.nn.Module = model,
            xs: torch.Tensor = xs,
            ys: torch.Tensor = ys,
        ) -> torch.Tensor:
            optim.zero_grad()
            loss = local_loss(model, MODEL, xs, ys)
            loss.backward()
            return loss

        losses.append(optim.step(closure).item())
        losses += [_step(model, optim, s) for s in (2, 3)]
        runs.append((losses, full_params(model)))
    _same(runs[1], runs[0], "param groups")


def test_param_groups_added_later_and_a_closure() -> None:
    run_on_ranks(4, _param_groups_and_closure)


def test_errors_before_any_collective() -> None:
    run_on_ranks(4, _errors)
