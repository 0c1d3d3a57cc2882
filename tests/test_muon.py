"""``fsdp2.optim.Muon`` (each sharded matrix orthogonalized whole, on one owner rank), the
``muon_param_groups`` split and the guard against ``torch.optim.Muon`` on shards.

* Parity: an ``MLPStack`` with odd matrix shapes (weights 13x8, 6x13, 5x6, head 3x5: with 2
  and 4 ranks some shards are short or empty) trained 3 steps with Muon for the hidden
  matrices and AdamW for the rest (``muon_param_groups``), against an unsharded replica on
  every rank stepping ``torch.optim.Muon`` + ``torch.optim.AdamW``. The replica runs the
  rank's slice of the batch and averages its gradients by hand (summed over the ranks,
  divided by their number); those must be within ``TOL_FP32`` of the full gradients fsdp2
  reduced (bitwise at 2 ranks; at 4 the sum's order differs, ~3e-8), and then both step on
  the same gradients (fsdp2's, copied into the replica). After every step the Muon
  parameters must be *bitwise* equal to ``torch.optim.Muon``'s (the same full matrices go
  through the same kernels), the AdamW parameters and the losses within ``TOL_FP32``
  (bitwise in practice). Layouts: a 1D mesh (2 and 4 ranks, uneven dim 0), ``Shard(1)`` from
  ``shard_placement_fn`` next to ``Shard(0)``, HSDP 2x2, per-parameter meshes (one matrix on
  a 2x2 HSDP mesh, the rest on the 1D mesh of 4), world size 1, and plain unsharded tensors
  (replicated data parallelism), each with small buckets (several per step) and the
  default one. ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: losses and
  gradients within ``TOL_BF16`` of the fp32 replica, Muon parameters bitwise again given the
  same gradients. Gradient accumulation (two microbatches,
  ``set_requires_gradient_sync(False)`` on the first) with ``fsdp2.clip_grad_norm_`` before
  the step (2 ranks).
* Communication: per bucket exactly two ``all_to_all_single`` calls on the shard group
  (shards to the owners, results back), the next bucket's first one issued before this
  bucket's Newton-Schulz; none for plain tensors; every matrix orthogonalized by exactly one
  rank; owners balanced by cost.
* Checkpoints: DCP save after 2 steps, load into a fresh model and optimizers at 2 ranks
  (2 more steps bitwise equal to the uninterrupted run) and at 4 ranks (loaded state equal
  to the saved one bitwise, the 2 steps close to it).
* Communication (``_communication``, with ``distribute_tensor`` parameters): per bucket
  exactly two ``all_to_all_single`` calls on the bucket's shard group (shards to the owners,
  results back, mirrored split sizes), the next bucket's first one issued before this
  bucket's Newton-Schulz; one bucket per process group with large buckets; every matrix
  orthogonalized once per replica; owners balanced by cost; none for plain tensors. 1D with
  an uneven ``Shard(1)`` (2 ranks), HSDP 2x2 and two meshes at once (4 ranks); the numbers
  bitwise equal to ``torch.optim.Muon`` on the full matrices.
* The guard: ``torch.optim.Muon`` (and a subclass) over fsdp2-sharded parameters raises at
  its first step, naming the parameter, before changing anything; a parameter group added
  later is checked; over plain parameters and fsdp2 parameters at world size 1 it runs (and
  equals ``fsdp2.optim.Muon``); ``fsdp2.optim.Muon`` is not refused. ``test_guard`` puts the
  ``_fsdp2_managed_by`` mark on parameters itself; ``test_guard_end_to_end`` relies on the
  one ``fully_shard`` puts on its sharded parameters.
* Errors: non-2-D parameters and unsupported placements are refused at construction (and
  by ``add_param_group``, which then adds nothing); a full (plain) momentum buffer at step
  time, before any change; a replicated DTensor is orthogonalized locally, no collective.
* ``muon_param_groups`` on ``TinyTransformer`` (tied and untied head) and an ``MLPStack``
  without a head-named module; name overrides.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _harness import run_on_ranks
from helpers import check_same, hsdp_mesh, world_mesh
from models import MLPStack, full_params, full_value, mean_over_ranks, rank_slice, shard_model
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fsdp2
import fsdp2.muon._exchange as muon_exchange
from fsdp2.optim import Muon, muon_param_groups

DIMS = (8, 13, 6, 5)  # hidden weights 13x8 (tall), 6x13 (wide), 5x6; head 3x5
HEAD = 3
BATCH = 8
MUON_KW = {"lr": 0.02, "weight_decay": 0.1}
ADAMW_KW = {"lr": 1e-2, "weight_decay": 0.1}
TOL_FP32 = {"atol": 1e-6, "rtol": 1e-6}  # gradients, losses, AdamW parameters
TOL_BF16 = {"atol": 2e-2, "rtol": 2e-2}
SMALL_BUCKET = 2 * 13 * 8  # one 13x8 matrix in bfloat16: several buckets per step


def _build() -> nn.Module:
    torch.manual_seed(0)
    return MLPStack(DIMS, head_dim=HEAD)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(BATCH, DIMS[0], generator=g), torch.randn(BATCH, HEAD, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return nn.functional.mse_loss(out.float(), y)


class _Optimizers:
    """Muon over the hidden matrices and AdamW over the rest, stepped together."""

    def __init__(self, model: nn.Module, muon_cls: type[torch.optim.Optimizer], **kw: Any) -> None:
        muon_groups, adamw_groups = muon_param_groups(model, muon=MUON_KW, adamw=ADAMW_KW)
        self.muon = muon_cls(muon_groups, **kw)
        self.adamw = torch.optim.AdamW(adamw_groups)
        self.all = [self.muon, self.adamw]

    def step(self) -> None:
        for opt in self.all:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.all:
            opt.zero_grad()


def _hand_average(model: nn.Module, size: int) -> None:
    """Average a replica's gradients over the default group by hand (sum, then divide)."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(size)


def _max_diff(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None]) -> float:
    worst = 0.0
    for k, w in want.items():
        g = got[k]
        if g is not None and w is not None:
            worst = max(worst, (g.double() - w.double()).abs().max().item())
    return worst


def _train(
    model: nn.Module,
    ref: nn.Module,
    opts: _Optimizers,
    ref_opts: _Optimizers,
    what: str,
    *,
    steps: int = 3,
    first: int = 0,
    tol: dict[str, float] = TOL_FP32,
    accumulate: bool = False,
    clip: float | None = None,
) -> dict[str, float]:
    """Train ``model`` (sharded) and ``ref`` (its unsharded replica) side by side on each
    rank's slice of the batch and compare every step.

    The replica's gradients are averaged by hand and must be within ``tol`` of the full
    gradients fsdp2 reduced; then the replica steps on fsdp2's (copied), so that both
    optimizers see the same gradients: the Muon parameters must then stay *bitwise* equal,
    the AdamW ones and the losses within ``tol``. Returns the largest differences seen."""
    rank, size = dist.get_rank(), dist.get_world_size()
    worst = {"loss": 0.0, "grad": 0.0, "muon param": 0.0, "adamw param": 0.0}
    sharded = isinstance(next(model.parameters()), DTensor)
    muon_ids = {id(p) for p in opts.muon.param_groups[0]["params"]}
    for step in range(first, first + steps):
        x, y = _batch(step)
        xs, ys = rank_slice(x, rank, size), rank_slice(y, rank, size)
        micro = [(xs[:1], ys[:1]), (xs[1:], ys[1:])] if accumulate else [(xs, ys)]
        losses = {}
        for key, m in (("model", model), ("ref", ref)):
            total = torch.zeros(())
            for i, (xm, ym) in enumerate(micro):
                if sharded and key == "model" and accumulate:
                    m.set_requires_gradient_sync(i == len(micro) - 1)
                loss = _loss(m, xm, ym) * (xm.size(0) / xs.size(0))
                loss.backward()
                total += loss.detach()
            losses[key] = mean_over_ranks(total)
        _hand_average(ref, size)
        if not sharded:  # plain data parallelism: the model's gradients by hand too
            _hand_average(model, size)
        if clip is not None:
            fsdp2.clip_grad_norm_(model.parameters(), clip)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        grads = {n: full_value(p.grad) for n, p in model.named_parameters()}
        ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        check_same({"loss": losses["model"]}, {"loss": losses["ref"]}, f"{what} step {step}", **tol)
        check_same(grads, ref_grads, f"{what} step {step} grad", **tol)
        worst["loss"] = max(worst["loss"], (losses["model"] - losses["ref"]).abs().item())
        worst["grad"] = max(worst["grad"], _max_diff(grads, ref_grads))
        for n, p in ref.named_parameters():
            p.grad.copy_(grads[n])
        opts.step()
        ref_opts.step()
        opts.zero_grad()
        ref_opts.zero_grad()
        params = full_params(model)
        for (n, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
            key = "muon param" if id(q) in muon_ids else "adamw param"
            got, want = {n: params[n]}, {n: p.detach()}
            worst[key] = max(worst[key], _max_diff(got, want))  # type: ignore[arg-type]
            if key == "muon param":
                check_same(got, want, f"{what} step {step} param", bitwise=True)
            else:
                check_same(got, want, f"{what} step {step} param", **tol)
    return worst


def _parity_case(
    what: str,
    shard: Callable[[nn.Module], nn.Module] | None,
    *,
    bucket_bytes: int | None = None,
    tol: dict[str, float] = TOL_FP32,
    **kw: Any,
) -> dict[str, float]:
    model = _build() if shard is None else shard(_build())
    ref = _build()
    extra = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    opts = _Optimizers(model, Muon, **extra)
    ref_opts = _Optimizers(ref, torch.optim.Muon)
    hidden = opts.muon.param_groups[0]["params"]
    assert len(hidden) == len(DIMS) - 1, what
    seen = {tuple(p.placements) for p in hidden if isinstance(p, DTensor)}
    assert seen == _PLACEMENTS[what], (what, seen)
    return _train(model, ref, opts, ref_opts, what, tol=tol, **kw)


def _fsdp(mesh_fn: Callable[[], Any], **kw: Any) -> Callable[[nn.Module], nn.Module]:
    def shard(model: nn.Module) -> nn.Module:
        return shard_model(model, fsdp2.fully_shard, mesh_fn(), **kw)

    return shard


def _shard1(p: nn.Parameter) -> Shard | None:
    """``Shard(1)`` for the matrices whose columns split evenly (fsdp2 requires it)."""
    size = dist.get_world_size()
    return Shard(1) if p.ndim == 2 and p.shape[1] % size == 0 else None


def _per_param_mesh(model: nn.Module) -> nn.Module:
    """``layers[1]``'s weight on a 2x2 HSDP mesh, everything else on the 1D mesh of 4."""
    flat, hsdp = world_mesh(), hsdp_mesh((2, 2))
    special = id(model.layers[1].lin.weight)

    def fn(p: nn.Parameter) -> Any:
        return fsdp2.ShardPlacementResult(Shard(0), hsdp) if id(p) == special else None

    return shard_model(model, fsdp2.fully_shard, flat, shard_placement_fn=fn)


_PLACEMENTS: dict[str, set[tuple[Any, ...]]] = {  # of the Muon matrices, per case
    "1d": {(Shard(0),)},
    "shard1": {(Shard(1),), (Shard(0),)},  # 13x8 and 5x6 on Shard(1), 6x13 on Shard(0)
    "plain": set(),
    "hsdp": {(Replicate(), Shard(0))},
    "per_param_mesh": {(Shard(0),), (Replicate(), Shard(0))},
    "bf16": {(Shard(0),)},
    "accumulate+clip": {(Shard(0),)},
}


def _parity(world: int) -> dict[str, dict[str, float]]:
    out = {}
    cases: dict[str, Any] = {"1d": _fsdp(world_mesh)}
    if world == 2:
        cases["shard1"] = _fsdp(world_mesh, shard_placement_fn=_shard1)
        cases["plain"] = None
    if world == 4:
        cases["hsdp"] = _fsdp(lambda: hsdp_mesh((2, 2)))
        cases["per_param_mesh"] = _per_param_mesh
    for name, shard in cases.items():
        for bucket in (SMALL_BUCKET, None):
            out[f"{name} bucket={bucket}"] = _parity_case(name, shard, bucket_bytes=bucket)
    if world == 2:
        bf16 = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        out["bf16"] = _parity_case("bf16", _fsdp(world_mesh, mp_policy=bf16), tol=TOL_BF16)
        out["accumulate+clip"] = _parity_case(
            "accumulate+clip", _fsdp(world_mesh), accumulate=True, clip=0.05
        )
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_parity_with_torch_muon(world: int) -> None:
    for result in run_on_ranks(world, _parity, world):
        assert result  # every rank checked every case


# ---------------------------------------------------------------------------------------------
# Communication


@contextmanager
def _record() -> Iterator[list[tuple[str, Any]]]:
    """Record ``all_to_all_single`` calls and Newton-Schulz runs, in order."""
    events: list[tuple[str, Any]] = []
    a2a, ns = dist.all_to_all_single, muon_exchange._newton_schulz

    def spy_a2a(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kw: Any) -> Any:
        events.append(("a2a", (kw["input_split_sizes"], kw["output_split_sizes"], kw["group"])))
        return a2a(out, inp, *args, **kw)

    def spy_ns(update: torch.Tensor, *args: Any) -> torch.Tensor:
        events.append(("ns", tuple(update.shape)))
        return ns(update, *args)

    with (
        mock.patch.object(dist, "all_to_all_single", spy_a2a),
        mock.patch.object(muon_exchange, "_newton_schulz", spy_ns),
    ):
        yield events


SHAPES = [(13, 8), (6, 13), (5, 6), (40, 40), (7, 3)]


def _comm_layout(layout: str) -> list[tuple[Any, list[Any], int]]:
    """Per matrix of ``SHAPES``: its mesh, placements and how many ranks orthogonalize it
    (one per replica)."""
    if layout == "1d":  # one Shard(1) among the Shard(0)s, both uneven
        mesh = world_mesh()
        return [(mesh, [Shard(1) if i == 0 else Shard(0)], 1) for i in range(len(SHAPES))]
    hsdp = hsdp_mesh((2, 2))
    if layout == "hsdp":
        return [(hsdp, [Replicate(), Shard(0)], 2)] * len(SHAPES)
    # "mixed": per-parameter meshes, the first two matrices on the HSDP mesh
    flat = world_mesh()
    return [(hsdp, [Replicate(), Shard(0)], 2)] * 2 + [(flat, [Shard(0)], 1)] * 3


def _communication(layout: str) -> None:
    size = dist.get_world_size()
    where = _comm_layout(layout)
    for small in (True, False):
        torch.manual_seed(0)
        full = [torch.randn(s) for s in SHAPES]
        params = [
            nn.Parameter(distribute_tensor(t, mesh, pl))
            for t, (mesh, pl, _) in zip(full, where, strict=True)
        ]
        for p in params:
            p.grad = distribute_tensor(torch.randn(p.shape), p.device_mesh, p.placements)
        # buckets: one per matrix, or one per process group (route, in parameter order)
        groups = [p.device_mesh.get_group(p.device_mesh.ndim - 1) for p in params]
        bucket_groups = groups if small else list(dict.fromkeys(groups))
        n = len(bucket_groups)
        opt = Muon(params, lr=0.02, bucket_bytes=1 if small else 1 << 20)
        with _record() as events:
            opt.step()
        # per bucket two all_to_all_single on its shard group: shards out (s), results
        # back (r), pipelined: s0 s1 r0 s2 r1 ... r(n-1)
        a2a = [e[1] for e in events if e[0] == "a2a"]
        labels = ["s0"]
        for i in range(n):
            labels += [f"s{i + 1}"] * (i + 1 < n) + [f"r{i}"]
        assert len(a2a) == len(labels), (layout, small, events)
        calls = dict(zip(labels, a2a, strict=True))
        for i in range(n):
            out_call, back_call = calls[f"s{i}"], calls[f"r{i}"]
            assert out_call[2] is bucket_groups[i] and back_call[2] is bucket_groups[i]
            assert out_call[0] == back_call[1] and out_call[1] == back_call[0], (i, events)
            me = dist.get_rank(bucket_groups[i])  # its shards of its own matrices stay here
            assert out_call[0][me] == 0 and out_call[1][me] == 0, (i, events)
        if n > 1:  # the next bucket's shards go out before this bucket's Newton-Schulz
            first_ns = next(i for i, e in enumerate(events) if e[0] == "ns")
            assert [e[0] for e in events[:2]] == ["a2a", "a2a"] and first_ns >= 2, events
        # every matrix orthogonalized once per replica, on one rank of its shard group
        mine = [e[1] for e in events if e[0] == "ns"]
        gathered: list[Any] = [None] * size
        dist.all_gather_object(gathered, mine)
        seen = sorted(s for per_rank in gathered for s in per_rank)
        assert seen == sorted(s for s, w in zip(SHAPES, where, strict=True) for _ in range(w[2]))
        if layout == "1d" and not small:  # the 40x40 on one rank, the four others on the other
            assert sorted(len(g) for g in gathered) == [1, len(SHAPES) - 1], gathered
        # the numbers: torch's Muon on the full matrices, bitwise
        ref = [nn.Parameter(t.clone()) for t in full]
        for p, q in zip(params, ref, strict=True):
            q.grad = full_value(p.grad)
        torch.optim.Muon(ref, lr=0.02).step()
        for i, (p, q) in enumerate(zip(params, ref, strict=True)):
            check_same(
                {f"{i}": full_value(p)}, {f"{i}": q.detach()}, f"{layout} param", bitwise=True
            )
    # plain tensors: no collectives at all
    plain = [nn.Parameter(torch.randn(s)) for s in SHAPES]
    for p in plain:
        p.grad = torch.randn(p.shape)
    with _record() as events:
        Muon(plain, bucket_bytes=1).step()
    assert [e[0] for e in events] == ["ns"] * len(SHAPES), events


@pytest.mark.parametrize("world, layout", [(2, "1d"), (4, "hsdp"), (4, "mixed")])
def test_communication(world: int, layout: str) -> None:
    run_on_ranks(world, _communication, layout)


def _local_only_bucket() -> None:
    # A 1x8 matrix on 2 ranks: rank 1's shard is empty and rank 0 owns it, so its bucket
    # moves nothing and makes no collective; the 9x4's bucket exchanges as usual.
    torch.manual_seed(0)
    full = [torch.randn(1, 8), torch.randn(9, 4)]
    params = [nn.Parameter(distribute_tensor(t, world_mesh(), [Shard(0)])) for t in full]
    for p in params:
        p.grad = distribute_tensor(torch.randn(p.shape), p.device_mesh, p.placements)
    ref = [nn.Parameter(t.clone()) for t in full]
    for p, q in zip(params, ref, strict=True):
        q.grad = full_value(p.grad)
    opt = Muon(params, lr=0.02, bucket_bytes=1)
    with _record() as events:
        opt.step()
    assert [e[0] for e in events if e[0] == "a2a"] == ["a2a", "a2a"], events
    torch.optim.Muon(ref, lr=0.02).step()
    for i, (p, q) in enumerate(zip(params, ref, strict=True)):
        check_same({f"{i}": full_value(p)}, {f"{i}": q.detach()}, "param", bitwise=True)


def test_local_only_bucket() -> None:
    run_on_ranks(2, _local_only_bucket)


# ---------------------------------------------------------------------------------------------
# Checkpoints


def _run_for_checkpoint(root: str | None, load: bool, steps: int, first: int) -> dict[str, Any]:
    model = _fsdp(world_mesh)(_build())
    opts = _Optimizers(model, Muon, bucket_bytes=SMALL_BUCKET)
    if load:
        assert root is not None
        model_sd, optim_sd = get_state_dict(model, opts.all)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=root)
        set_state_dict(
            model, opts.all, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    loaded = _momentum(model, opts)
    losses = []
    rank, size = dist.get_rank(), dist.get_world_size()
    for step in range(first, first + steps):
        x, y = _batch(step)
        loss = _loss(model, rank_slice(x, rank, size), rank_slice(y, rank, size))
        loss.backward()
        opts.step()
        opts.zero_grad()
        losses.append(loss.detach())
        if root is not None and not load and step == first + 1:
            model_sd, optim_sd = get_state_dict(model, opts.all)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)
            saved = _momentum(model, opts)
    for p in opts.muon.param_groups[0]["params"]:
        buf = opts.muon.state[p]["momentum_buffer"]
        assert isinstance(buf, DTensor) and buf._spec == p._spec
    out = {"params": full_params(model), "loaded": loaded}
    if root is not None and not load:
        out["saved"] = saved
    return out


def _momentum(model: nn.Module, opts: _Optimizers) -> dict[str, torch.Tensor]:
    return {
        n: full_value(opts.muon.state[p]["momentum_buffer"])
        for n, p in model.named_parameters()
        if p in opts.muon.state
    }


def test_checkpoint(tmp_path: Any) -> None:
    root = os.path.join(str(tmp_path), "ckpt")
    whole = run_on_ranks(2, _run_for_checkpoint, root, False, 4, 0)[0]
    resumed = run_on_ranks(2, _run_for_checkpoint, root, True, 2, 2)[0]
    check_same(resumed["loaded"], whole["saved"], "loaded momentum (2 ranks)", bitwise=True)
    check_same(resumed["params"], whole["params"], "resumed at 2 ranks", bitwise=True)
    resumed = run_on_ranks(4, _run_for_checkpoint, root, True, 2, 2)[0]
    check_same(resumed["loaded"], whole["saved"], "loaded momentum (4 ranks)", bitwise=True)
    check_same(resumed["params"], whole["params"], "resumed at 4 ranks", **TOL_FP32)


# ---------------------------------------------------------------------------------------------
# The guard and errors


class _MyMuon(torch.optim.Muon):
    pass


def _tag_as_fsdp2(model: nn.Module) -> None:
    """Put the mark the guard looks for on each sharded parameter, as ``fully_shard`` is
    meant to (see ``test_guard_end_to_end``)."""
    for p in model.parameters():
        p._fsdp2_managed_by = "test"  # type: ignore[attr-defined]


def _guard(tag: bool) -> None:
    world = dist.get_world_size()
    for cls in (torch.optim.Muon, _MyMuon):
        model = _fsdp(world_mesh)(_build())
        if tag:
            _tag_as_fsdp2(model)
        hidden = [layer.lin.weight for layer in model.layers]
        opt = cls(hidden, lr=0.02)
        x, y = _batch(0)
        rank = dist.get_rank()
        _loss(model, rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
        before = full_params(model)
        if world > 1:
            with pytest.raises(
                RuntimeError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(13, 8\)"
            ) as info:
                opt.step()
            assert "fsdp2.optim.Muon" in str(info.value), info.value
            assert not opt.state
            check_same(full_params(model), before, "after the refused step", bitwise=True)
            # checked once per layout of param_groups: a group added later is checked again
            plain = torch.optim.Muon([nn.Parameter(torch.randn(3, 4))])
            plain.step()  # no gradients, nothing to refuse
            plain.add_param_group({"params": [model.layers[0].lin.weight]})
            with pytest.raises(RuntimeError, match=r"param_groups\[1\]\['params'\]\[0\]"):
                plain.step()
        else:
            # one rank: the local tensor is the whole matrix, torch's Muon runs on the DTensor
            # and equals fsdp2's Muon
            ours = _fsdp(world_mesh)(_build())
            ours_opt = Muon([layer.lin.weight for layer in ours.layers], lr=0.02)
            _loss(ours, x, y).backward()
            opt.step()
            ours_opt.step()
            check_same(
                full_params(model), full_params(ours), "torch Muon at world size 1", bitwise=True
            )
    # plain parameters: torch's Muon runs
    ref = _build()
    opt = torch.optim.Muon([layer.lin.weight for layer in ref.layers], lr=0.02)
    _loss(ref, *_batch(0)).backward()
    opt.step()
    # fsdp2's Muon is not refused
    model = _fsdp(world_mesh)(_build())
    if tag:
        _tag_as_fsdp2(model)
    ours_opt = Muon([layer.lin.weight for layer in model.layers])
    _loss(model, rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
    ours_opt.step()


@pytest.mark.parametrize("world", [1, 2])
def test_guard(world: int) -> None:
    """The guard on parameters carrying ``_fsdp2_managed_by`` (tagged by the test)."""
    run_on_ranks(world, _guard, True)


def test_guard_end_to_end() -> None:
    """The guard on ``fully_shard``'s own parameters, untagged by the test."""
    run_on_ranks(2, _guard, False)


def _errors() -> None:
    model = _fsdp(world_mesh)(_build())
    with pytest.raises(ValueError, match=r"only supports 2D.*param_groups\[0\]\['params'\]\[1\]"):
        Muon([model.layers[0].lin.weight, model.layers[0].lin.bias])
    tp_mesh = init_device_mesh("cpu", (1, 2))
    weird = nn.Parameter(distribute_tensor(torch.randn(4, 4), tp_mesh, [Shard(0), Shard(1)]))
    with pytest.raises(NotImplementedError, match=r"param_groups\[0\]\['params'\]\[0\]"):
        Muon([weird])
    opt = Muon([model.layers[0].lin.weight])
    with pytest.raises(NotImplementedError):
        opt.add_param_group({"params": [weird]})
    assert len(opt.param_groups) == 1
    # a full (plain) momentum buffer, e.g. a full optimizer state dict loaded as is
    w = model.layers[0].lin.weight
    w.grad = distribute_tensor(torch.ones(w.shape), w.device_mesh, w.placements)
    opt.state[w]["momentum_buffer"] = torch.zeros(w.shape)
    before = full_value(w)
    with pytest.raises(ValueError, match="momentum_buffer of param_groups"):
        opt.step()
    check_same({"w": full_value(w)}, {"w": before}, "after the refused step", bitwise=True)
    with pytest.raises(ValueError, match="bucket_bytes"):
        Muon([w], bucket_bytes=0)
    # a replicated DTensor: orthogonalized on each rank, no collective
    rep = nn.Parameter(distribute_tensor(torch.randn(5, 3), world_mesh(), [Replicate()]))
    rep.grad = distribute_tensor(torch.randn(5, 3), world_mesh(), [Replicate()])
    ref = nn.Parameter(rep.full_tensor().clone())
    ref.grad = rep.grad.full_tensor().clone()
    with _record() as events:
        Muon([rep]).step()
    torch.optim.Muon([ref]).step()
    assert [e[0] for e in events] == ["ns"]
    check_same({"rep": rep.to_local()}, {"rep": ref.detach()}, "replicated", bitwise=True)


def test_errors() -> None:
    run_on_ranks(2, _errors)


def _holds(groups: list[dict[str, Any]], p: torch.Tensor) -> bool:
    return any(q is p for g in groups for q in g["params"])


def test_muon_param_groups() -> None:
    from models import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer()  # tied head: tok_emb.weight is head.weight
    muon_groups, adamw_groups = muon_param_groups(model, muon={"lr": 0.02}, adamw={"lr": 3e-4})
    names = {id(p): n for n, p in model.named_parameters()}
    muon = [names[id(p)] for p in muon_groups[0]["params"]]
    adamw = [names[id(p)] for p in adamw_groups[0]["params"]]
    assert muon_groups[0]["lr"] == 0.02 and adamw_groups[0]["lr"] == 3e-4
    assert muon == [
        f"layers.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "fc1", "fc2")
    ]
    assert "tok_emb.weight" in adamw and "pos_emb.weight" in adamw
    assert sorted(muon + adamw) == sorted(names.values())
    # untied: the head (named "head") goes to AdamW
    torch.manual_seed(0)
    untied = TinyTransformer(tied=False)
    m, a = muon_param_groups(untied)
    assert _holds(a, untied.head.weight) and not _holds(m, untied.head.weight)
    # no module named like a head: the last Linear is the head; overrides by name
    stack = _build()
    stack.out = stack.head
    del stack.head
    m, a = muon_param_groups(stack, head_names=())
    assert _holds(a, stack.out.weight) and not _holds(m, stack.out.weight)
    m, a = muon_param_groups(
        stack, head_names=(), muon_names=["out.weight"], adamw_names=["layers.0.*"]
    )
    assert _holds(m, stack.out.weight) and _holds(a, stack.layers[0].lin.weight)
    with pytest.raises(ValueError, match="muon_names"):
        muon_param_groups(stack, muon_names=["layers.0.lin.bias"])
    # both groups build their optimizers
    Muon(m)
    torch.optim.AdamW(a)
