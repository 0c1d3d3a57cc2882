"""fsdp2's traced mode composed: HSDP, accumulation without sync, tied weights, TP.

Each case trains a small transformer four ways in one worker: an unsharded replica on the
global batch, eager ``fsdp2.fully_shard`` on the same mesh, ``fully_shard_traced``
uncompiled, and ``fully_shard_traced`` under ``torch.compile(fullgraph=True)`` with
``aot_eager``'s compilers behind a backend that keeps each compiled graph's collective ops
(``_Graphs``). Checked each time: compiled equals uncompiled traced bitwise (losses, final
parameters); traced is within float tolerance of eager fsdp2 and of the replica; no graph
break; the collectives counted in the graphs.

* HSDP (in ``test_traced_accumulation[hsdp-bf16-keep]``): the tiny transformer (tied
  embedding/head, uneven shards) on a 2x2 ``(replicate, shard)`` mesh, 4 ranks. The
  parameters are DTensors of eager's placements ``(Replicate(), Shard(0))`` on the same mesh
  (eager's state dict loads); per parameter the forward graph all-gathers once, the synced
  backward graph reduce-scatters once and all-reduces once; a 3D mesh and an unnamed 2D one
  raise ``ValueError``. (The gathers recomputed in backward are checked on FSDP's 1D mesh.)
* ``test_traced_accumulation``: 2 micro-batches with ``set_requires_gradient_sync(False)``,
  then one synced, per step (FSDP on 2 ranks in fp32; HSDP 2x2 with bf16 compute and fp32
  reduction): no gradient lands after a no-sync backward (as with eager); the no-sync
  backward graph holds no collective, the synced one a reduce-scatter (and all-reduce) per
  parameter; two graphs compiled in step 1 (one recompile when the mode changes), none in
  step 2; ``zero_grad`` drops a pending sum; a mode changed between a forward and its
  backward raises ``RuntimeError``.
* ``test_traced_tied``: the tied embedding/head is gathered once per forward and
  reduce-scattered once (its two reads' gradients summed first, as eager fsdp2 does), with
  the default partitioner; on 2 ranks the run is bitwise eager fsdp2's.
* ``test_traced_tensor_parallel``: tp_models' ``TPModel`` under the ``tp`` plan on
  (dp, tp) = (2, 2) and (replicate, shard, tp) = (2, 1, 2), 4 ranks: eager's layouts
  (meshes, placements with ``_StridedShard``, local shapes); per parameter one all-gather
  and one reduce-scatter over the shard dim (plus one all-reduce over the replicate dim),
  TP's collectives on the TP mesh; a DTensor on an unrelated mesh raises ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import models
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import tp_models
from _harness import run_on_ranks
from helpers import check_close_run, check_same, check_same_run, hsdp_mesh, world_mesh
from test_traced_leaves import mixed_placement
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fsdp2
from fsdp2.traced import fully_shard_traced

STEPS = 2
AG = "_c10d_functional.all_gather_into_tensor.default"
RS = "_c10d_functional.reduce_scatter_tensor.default"
AR = "_c10d_functional.all_reduce.default"
FP32 = {"rtol": 1e-4, "atol": 1e-4}
FP32_PARAMS = {"rtol": 1e-3, "atol": 1e-3}
BF16 = {"rtol": 2e-2, "atol": 2e-2}


class _Graphs:
    """A ``torch.compile`` backend: ``aot_eager``'s compilers (the traced aten graphs run
    eagerly), keeping each compiled forward and backward graph's collective ops, in order."""

    def __init__(self, min_cut: bool, groups: dict[tuple[int, ...], str] | None = None) -> None:
        self.min_cut = min_cut
        self.groups = groups  # a group's ranks -> a tag: its collectives read "op@tag"
        self.graphs: list[tuple[str, list[str]]] = []

    def __call__(self, gm: torch.fx.GraphModule, example: Any) -> Any:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import (
            default_partition,
            min_cut_rematerialization_partition,
        )

        def keep(kind: str) -> Any:
            def compiler(g: torch.fx.GraphModule, _: Any) -> Any:
                ops = [
                    _tagged(n, self.groups)
                    for n in g.graph.nodes
                    if n.op == "call_function" and "_c10d_functional" in str(n.target)
                ]
                self.graphs.append((kind, ops))
                return make_boxed_func(g.forward)

            return compiler

        partition = min_cut_rematerialization_partition if self.min_cut else default_partition
        return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"), partition_fn=partition)(
            gm, example
        )


def _tagged(node: torch.fx.Node, groups: dict[tuple[int, ...], str] | None) -> str:
    """A collective's op, with ``@tag`` when it runs on a group whose ranks ``groups`` tags
    (by ranks: DTensor may run TP's collectives on an equal mesh's group of another name)."""
    name = node.args[-1]
    if not groups or not isinstance(name, str) or "wait" in str(node.target):
        return str(node.target)
    from torch.distributed.distributed_c10d import _resolve_process_group

    ranks = tuple(dist.get_process_group_ranks(_resolve_process_group(name)))
    return f"{node.target}@{groups[ranks]}" if ranks in groups else str(node.target)


def _train(
    how: str, mesh: Any, backend: Any = None, micro: int = 1, steps: int = STEPS, **kw: Any
) -> dict[str, Any]:
    """``steps`` AdamW steps of the transformer, each over ``micro`` micro-batches (all but
    the last without gradient sync); ``how``: replica, eager or traced."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = models.build("transformer")
    if how != "replica":
        fn = fsdp2.fully_shard if how == "eager" else fully_shard_traced
        models.shard_model(model, fn, mesh, **kw)
    run = torch.compile(model, backend=backend, fullgraph=True) if backend else model
    opt = models.make_optimizer("adamw", model.parameters())
    losses, landed, graphs, grads = [], [], [], {}
    for step in range(steps):
        for i in range(micro):
            x, y = models.make_batch("transformer", step * micro + i)
            if how != "replica":
                x, y = models.rank_slice(x, rank, ws), models.rank_slice(y, rank, ws)
                if micro > 1:
                    model.set_requires_gradient_sync(i == micro - 1)
            loss = models.local_loss(run, "transformer", x, y)
            loss.backward()
            landed.append(any(p.grad is not None for p in model.parameters()))
            losses.append(loss.detach() if how == "replica" else models.mean_over_ranks(loss))
        if step == 0:
            grads = models.full_grads(model)
        opt.step()
        opt.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    return {
        "losses": [float(v) for v in losses],
        "params": models.full_params(model),
        "grads": grads,
        "landed": landed,
        "graphs": graphs,
        "breaks": sum(counters["graph_break"].values()),
        "n_params": len(list(model.parameters())),
        "n_whole": sum(  # kept whole by shard_placement_fn: all-reduced, not gathered
            isinstance(p, DTensor) and all(isinstance(q, Replicate) for q in p.placements)
            for p in model.parameters()
        ),
    }


def _four_ways(mesh: Any, reshard: bool, micro: int = 1, **kw: Any) -> dict[str, Any]:
    """The four runs; ``reshard`` also picks the min-cut partitioner (which honours the
    gathers' recompute tags) over the default one."""
    graphs = _Graphs(min_cut=reshard)
    out = {
        "replica": _train("replica", None, micro=micro),
        "eager": _train("eager", mesh, micro=micro, reshard_after_forward=reshard, **kw),
        "traced": _train("traced", mesh, micro=micro, reshard_after_forward=reshard, **kw),
        "compiled": _train(
            "traced", mesh, graphs, micro=micro, reshard_after_forward=reshard, **kw
        ),
    }
    out["ops"] = graphs.graphs
    return out


def _check_parity(res: dict[str, Any], tol: dict[str, float], ptol: dict[str, float]) -> None:
    compiled, traced = res["compiled"], res["traced"]
    check_same_run(compiled, traced, "compiled traced vs uncompiled traced")
    check_close_run(traced, res["eager"], "traced vs eager fsdp2", tol=tol, param_tol=ptol)
    check_close_run(traced, res["replica"], "traced vs replica", tol=tol, param_tol=ptol)
    assert compiled["breaks"] == 0, compiled


# ---------------------------------------------------------------------------------------------
# HSDP


def _hsdp_state(mesh: Any) -> dict[str, Any]:
    """HSDP's state dict against eager's (keys, meshes, placements, local shapes; loads both
    ways) and the meshes refused."""
    out: dict[str, Any] = {}
    eager = models.shard_model(models.build("transformer", seed=1), fsdp2.fully_shard, mesh)
    traced = models.shard_model(models.build("transformer", seed=2), fully_shard_traced, mesh)
    sd_eager, sd_traced = eager.state_dict(), traced.state_dict()
    layouts = []
    for key, v in sd_traced.items():
        e = sd_eager[key]
        assert isinstance(v, DTensor) and isinstance(e, DTensor), key
        layouts.append((key, v.placements == e.placements, v.device_mesh == e.device_mesh))
        assert v.to_local().shape == e.to_local().shape, key
    out["placements"] = {tuple(v.placements) for v in sd_traced.values()}
    out["layouts"] = layouts
    traced.load_state_dict(sd_eager)
    out["loaded"] = (models.full_params(traced), models.full_params(eager))
    errors = {}  # meshes fully_shard refuses too, before anything changed
    for what, bad in {
        "unnamed": init_device_mesh("cpu", (2, 2)),
        "3D": init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c")),
    }.items():
        try:
            fully_shard_traced(nn.Linear(4, 4), mesh=bad)
        except ValueError as e:
            errors[what] = str(e)
    out["errors"] = errors
    return out


def _check_hsdp_state(res: dict[str, Any]) -> None:
    assert all(same_p and same_mesh for _, same_p, same_mesh in res["layouts"]), res["layouts"]
    assert res["placements"] == {(Replicate(), Shard(0))}, res["placements"]
    check_same(*res["loaded"], "eager -> traced HSDP load", bitwise=True)
    errors = res["errors"]
    assert "mesh_dim_names" in errors["unnamed"] and "3D mesh" in errors["3D"], errors


# ---------------------------------------------------------------------------------------------
# Gradient accumulation without sync


def _accumulate(hsdp_bf16: bool) -> dict[str, Any]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = hsdp_mesh((2, 2)) if hsdp_bf16 else world_mesh()
    kw: dict[str, Any] = {}
    if hsdp_bf16:  # also norms and biases kept whole, one weight sharded on dim 1
        kw["mp_policy"] = fsdp2.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
        kw["shard_placement_fn"] = mixed_placement
    out = _four_ways(mesh, not hsdp_bf16, micro=3, **kw)
    if hsdp_bf16:  # HSDP's state dict and refused meshes (cheap: no training)
        out["hsdp"] = _hsdp_state(mesh)
    # zero_grad drops a pending no-sync sum: the synced backward after it is a plain one.
    grads = []
    for accumulate in (True, False):
        model = models.shard_model(models.build("transformer"), fully_shard_traced, mesh)
        batches = (7, 8) if accumulate else (8,)
        for i, batch in enumerate(batches):
            model.set_requires_gradient_sync(i == len(batches) - 1)
            xy = models.make_batch("transformer", batch)
            x, y = (models.rank_slice(t, rank, ws) for t in xy)
            models.local_loss(model, "transformer", x, y).backward()
            if i < len(batches) - 1:
                model.zero_grad()
        grads.append(models.full_grads(model))
    out["dropped"] = grads
    # The mode changed between a forward and its backward: refused, either way.
    errors = {}
    for first in (False, True):
        model = models.shard_model(models.build("transformer"), fully_shard_traced, mesh)
        model.set_requires_gradient_sync(first)
        x, y = (models.rank_slice(t, rank, ws) for t in models.make_batch("transformer", 0))
        loss = models.local_loss(model, "transformer", x, y)
        model.set_requires_gradient_sync(not first)
        try:
            loss.backward()
        except RuntimeError as e:
            errors[first] = str(e)
    out["errors"] = errors
    return out


@pytest.mark.parametrize("hsdp_bf16", [False, True], ids=["fsdp-fp32-reshard", "hsdp-bf16-keep"])
def test_traced_accumulation(hsdp_bf16: bool) -> None:
    res = run_on_ranks(4 if hsdp_bf16 else 2, _accumulate, hsdp_bf16)[0]
    tol, ptol = (BF16, BF16) if hsdp_bf16 else (FP32, FP32_PARAMS)
    _check_parity(res, tol, ptol)
    for how in ("eager", "traced", "compiled"):  # no gradient lands without sync
        assert res[how]["landed"] == [False, False, True] * STEPS, (how, res[how]["landed"])
    compiled = res["compiled"]
    # Step 1 compiles the no-sync graph, then (one recompile) the synced one adding the
    # sums; step 2 compiles nothing.
    assert compiled["graphs"] == [2] * STEPS, compiled["graphs"]
    n, whole = compiled["n_params"], compiled["n_whole"]
    assert (whole > 0) == hsdp_bf16, whole  # HSDP's case keeps norms and biases whole
    kinds = [kind for kind, _ in res["ops"]]
    assert kinds == ["fw", "bw", "fw", "bw"], kinds
    (_, fw_nosync), (_, bw_nosync), (_, fw_sync), (_, bw_sync) = res["ops"]
    assert fw_nosync.count(AG) == n - whole == fw_sync.count(AG), (fw_nosync, fw_sync)
    assert RS not in bw_nosync and AR not in bw_nosync, bw_nosync
    # A whole parameter is all-reduced over the shard dim, each over the replicate dim.
    ars = n + whole if hsdp_bf16 else 0
    assert bw_sync.count(RS) == n - whole and bw_sync.count(AR) == ars, bw_sync
    check_same(*res["dropped"], "synced grads after zero_grad dropped the sum", bitwise=True)
    if hsdp_bf16:
        _check_hsdp_state(res["hsdp"])
    errors = res["errors"]
    assert set(errors) == {False, True}, errors
    assert all("between a forward and its backward" in e for e in errors.values()), errors


# ---------------------------------------------------------------------------------------------
# Tied weights


def _tied() -> dict[str, Any]:
    out = _four_ways(world_mesh(), reshard=False)
    model = models.build("transformer")
    out["tied"] = model.head.weight is model.tok_emb.weight
    return out


def test_traced_tied() -> None:
    """The default partitioner (``reshard_after_forward=False``); test_traced.py's parity
    test counts the same with the min-cut one. On 2 ranks every sum is of two values, so
    eager fsdp2 (which sums the tied weight's two gradients before reducing) and the traced
    mode round alike: bitwise (with one reduce-scatter per read the tied gradient differed
    in the last bits)."""
    res = run_on_ranks(2, _tied)[0]
    assert res["tied"]
    _check_parity(res, FP32, FP32_PARAMS)
    check_same_run(res["traced"], res["eager"], "traced vs eager fsdp2")
    check_same(res["traced"]["grads"], res["eager"]["grads"], "step 1 grads", bitwise=True)
    n = res["compiled"]["n_params"]  # one more read than parameters: the tied weight's
    (_, fw), (_, bw) = res["ops"]
    assert fw.count(AG) == n and bw.count(RS) == n and AG not in bw, (fw, bw)


# ---------------------------------------------------------------------------------------------
# Tensor parallel: (dp, tp) and (replicate, shard, tp) meshes


def _tp_train(mesh_name: str, how: str, backend: _Graphs | None = None) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    mesh, dp_mesh, tp_mesh = tp_models.make_meshes(mesh_name)
    model = tp_models.build_tp_model()
    if how != "replica":
        tp_models.parallelize(model, tp_mesh, "tp")
        fn = fsdp2.fully_shard if how == "eager" else fully_shard_traced
        models.shard_model(model, fn, dp_mesh)
    run = torch.compile(model, backend=backend, fullgraph=True) if backend else model
    opt = models.make_optimizer("adamw", model.parameters())
    dp_rank, dp_size = tp_models.dp_rank_and_size(mesh)
    losses = []
    for step in range(STEPS):
        x, y = tp_models.tp_batch(step)
        if how != "replica":
            x, y = models.rank_slice(x, dp_rank, dp_size), models.rank_slice(y, dp_rank, dp_size)
        loss = tp_models.tp_loss(run, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        # the TP ranks of a dp rank hold the same loss: the mean over all is the dp mean
        losses.append(loss.detach() if how == "replica" else models.mean_over_ranks(loss))
    layout = {
        n: (p.device_mesh.mesh_dim_names, repr(tuple(p.placements)), tuple(p.to_local().shape))
        for n, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    return {
        "losses": [float(v) for v in losses],
        "params": models.full_params(model),
        "layout": layout,
        "breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
        "n_params": len(list(model.parameters())),
        "n_whole": sum(  # kept whole by shard_placement_fn: all-reduced, not gathered
            isinstance(p, DTensor) and all(isinstance(q, Replicate) for q in p.placements)
            for p in model.parameters()
        ),
    }


def _tp(mesh_name: str) -> dict[str, Any]:
    _, dp_mesh, tp_mesh = tp_models.make_meshes(mesh_name)
    dims = [("shard", dp_mesh, dp_mesh.ndim - 1), ("tp", tp_mesh, 0)]
    if dp_mesh.ndim == 2:
        dims.append(("replicate", dp_mesh, 0))
    groups = {tuple(dist.get_process_group_ranks(m.get_group(d))): n for n, m, d in dims}
    graphs = _Graphs(min_cut=True, groups=groups)
    out = {
        "replica": _tp_train(mesh_name, "replica"),
        "eager": _tp_train(mesh_name, "eager"),
        "traced": _tp_train(mesh_name, "traced"),
        "compiled": _tp_train(mesh_name, "traced", graphs),
        "ops": graphs.graphs,
    }
    # A DTensor parameter on a mesh that is no other dimension of the dp mesh's root.
    lone = init_device_mesh("cpu", (4,))
    bad = nn.Linear(4, 4)
    bad.weight = nn.Parameter(distribute_tensor(bad.weight.detach(), lone, [Shard(0)]))
    try:
        fully_shard_traced(bad, mesh=dp_mesh)
    except ValueError as e:
        out["error"] = str(e)
    return out


@pytest.mark.parametrize("mesh_name", ["fsdp2x2", "hsdp2x1x2"])
def test_traced_tensor_parallel(mesh_name: str) -> None:
    """FSDP + TP on a (dp, tp) = (2, 2) mesh, and HSDP + TP on (replicate, shard, tp) =
    (2, 1, 2), tp_models' ``tp`` plan (colwise / rowwise linears, plain norms): the
    parameters are eager's DTensors on the concatenated mesh; the forward graph all-gathers
    each parameter once over the shard dim (TP's own collectives run on tp), the backward
    graph reduce-scatters each once over it (and all-reduces over the replicate dim); with
    one rank on the shard dim (HSDP's case) neither, the local shard being the parameter."""
    res = run_on_ranks(4, _tp, mesh_name)[0]
    compiled, traced = res["compiled"], res["traced"]
    assert traced["layout"] == res["eager"]["layout"], (traced["layout"], res["eager"]["layout"])
    assert "_StridedShard(" in traced["layout"]["layers.0.attn.wq.weight"][1]
    check_same_run(compiled, traced, "compiled traced vs uncompiled traced")
    check_close_run(traced, res["eager"], "traced vs eager", tol=FP32, param_tol=FP32_PARAMS)
    check_close_run(traced, res["replica"], "traced vs replica", tol=FP32, param_tol=FP32_PARAMS)
    assert compiled["breaks"] == 0 and compiled["graphs"] == 1, compiled
    (_, fw), (_, bw) = res["ops"]
    n, hsdp = compiled["n_params"], mesh_name.startswith("hsdp")
    per_shard = 0 if hsdp else n  # (2, 1, 2): one shard rank, nothing to gather or scatter
    assert fw.count(f"{AG}@shard") == per_shard and f"{RS}@shard" not in fw, fw
    assert bw.count(f"{RS}@shard") == per_shard, bw
    assert bw.count(f"{AR}@replicate") == (n if hsdp else 0), bw
    assert any(op.endswith("@tp") for op in fw + bw), (fw, bw)  # TP's own collectives
    assert "parameter weight is a DTensor" in res["error"], res["error"]
    assert "not another dimension" in res["error"], res["error"]
