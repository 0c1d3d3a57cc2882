"""``fsdp2.optim.Muon`` over tensor parallelism + FSDP (4 gloo ranks): parameters sharded
over several mesh dims, each matrix put together whole on one owner rank of the flattened
group of those dims.

* Layouts (``distribute_tensor`` on a ``(dp, tp) = (2, 2)`` mesh, odd shapes): FSDP + TP's
  colwise ``(_StridedShard(0, sf=2), Shard(0))`` and rowwise ``(Shard(0), Shard(1))``, and
  ``(Shard(1), Shard(0))``, ``(Shard(0), Shard(0))``, ``(_StridedShard(1, sf=2), Shard(1))``,
  ``(Shard(0), _StridedShard(0, sf=2))`` (pieces of non-contiguous rows: index tensors), next
  to a one-``Shard`` ``(Shard(0), Replicate())`` matrix, split by ``distribute_tensor``. Two
  steps (small buckets, then one bucket) leave every rank's local tensors bitwise equal to
  ``distribute_tensor`` of ``torch.optim.Muon``'s full matrices; where ``Muon`` computes each
  rank's piece to lie in the full matrix, that rank's local tensor is; each matrix is
  orthogonalized once (the one-``Shard`` matrix once per tp replica); per bucket two
  ``all_to_all_single`` on the group of 4 ranks (on the dp group of 2 for the one-``Shard``
  matrix); the flattened group is created once (cached). ``test_index_forms``: the owner's
  reads and writes of a piece by slices and index tensors, on one process.
* Training parity: ``tp_models.TPModel`` with ``parallelize_module`` on ``mesh["tp"]`` and
  ``fsdp2.fully_shard`` on the data-parallel mesh, Muon (``muon_param_groups``: the 12
  attention and MLP matrices, colwise and rowwise) + AdamW for the rest, 3 steps against an
  unsharded replica stepping ``torch.optim.Muon`` + ``torch.optim.AdamW``. The replica runs
  the global batch; its loss and gradients must be within ``TOL`` of fsdp2's; then it steps on
  fsdp2's gradients (copied), and the Muon parameters must be *bitwise* equal after every
  step, the AdamW ones within ``TOL``. Meshes: FSDP x TP ``(2, 2)`` (small buckets and the
  default), HSDP + TP ``(1, 2, 2)`` (exchanges over the flattened ``(shard, tp)`` group) and
  ``(2, 1, 2)`` (only TP splits: the one-``Shard`` path over the tp group).
* Checkpoint: on ``(2, 2)``, DCP save of model + both optimizers after 2 steps, load into a
  fresh model and optimizers: the loaded momentum equals the saved one and the third step
  equals the uninterrupted run's, bitwise.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _harness import run_on_ranks
from helpers import TOL, check_same
from models import full_grads, full_params, full_value, mean_over_ranks, rank_slice, shard_model
from test_muon import _Optimizers
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from tp_models import build_tp_model, dp_rank_and_size, make_meshes, parallelize, tp_batch, tp_loss

import fsdp2
import fsdp2.muon._exchange as muon_exchange
import fsdp2.muon._optimizer as muon_optimizer
from fsdp2.optim import Muon

WORLD_SIZE = 4
SMALL_BUCKET = 2 * 8 * 8  # one 8x8 matrix in bfloat16: several buckets per step


@contextmanager
def _record() -> Iterator[list[tuple[str, Any]]]:
    """Record ``all_to_all_single`` calls (their group's size) and Newton-Schulz runs."""
    events: list[tuple[str, Any]] = []
    a2a, ns = dist.all_to_all_single, muon_exchange._newton_schulz

    def spy_a2a(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kw: Any) -> Any:
        events.append(("a2a", dist.get_world_size(kw["group"])))
        return a2a(out, inp, *args, **kw)

    def spy_ns(update: torch.Tensor, *args: Any) -> torch.Tensor:
        events.append(("ns", tuple(update.shape)))
        return ns(update, *args)

    with (
        mock.patch.object(dist, "all_to_all_single", spy_a2a),
        mock.patch.object(muon_exchange, "_newton_schulz", spy_ns),
    ):
        yield events


# ---------------------------------------------------------------------------------------------
# Layouts


LAYOUTS: list[tuple[tuple[int, int], list[Any]]] = [
    ((13, 8), [_StridedShard(0, split_factor=2), Shard(0)]),  # colwise under FSDP
    ((7, 10), [Shard(0), Shard(1)]),  # rowwise under FSDP
    ((6, 13), [Shard(1), Shard(0)]),
    ((10, 3), [Shard(0), Shard(0)]),
    ((5, 11), [_StridedShard(1, split_factor=2), Shard(1)]),
    ((9, 6), [Shard(0), _StridedShard(0, split_factor=2)]),  # rows not contiguous
    ((11, 7), [Shard(0), Replicate()]),  # one Shard: over the dp group
]


def _layouts() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    torch.manual_seed(0)
    full = [torch.randn(shape) for shape, _ in LAYOUTS]
    params = [
        nn.Parameter(distribute_tensor(t, mesh, pl, src_data_rank=None))
        for t, (_, pl) in zip(full, LAYOUTS, strict=True)
    ]
    grads = [torch.randn(shape) for shape, _ in LAYOUTS]
    for p, g in zip(params, grads, strict=True):
        p.grad = distribute_tensor(g, mesh, p.placements, src_data_rank=None)
    ref = [nn.Parameter(t.clone()) for t in full]
    for q, g in zip(ref, grads, strict=True):
        q.grad = g.clone()
    for small in (True, False):
        opt = Muon(params, lr=0.02, bucket_bytes=1 if small else 1 << 20)
        ref_opt = torch.optim.Muon(ref, lr=0.02)
        for _ in range(2):
            with _record() as events:
                opt.step()
            ref_opt.step()
            for i, (p, q) in enumerate(zip(params, ref, strict=True)):
                want = _mine(q.detach(), mesh, p.placements)
                check_same({f"{i}": p.to_local()}, {f"{i}": want}, "param", bitwise=True)
            # two all_to_all_single per bucket: on the 4 ranks for several Shards, on dp
            sizes = [e[1] for e in events if e[0] == "a2a"]
            want = [4] * 2 * (len(LAYOUTS) - 1) + [2] * 2 if small else [4, 4, 2, 2]
            assert sorted(sizes, reverse=True) == want, events
            mine = [e[1] for e in events if e[0] == "ns"]
            gathered: list[Any] = [None] * WORLD_SIZE
            dist.all_gather_object(gathered, mine)
            seen = sorted(s for per_rank in gathered for s in per_rank)
            # once per matrix; the one-Shard matrix once per tp replica
            assert seen == sorted([shape for shape, _ in LAYOUTS] + [(11, 7)]), gathered
        # where Muon puts each rank's piece: the local tensor, cut from the full matrix
        for p, q in zip(params[:-1], ref[:-1], strict=True):  # not the one-Shard matrix
            plan = next(v for k, v in opt._plans.items() if k[1] == tuple(p.placements))
            pg, me, pieces = plan
            assert me == dist.get_rank(pg) and dist.get_world_size(pg) == WORLD_SIZE
            local = q.detach()[pieces.index[me]]
            assert torch.equal(local, p.to_local()), (p.placements, local, p.to_local())
            if p.placements[1] == _StridedShard(0, split_factor=2):
                assert isinstance(pieces.index[me][0], torch.Tensor)  # non-contiguous rows
        assert len(opt._plans) == len(LAYOUTS) - 1 and len(opt._flat_meshes) == 1
        flat = next(iter(opt._flat_meshes.values()))
        assert flat is mesh._flatten("dp_tp") and dist.get_rank(flat.get_group()) == rank


def _mine(full: torch.Tensor, mesh: Any, placements: Any) -> torch.Tensor:
    """This rank's local tensor of ``full`` with ``placements``, as ``distribute_tensor``
    splits it. Not ``full_tensor()``: once the ``(dp, tp)`` mesh is flattened (``Muon`` does
    it), torch 2.13 merges its two all-gathers into one and puts the uneven
    ``(Shard(0), Shard(0))`` matrix back together with padding in it."""
    return distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()


def test_layouts() -> None:
    run_on_ranks(WORLD_SIZE, _layouts)


def test_index_forms() -> None:
    """``full[index]`` is ``full[rows][:, cols]`` for every mix of contiguous (slices) and
    non-contiguous (index tensors) rows and columns, read and written (no ranks needed)."""
    full = torch.arange(7 * 6).view(7, 6)
    for rows in (torch.arange(2, 5), torch.tensor([0, 3, 4]), torch.arange(0)):
        for cols in (torch.arange(1, 6), torch.tensor([5, 0]), torch.arange(0)):
            index = muon_optimizer._index(rows, cols, torch.device("cpu"))
            want = full.index_select(0, rows).index_select(1, cols)
            assert torch.equal(full[index], want), (rows, cols)
            copy = torch.zeros_like(full)
            copy[index] = want
            assert torch.equal(copy.index_select(0, rows).index_select(1, cols), want)
            assert copy.count_nonzero() == want.count_nonzero()


# ---------------------------------------------------------------------------------------------
# Training parity and checkpoints


def _model(mesh_name: str) -> tuple[Any, nn.Module]:
    mesh, dp_mesh, tp_mesh = make_meshes(mesh_name)
    return mesh, shard_model(
        parallelize(build_tp_model(), tp_mesh, "tp"), fsdp2.fully_shard, dp_mesh
    )


def _momentum(opts: _Optimizers) -> dict[str, torch.Tensor]:
    return {
        f"{i}": full_value(opts.muon.state[p]["momentum_buffer"])
        for i, p in enumerate(opts.muon.param_groups[0]["params"])
    }


def _parity(mesh_name: str, bucket_bytes: int | None, root: str | None) -> dict[str, Any]:
    """3 steps against the replica; with ``root``, a DCP save after 2 and a resumed third."""
    start = time.perf_counter()
    mesh, model = _model(mesh_name)
    ref = build_tp_model()
    extra = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    opts, ref_opts = _Optimizers(model, Muon, **extra), _Optimizers(ref, torch.optim.Muon)
    muon_names = {n for n, p in model.named_parameters() if _holds(opts.muon, p)}
    assert len(muon_names) == 12, muon_names
    for n, p in model.named_parameters():
        if n in muon_names:
            assert sum(not isinstance(pl, Replicate) for pl in p.placements) == 2, (n, p)
    rank, size = dp_rank_and_size(mesh)
    worst = {"loss": 0.0, "grad": 0.0, "adamw param": 0.0}
    for step in range(3):
        if root is not None and step == 2:
            model_sd, optim_sd = get_state_dict(model, opts.all)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)
            saved = _momentum(opts)
        x, y = tp_batch(step)
        loss = tp_loss(model, rank_slice(x, rank, size), rank_slice(y, rank, size))
        loss.backward()
        ref_loss = tp_loss(ref, x, y)
        ref_loss.backward()
        got_loss = mean_over_ranks(loss.detach())
        check_same({"loss": got_loss}, {"loss": ref_loss.detach()}, f"step {step}", **TOL)
        worst["loss"] = max(worst["loss"], (got_loss - ref_loss).abs().item())
        grads = full_grads(model)
        for n, p in ref.named_parameters():
            g = grads[n]
            assert g is not None and p.grad is not None
            check_same({n: g}, {n: p.grad}, f"step {step} grad", **TOL)
            worst["grad"] = max(worst["grad"], (g - p.grad).abs().max().item())
            p.grad.copy_(g)  # both optimizers step on the same gradients
        for o in (opts, ref_opts):
            o.step()
            o.zero_grad()
        params = full_params(model)
        if step == 0:
            _check_pieces(mesh_name, model, opts.muon, params)
        for n, p in ref.named_parameters():
            if n in muon_names:
                check_same({n: params[n]}, {n: p.detach()}, f"step {step}", bitwise=True)
            else:
                check_same({n: params[n]}, {n: p.detach()}, f"step {step}", **TOL)
                diff = (params[n] - p.detach()).abs().max().item()
                worst["adamw param"] = max(worst["adamw param"], diff)
    out: dict[str, Any] = {"worst": worst, "seconds": time.perf_counter() - start}
    if root is not None:
        dist.barrier()
        _, fresh = _model(mesh_name)
        fresh_opts = _Optimizers(fresh, Muon, **extra)
        model_sd, optim_sd = get_state_dict(fresh, fresh_opts.all)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=root)
        set_state_dict(
            fresh, fresh_opts.all, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        check_same(_momentum(fresh_opts), saved, "loaded momentum", bitwise=True)
        for p in fresh_opts.muon.param_groups[0]["params"]:
            assert fresh_opts.muon.state[p]["momentum_buffer"]._spec == p._spec
        x, y = tp_batch(2)
        tp_loss(fresh, rank_slice(x, rank, size), rank_slice(y, rank, size)).backward()
        fresh_opts.step()
        fresh_opts.zero_grad()
        check_same(full_params(fresh), full_params(model), "resumed step 2", bitwise=True)
    return out


def _check_pieces(
    mesh_name: str, model: nn.Module, opt: torch.optim.Optimizer, params: dict[str, torch.Tensor]
) -> None:
    """fsdp2's FSDP + TP layouts: where ``Muon`` puts each rank's piece, the local tensor is
    (cut from ``full_tensor()``). Only TP splitting (``hsdp2x1x2``): no pieces, the
    one-``Shard`` path."""
    plans = opt._plans  # type: ignore[attr-defined]
    assert len(plans) == (0 if mesh_name == "hsdp2x1x2" else 4), plans.keys()  # 4 layouts
    for n, p in model.named_parameters():
        for key, (pg, me, pieces) in plans.items():
            if key[:3] == (p.device_mesh, tuple(p.placements), tuple(p.shape)):
                assert dist.get_world_size(pg) == WORLD_SIZE
                assert torch.equal(params[n][pieces.index[me]], p.to_local()), n


def _holds(opt: torch.optim.Optimizer, p: torch.Tensor) -> bool:
    return any(q is p for g in opt.param_groups for q in g["params"])


def _parity_cases(root: str) -> dict[str, Any]:
    return {
        "fsdp2x2 small buckets + DCP": _parity("fsdp2x2", SMALL_BUCKET, root),
        "fsdp2x2": _parity("fsdp2x2", None, None),
        "hsdp1x2x2": _parity("hsdp1x2x2", SMALL_BUCKET, None),
        "hsdp2x1x2": _parity("hsdp2x1x2", None, None),
    }


def test_fsdp_tp_parity_with_torch_muon(tmp_path: Any) -> None:
    root = os.path.join(str(tmp_path), "ckpt")
    results = run_on_ranks(WORLD_SIZE, _parity_cases, root)
    for case, result in results[0].items():
        print(case, result)
