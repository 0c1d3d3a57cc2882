"""``fsdp2.checkpoint.iter_full_tensors`` on tensor- and expert-parallel models (4 gloo ranks).

* TP + FSDP on a ``(dp, tp) = (2, 2)`` mesh: ``tp_models.TPModel`` under the ``tp_sp`` plan
  (``parallelize_module``: colwise / rowwise linears, ``SequenceParallel`` norms), then
  ``fsdp2.fully_shard`` per block and on the root over ``mesh["dp"]``. Parameters are
  ``(_StridedShard(0), Shard(0))`` (colwise), ``(Shard(0), Shard(1))`` (rowwise) and
  ``(Shard(0), Replicate())`` (replicated on TP: rowwise biases, norms). Persistent buffers
  that no ``fully_shard`` touches add the other layouts of the 2D mesh: ``(Shard(0),
  Shard(0))``, ``(Shard(1), Shard(0))``, ``(Replicate(), Shard(0))`` (rows over the *tp*
  group, 7 rows: uneven), float64, int64 and one-row (an empty shard) row-sharded buffers,
  a replicated DTensor, a plain tensor and a 0-dim one; a non-persistent buffer must not be
  yielded. Checked: the yielded names are ``state_dict()``'s keys in order, and each tensor
  equals ``state_dict()[name].full_tensor()`` (or the plain tensor) bitwise with its dtype
  and shape, with the default bucket, with 1 KiB and 64-byte buckets (more all-gathers),
  and with ``dtype=torch.bfloat16`` (the full tensor cast; integers keep their dtype). At
  init the parameters equal the unsharded model's bitwise; after one AdamW step (each rank
  on its data-parallel slice, ``helpers.train_and_compare``) the streamed values are the
  trained ones: bitwise ``state_dict()``'s, and within fp32 tolerance of a replicated
  reference trained on the global batch.
* EP + FSDP: ``fsdp2.models.MoETransformer`` with ``apply_expert_parallel`` and
  ``parallelize_moe`` (as tests/integrations/test_moe.py): experts on ``(efsdp, ep)`` as
  ``(_StridedShard(0), Shard(0))`` (4 experts) or ``(Shard(1), Shard(0))`` (2 experts), dense
  parameters ``Shard(0)`` over the flattened 4-rank mesh, or ``(Replicate(), Shard(0))`` with
  HSDP dense parameters; the plain ``expert_bias`` buffer streams too, the non-persistent
  ``rope`` does not. Same checks, at init against the unsharded model bitwise, and after one
  SGD step against a replicated reference (fp32 tolerance).
* ``ranks``: on the TP + FSDP model (``tp`` plan, buffers included), ``ranks=[0]``, ``[3]``
  and ``[1, 2]``: the receivers get every tensor, the others nothing, nobody hangs, and the
  ranks stay in step (a full stream afterwards is still exact). On the EP model the same
  with one tensor per bucket (see the note at ``_moe_ranks``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from comm_counter import CommCounter
from helpers import train_and_compare
from models import rank_slice
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from tp_models import build_tp_model, dp_rank_and_size, make_meshes, parallelize, tp_batch, tp_loss

import fsdp2
from fsdp2.checkpoint import iter_full_tensors
from fsdp2.models import MoEConfig, MoETransformer, apply_expert_parallel, parallelize_moe

WORLD_SIZE = 4
REF_TOL = {"rtol": 1e-5, "atol": 1e-6}  # sharded vs replicated training: other kernels


# ---------------------------------------------------------------------------------------------
# Checking a stream against state_dict()


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict()`` with each DTensor's ``full_tensor()`` (collective)."""
    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v.detach()
        for k, v in model.state_dict().items()
    }


def _gathers(model: nn.Module, **kw: Any) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """The stream as a list, and how many of fsdp2's all-gathers it issued."""
    with CommCounter() as counter:
        got = list(iter_full_tensors(model, **kw))
    return got, len([c for c in counter.calls if c.kind == "AG"])


def _check_exact(model: nn.Module, what: str) -> dict[str, Any]:
    """Every variant of the stream equals ``state_dict()``'s full tensors, in order; returns
    the placements seen and the all-gather counts."""
    ref = _full_state(model)
    names = list(model.state_dict())
    gathers = {}
    for label, kw in {
        "default": {},
        "1KiB": {"bucket_bytes": 1024},
        "64B": {"bucket_bytes": 64},
    }.items():
        got, gathers[label] = _gathers(model, **kw)
        assert [n for n, _ in got] == names, (what, label, [n for n, _ in got])
        for name, t in got:
            want = ref[name]
            assert t.dtype == want.dtype and t.shape == want.shape, (what, label, name, t.dtype)
            assert not isinstance(t, DTensor), (what, label, name)
            assert torch.equal(t, want), (what, label, name)
    for bucket in (64 << 20, 1024):
        got = list(iter_full_tensors(model, dtype=torch.bfloat16, bucket_bytes=bucket))
        assert [n for n, _ in got] == names, (what, "bf16", bucket)
        for name, t in got:
            want = ref[name]
            want = want.to(torch.bfloat16) if want.is_floating_point() else want
            assert t.dtype == want.dtype and t.shape == want.shape, (what, "bf16", name)
            assert torch.equal(t, want), (what, "bf16", bucket, name)
    placements = {
        k: repr(tuple(v.placements))
        for k, v in model.state_dict().items()
        if isinstance(v, DTensor)
    }
    return {"placements": placements, "gathers": gathers}


def _check_close(got: dict[str, torch.Tensor], ref: nn.Module, what: str) -> None:
    """The streamed parameters against a replicated reference's, fp32 tolerance."""
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(
            got[name], want, **REF_TOL, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


# ---------------------------------------------------------------------------------------------
# 1. TP + FSDP, with buffers in the other layouts of the 2D mesh


class _Buffers(nn.Module):
    """Persistent DTensor buffers on the whole ``(dp, tp)`` mesh in layouts FSDP + TP
    parameters do not take, plain ones, and a non-persistent one. No parameters, no
    forward: no ``fully_shard`` shards them. A plain buffer sits only where the tensors
    around it could not share a bucket anyway (see ``_moe_ranks``)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        x = torch.randn(7, 6, generator=g)
        layouts: dict[str, tuple[torch.Tensor, tuple[Any, ...]]] = {
            "s0_s0": (x, (Shard(0), Shard(0))),
            "rows_tp": (x + 1, (Replicate(), Shard(0))),  # rows over the tp group, 4/3
            "s1_s0": (torch.randn(4, 9, generator=g), (Shard(1), Shard(0))),
            "rows_dp": (x + 2, (Shard(0), Replicate())),
            "rows_dp_f64": (x.double(), (Shard(0), Replicate())),
            "rows_dp_int": (torch.arange(30).view(5, 6), (Shard(0), Replicate())),
            "one_row": (x[:1] + 4, (Shard(0), Replicate())),  # dp rank 1: no rows
            "replicated": (x + 3, (Replicate(), Replicate())),
        }
        for name, (value, placements) in layouts.items():
            self.register_buffer(name, distribute_tensor(value, mesh, placements))
        self.register_buffer("steps", torch.tensor(5))
        self.register_buffer("plain", torch.randn(3, 2, generator=g))
        self.register_buffer("scratch", torch.ones(2), persistent=False)


def _tp_model(plan: str) -> tuple[nn.Module, DeviceMesh]:
    mesh, dp_mesh, tp_mesh = make_meshes("fsdp2x2")
    model = parallelize(build_tp_model(), tp_mesh, plan)
    model.extras = _Buffers(mesh)
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=dp_mesh)
    fsdp2.fully_shard(model, mesh=dp_mesh)
    return model, mesh


def _tp_fsdp() -> dict[str, Any]:
    model, mesh = _tp_model("tp_sp")
    ref = build_tp_model()
    streamed = dict(iter_full_tensors(model))
    assert "extras.scratch" not in streamed
    for name, want in ref.state_dict().items():  # nothing computed yet: bitwise
        assert torch.equal(streamed[name], want), f"init {name}"
    out = {"init": _check_exact(model, "init")}
    train_and_compare(
        ref,
        {"fsdp2": model},
        batch=tp_batch,
        loss=tp_loss,
        steps=1,
        data_parallel=dp_rank_and_size(mesh),
    )
    trained = dict(iter_full_tensors(model))
    assert not torch.equal(trained["norm.weight"], streamed["norm.weight"]), "not trained"
    _check_close(trained, ref, "trained")
    out["trained"] = _check_exact(model, "trained")
    return out


def test_tp_fsdp_streams_state_dict_full_tensors() -> None:
    out = run_on_ranks(WORLD_SIZE, _tp_fsdp)
    for phase in ("init", "trained"):
        placements = out[0][phase]["placements"]
        assert all(o[phase]["placements"] == placements for o in out)
        seen = set(placements.values())
        for want in (
            "(_StridedShard(dim=0, sf=2), Shard(dim=0))",  # colwise
            "(Shard(dim=0), Shard(dim=1))",  # rowwise
            "(Shard(dim=0), Replicate())",  # replicated on TP
            "(Shard(dim=0), Shard(dim=0))",
            "(Shard(dim=1), Shard(dim=0))",
            "(Replicate(), Shard(dim=0))",
            "(Replicate(), Replicate())",
        ):
            assert want in seen, (phase, want, seen)
        assert placements["norm.weight"] == "(Shard(dim=0), Replicate())", placements
        for rank_out in out:
            gathers = rank_out[phase]["gathers"]
            # smaller buckets: more all-gathers (one per "rows" bucket; the TP-sharded
            # tensors between the row-sharded ones already cut most buckets)
            assert 1 <= gathers["default"] <= gathers["1KiB"] < gathers["64B"], gathers


# ---------------------------------------------------------------------------------------------
# 2. EP + FSDP: a mixture-of-experts model, experts and dense parameters on two meshes

MOE_BATCH, MOE_SEQ = 8, 8


def _moe(num_experts: int, hsdp: bool, seed: int = 0) -> tuple[MoETransformer, MoETransformer]:
    """(EP + FSDP model, its unsharded twin) with the same init."""
    if hsdp:  # dense HSDP (replicate 2 x shard 2); experts efsdp = dim 0, ep = dim 1
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        dp, efsdp, ep = mesh, mesh["dp_replicate"], mesh["dp_shard"]
    else:  # dense FSDP over all 4 ranks, experts (efsdp, ep) = (2, 2)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
        dp, efsdp, ep = mesh._flatten("dp"), mesh["efsdp"], mesh["ep"]
    cfg = MoEConfig(num_experts=num_experts)
    torch.manual_seed(seed)
    ref = MoETransformer(cfg)
    torch.manual_seed(seed)
    model = MoETransformer(cfg)
    apply_expert_parallel(model, ep)
    parallelize_moe(
        model, fully_shard=fsdp2.fully_shard, dp_mesh=dp, efsdp_mesh=efsdp, ep_degree=ep.size()
    )
    return model, ref


def _moe_step(model: nn.Module, ref: nn.Module) -> None:
    """One SGD step: ``ref`` on the global batch, ``model`` on this rank's slice with its
    loss / 4 (the divide factor is 1: [Note: MoE loss scaling])."""
    g = torch.Generator().manual_seed(2000)
    tokens = torch.randint(0, MoEConfig().vocab_size, (MOE_BATCH, MOE_SEQ + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    rank, world = dist.get_rank(), dist.get_world_size()
    for m, loss in (
        (ref, ref(x, y)),
        (model, model(rank_slice(x, rank, world), rank_slice(y, rank, world)) / world),
    ):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        loss.backward()
        opt.step()
        opt.zero_grad()


def _ep_fsdp(num_experts: int, hsdp: bool) -> dict[str, Any]:
    model, ref = _moe(num_experts, hsdp)
    streamed = dict(iter_full_tensors(model))
    names = list(ref.state_dict())
    assert list(streamed) == names and "rope" not in streamed
    for name, want in ref.state_dict().items():
        assert torch.equal(streamed[name], want), f"init {name}"
    out = {"init": _check_exact(model, "init")}
    if not hsdp:
        _moe_step(model, ref)
        trained = dict(iter_full_tensors(model))
        w1 = "layers.0.moe.experts.w1"
        assert not torch.equal(trained[w1], streamed[w1]), "not trained"
        _check_close(trained, ref, "trained")
        out["trained"] = _check_exact(model, "trained")
    return out


def test_ep_fsdp_streams_state_dict_full_tensors() -> None:
    cases = {
        "experts_shard0": (
            4,
            False,
            "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
            "(Shard(dim=0),)",
        ),
        "experts_shard1": (2, False, "(Shard(dim=1), Shard(dim=0))", "(Shard(dim=0),)"),
        "hsdp_dense": (
            4,
            True,
            "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
            "(Replicate(), Shard(dim=0))",
        ),
    }
    for case, (num_experts, hsdp, experts, dense) in cases.items():
        out = run_on_ranks(WORLD_SIZE, _ep_fsdp, num_experts, hsdp)
        for phase, result in out[0].items():
            placements = result["placements"]
            assert placements["layers.1.moe.experts.w2"] == experts, (case, placements)
            assert placements["layers.1.moe.router.weight"] == dense, (case, placements)
            assert placements["output.weight"] == dense, (case, placements)
            assert "layers.0.moe.expert_bias" not in placements, (case, phase)  # plain


# ---------------------------------------------------------------------------------------------
# 3. ranks=: the receivers get everything, the others nothing, and nobody hangs


def _receivers(model: nn.Module, ranks: list[int], **kw: Any) -> dict[str, Any]:
    ref = _full_state(model)
    got = list(iter_full_tensors(model, ranks=ranks, **kw))
    if dist.get_rank() in ranks:
        assert [n for n, _ in got] == list(ref), (ranks, [n for n, _ in got])
        for name, t in got:
            want = ref[name]
            if kw.get("dtype") is not None and want.is_floating_point():
                want = want.to(kw["dtype"])
            assert t.dtype == want.dtype and torch.equal(t, want), (ranks, name)
    else:
        assert got == [], (ranks, dist.get_rank())
    flag = torch.ones(1)  # every rank still in step: a collective of the default group
    dist.all_reduce(flag)
    assert flag.item() == dist.get_world_size()
    return {"n": len(got)}


def _tp_ranks() -> list[int]:
    model, _ = _tp_model("tp")
    counts = [_receivers(model, [0])["n"]]
    counts.append(_receivers(model, [3], bucket_bytes=64)["n"])
    counts.append(_receivers(model, [1, 2], dtype=torch.bfloat16)["n"])
    counts.append(_receivers(model, [0], dtype=torch.bfloat16, bucket_bytes=1024)["n"])
    for name, t in iter_full_tensors(model):  # the collectives still line up afterwards
        v = model.state_dict()[name]
        assert torch.equal(t, v.full_tensor() if isinstance(v, DTensor) else v), name
    return counts


def _moe_ranks() -> list[int]:
    # Regression: a rank outside ``ranks`` used to merge ``ffn_norm.weight`` and
    # ``moe.router.weight`` into one all-gather (it skipped the plain ``moe.expert_bias``
    # between them) while a receiver gathered them in two: a collective mismatch (gloo:
    # "Received data size doesn't match expected size"). Default buckets and one tensor each.
    model, _ = _moe(4, hsdp=False)
    return [
        _receivers(model, [0])["n"],
        _receivers(model, [2], bucket_bytes=1)["n"],
    ]


def test_ranks_receive_the_others_yield_nothing() -> None:
    n_tp = len(build_tp_model().state_dict()) + 10  # + the persistent buffers of _Buffers
    out = run_on_ranks(WORLD_SIZE, _tp_ranks)
    assert [o[0] for o in out] == [n_tp, 0, 0, 0]
    assert [o[1] for o in out] == [0, 0, 0, n_tp]
    assert [o[2] for o in out] == [0, n_tp, n_tp, 0]
    assert [o[3] for o in out] == [n_tp, 0, 0, 0]
    n_moe = len(MoETransformer(MoEConfig()).state_dict())
    out = run_on_ranks(WORLD_SIZE, _moe_ranks)
    assert [o[0] for o in out] == [n_moe, 0, 0, 0]
    assert [o[1] for o in out] == [0, 0, n_moe, 0]
