"""fsdp2's traced mode (``fsdp2.traced.fully_shard_traced``): the collectives in the graph.

Each parity case trains the tiny transformer (2 blocks, a tied embedding/head, uneven
shards) four ways in one worker (2 ranks, gloo, 3 AdamW steps): an unsharded replica on the
global batch, eager ``fsdp2.fully_shard``, the traced mode uncompiled, and the traced mode
under ``torch.compile(fullgraph=True)`` with ``aot_eager``'s compilers behind a backend that
records the forward and backward graphs. It checks:

* compiled traced equals uncompiled traced bitwise (losses and final parameters);
* traced equals eager fsdp2 and the replica within float tolerance;
* the graphs hold the collectives: one ``all_gather_into_tensor`` per parameter in the
  forward graph, one ``reduce_scatter_tensor`` per parameter in the backward graph (the tied
  weight's two reads share one gather: tests/integrations/test_traced_compose.py), all-gathers
  recomputed in the backward graph with ``reshard_after_forward=True`` (the min-cut
  partitioner, which honours the recompute tags) and none with ``False``; one graph, no
  graph break, nothing recompiled after step 1.

``test_traced_state_dict`` swaps state dicts between eager fsdp2 and the traced mode (same
keys, DTensors on the same mesh and placements, the same values both ways) and checks
``fsdp2.clip_grad_norm_`` and the refusals (each a ``NotImplementedError`` before any
collective), DCP save and load (traced to traced, to torch's FSDP2 and back), activation
checkpointing uncompiled, meta-device init
(bitwise eager's), and that a read outside forward is the sharded parameter.
``test_traced_inductor``: the default backend on a small MLP, within tolerance of the
uncompiled traced mode. ``test_traced_checkpoint_compiled``: checkpointed blocks compiled.
``test_traced_one_rank``: world size 1, no collective in the graphs, bitwise the unsharded model.
"""

from __future__ import annotations

from typing import Any

import models
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from helpers import check_close_run, check_same, check_same_run, world_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fsdp2
from fsdp2.traced import TracedModule, fully_shard_traced

STEPS = 3
AG = "_c10d_functional.all_gather_into_tensor.default"
RS = "_c10d_functional.reduce_scatter_tensor.default"


class _Recorder:
    """A ``torch.compile`` backend: ``aot_eager``'s compilers (the traced aten graphs run
    eagerly), keeping each forward and backward graph's collective ops."""

    def __init__(self, min_cut: bool) -> None:
        self.min_cut = min_cut
        self.ops: dict[str, list[str]] = {"fw": [], "bw": []}

    def __call__(self, gm: torch.fx.GraphModule, example: Any) -> Any:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import (
            default_partition,
            min_cut_rematerialization_partition,
        )

        def keep(kind: str) -> Any:
            def compiler(g: torch.fx.GraphModule, _: Any) -> Any:
                self.ops[kind] += [
                    str(n.target)
                    for n in g.graph.nodes
                    if n.op == "call_function" and "_c10d_functional" in str(n.target)
                ]
                return make_boxed_func(g.forward)

            return compiler

        partition = min_cut_rematerialization_partition if self.min_cut else default_partition
        return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"), partition_fn=partition)(
            gm, example
        )


def _param_reads(model: nn.Module) -> tuple[int, int]:
    """Gathers and reduce-scatters in one step's graphs: one per parameter (a second read of
    the tied weight in the same forward reuses the first's gather)."""
    n = len(list(model.parameters()))
    return n, n


def _shard(model: nn.Module, how: str, **kw: Any) -> nn.Module:
    fn = fsdp2.fully_shard if how == "eager" else fully_shard_traced
    return models.shard_model(model, fn, world_mesh(), **kw)


def _train(how: str, backend: Any, **kw: Any) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = models.build("transformer")
    reads = _param_reads(model)
    if how != "replica":
        _shard(model, "eager" if how == "eager" else "traced", **kw)
    run = torch.compile(model, backend=backend, fullgraph=True) if backend else model
    opt = models.make_optimizer("adamw", model.parameters())
    losses, graphs, frames = [], [], []
    for step in range(STEPS):
        x, y = models.make_batch("transformer", step)
        if how != "replica":
            x, y = models.rank_slice(x, rank, ws), models.rank_slice(y, rank, ws)
        loss = models.local_loss(run, "transformer", x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach() if how == "replica" else models.mean_over_ranks(loss))
        graphs.append(counters["stats"]["unique_graphs"])
        frames.append(counters["frames"]["total"])  # frames compiled so far
    return {
        "losses": [float(v) for v in losses],
        "params": models.full_params(model),
        "graphs": graphs,
        "breaks": sum(counters["graph_break"].values()),
        "recompiles": frames[-1] - frames[0],  # compiled after step 1
        "reads": reads,
    }


def _four_ways(bf16: bool, reshard: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {"reshard_after_forward": reshard}
    if bf16:
        kw["mp_policy"] = fsdp2.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    recorder = _Recorder(min_cut=reshard)
    out = {
        "replica": _train("replica", None),
        "eager": _train("eager", None, **kw),
        "traced": _train("traced", None, **kw),
        "compiled": _train("traced", recorder, **kw),
    }
    out["ops"] = recorder.ops
    return out


@pytest.mark.parametrize(
    "bf16, reshard",
    [pytest.param(False, True, id="fp32-reshard"), pytest.param(True, False, id="bf16-keep")],
)
def test_traced_parity(bf16: bool, reshard: bool) -> None:
    res = run_on_ranks(2, _four_ways, bf16, reshard)[0]
    compiled, traced = res["compiled"], res["traced"]
    check_same_run(compiled, traced, "compiled traced vs uncompiled traced")
    tol = {"rtol": 2e-2, "atol": 2e-2} if bf16 else {"rtol": 1e-4, "atol": 1e-4}
    ptol = {"rtol": 2e-2, "atol": 2e-2} if bf16 else {"rtol": 1e-3, "atol": 1e-3}
    check_close_run(traced, res["eager"], "traced vs eager fsdp2", tol=tol, param_tol=ptol)
    check_close_run(traced, res["replica"], "traced vs replica", tol=tol, param_tol=ptol)
    # One graph, compiled in step 1 (forward and backward), with no break and no recompile.
    assert compiled["breaks"] == 0, compiled
    assert compiled["graphs"] == [1] * STEPS, compiled["graphs"]
    assert not compiled["recompiles"], compiled["recompiles"]
    # The collectives are ops of the compiled graphs (compiled once: step 1's graphs).
    fw, bw, (gathers, reads) = res["ops"]["fw"], res["ops"]["bw"], compiled["reads"]
    assert fw.count(AG) == (gathers if reshard else reads) and RS not in fw, fw
    assert bw.count(RS) == reads, bw
    if reshard:  # the unsharded parameters backward needs are gathered again, not saved
        assert 0 < bw.count(AG) <= reads, bw
    else:
        assert AG not in bw, bw


def _state_dict_and_errors(ckpt_dir: str) -> dict[str, Any]:
    mesh = world_mesh()
    eager = _shard(models.build("transformer", seed=1), "eager")
    traced = _shard(models.build("transformer", seed=2), "traced")
    sd_eager, sd_traced = eager.state_dict(), traced.state_dict()
    assert list(sd_eager) == list(sd_traced), (list(sd_eager), list(sd_traced))
    for key, v in sd_traced.items():
        e = sd_eager[key]
        assert isinstance(v, DTensor) and isinstance(e, DTensor), key
        assert v.device_mesh == e.device_mesh and v.placements == e.placements, key
        assert v.to_local().shape == e.to_local().shape, key
    # Outside forward a read is the sharded parameter itself (no collective), as with eager.
    fc1 = traced.layers[0].fc1
    assert fc1.weight is dict(traced.named_parameters())["layers.0.fc1.weight"]
    assert isinstance(fc1.weight, DTensor) and fc1.weight.placements == (Shard(0),)
    traced.load_state_dict(sd_eager)
    loaded = models.full_params(traced)
    fresh = _shard(models.build("transformer", seed=3), "eager")
    fresh.load_state_dict(_shard(models.build("transformer", seed=1), "traced").state_dict())
    back = models.full_params(fresh)
    want = models.full_params(eager)

    # fsdp2.clip_grad_norm_ over the traced mode's DTensor gradients: eager's norm.
    norms = []
    rank, ws = dist.get_rank(), dist.get_world_size()
    for model in (eager, traced):
        x, y = models.make_batch("transformer", 0)
        models.local_loss(model, "transformer", models.rank_slice(x, rank, ws),
                          models.rank_slice(y, rank, ws)).backward()  # fmt: skip
        norms.append(models.full_value(fsdp2.clip_grad_norm_(model.parameters(), 1.0)))

    # DCP: save the traced model, load into a fresh traced model.
    import torch.distributed.checkpoint as dcp

    dcp.save(traced.state_dict(), checkpoint_id=ckpt_dir)
    fresh = _shard(models.build("transformer", seed=4), "traced")
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=ckpt_dir)
    fresh.load_state_dict(sd)
    dcp_pairs = (models.full_params(fresh), models.full_params(traced))
    # ... and between the traced mode and torch's FSDP2, both ways.
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    theirs = models.shard_model(models.build("transformer", seed=5), torch_fully_shard, mesh)
    sd = theirs.state_dict()
    dcp.load(sd, checkpoint_id=ckpt_dir)  # the traced model's checkpoint
    theirs.load_state_dict(sd)
    dcp.save(theirs.state_dict(), checkpoint_id=ckpt_dir + "-torch")
    ours = _shard(models.build("transformer", seed=6), "traced")
    sd = ours.state_dict()
    dcp.load(sd, checkpoint_id=ckpt_dir + "-torch")
    ours.load_state_dict(sd)
    dcp_pairs += (models.full_params(theirs), models.full_params(ours))

    # Activation checkpointing (uncompiled): blocks under checkpoint_wrapper, then sharded.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    ac_runs = []
    for ac in (False, True):
        model = models.build("transformer")
        if ac:
            for i, block in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(block)
        _shard(model, "traced")
        x, y = models.make_batch("transformer", 1)
        models.local_loss(model, "transformer", models.rank_slice(x, rank, ws),
                          models.rank_slice(y, rank, ws)).backward()  # fmt: skip
        grads = models.full_grads(model)
        ac_runs.append({k.replace("_checkpoint_wrapped_module.", ""): g for k, g in grads.items()})

    # Meta-device init: shard on meta, to_empty, initialize (outside forward, on DTensors).
    meta = []
    for how in ("eager", "traced"):
        with torch.device("meta"):
            model = models.build("mlp")
        _shard(model, how)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
        x, y = models.make_batch("mlp", 0)
        loss = models.local_loss(model, "mlp", models.rank_slice(x, rank, ws),
                                 models.rank_slice(y, rank, ws))  # fmt: skip
        meta.append({"loss": loss.detach(), **models.full_params(model)})

    errors = {}

    def refused(what: str, fn: Any) -> None:
        try:
            fn()
        except NotImplementedError as e:
            errors[what] = str(e)
        else:
            raise AssertionError(f"{what}: no NotImplementedError")

    refused("offload", lambda: fully_shard_traced(
        nn.Linear(4, 4), mesh=mesh, offload_policy=fsdp2.CPUOffloadPolicy()))  # fmt: skip
    refused("reshard int", lambda: fully_shard_traced(
        nn.Linear(4, 4), mesh=mesh, reshard_after_forward=2))  # fmt: skip
    tp = nn.Linear(4, 4)
    tp.weight = nn.Parameter(distribute_tensor(tp.weight.detach(), mesh, [Shard(1)]))
    try:  # a DTensor on the FSDP mesh itself: no (dp, tp) mesh (TP: test_traced_compose.py)
        fully_shard_traced(tp, mesh=mesh)
    except ValueError as e:
        errors["tp"] = str(e)
    assert not isinstance(tp, TracedModule)  # refused before anything changed
    assert isinstance(traced, TracedModule)
    refused("prefetch", lambda: traced.set_modules_to_forward_prefetch([]))
    setters = {  # every other setter the traced mode replaces or lacks, by its name
        "unshard": lambda: traced.unshard(),
        "reshard": lambda: traced.reshard(),
        "set_modules_to_backward_prefetch": lambda: traced.set_modules_to_backward_prefetch([]),
        "set_reshard_after_forward": lambda: traced.set_reshard_after_forward(False),
        "set_reshard_after_backward": lambda: traced.set_reshard_after_backward(False),
        "set_is_last_backward": lambda: traced.set_is_last_backward(True),
        "set_requires_all_reduce": lambda: traced.set_requires_all_reduce(False),
    }
    for what, call in setters.items():
        refused(what, call)
    grad_dtype = fsdp2.MixedPrecisionPolicy(grad_dtype=torch.float32)
    refused(
        "grad_dtype", lambda: fully_shard_traced(nn.Linear(4, 4), mesh=mesh, mp_policy=grad_dtype)
    )
    per_param_mesh = fsdp2.ShardPlacementResult(placement=Shard(0), mesh=mesh)
    refused("placement", lambda: fully_shard_traced(
        nn.Linear(4, 4), mesh=mesh, shard_placement_fn=lambda p: per_param_mesh))  # fmt: skip
    try:
        fully_shard_traced(eager.layers[0], mesh=mesh)
    except ValueError as e:
        errors["eager twice"] = str(e)
    mixed = models.build("transformer")
    fsdp2.fully_shard(mixed.layers[0], mesh=mesh)
    try:
        fully_shard_traced(mixed, mesh=mesh)
    except ValueError as e:
        errors["eager inside"] = str(e)
    return {
        "loaded": loaded,
        "back": back,
        "want": want,
        "norms": norms,
        "dcp": dcp_pairs,
        "ac": ac_runs,
        "meta": meta,
        "errors": errors,
    }


def test_traced_state_dict(tmp_path: Any) -> None:
    res = run_on_ranks(2, _state_dict_and_errors, str(tmp_path / "dcp"))[0]
    check_same(res["loaded"], res["want"], "eager -> traced load", bitwise=True)
    check_same(res["back"], res["want"], "traced -> eager load", bitwise=True)
    torch.testing.assert_close(res["norms"][1], res["norms"][0], rtol=1e-5, atol=1e-6)
    fresh, saved, theirs, back_again = res["dcp"]
    for got, what in ((fresh, "traced"), (theirs, "torch's FSDP2"), (back_again, "traced again")):
        check_same(got, saved, f"DCP: the traced checkpoint in {what}", bitwise=True)
    check_same(res["ac"][1], res["ac"][0], "checkpointed blocks' gradients", bitwise=True)
    check_same(res["meta"][1], res["meta"][0], "meta init, traced vs eager", bitwise=True)
    errors = res["errors"]
    assert "offload_policy" in errors["offload"]
    assert "reshard_after_forward" in errors["reshard int"]
    assert "parameter weight is a DTensor" in errors["tp"], errors["tp"]
    assert "set_modules_to_forward_prefetch" in errors["prefetch"]
    for setter in ("unshard", "reshard", "set_modules_to_backward_prefetch",
                   "set_reshard_after_forward", "set_reshard_after_backward",
                   "set_is_last_backward", "set_requires_all_reduce"):  # fmt: skip
        assert setter in errors[setter], errors[setter]
    assert "grad_dtype" in errors["grad_dtype"] and "shard_placement_fn" in errors["placement"]
    assert "fsdp2.fully_shard already" in errors["eager twice"]
    assert "'layers.0'" in errors["eager inside"], errors["eager inside"]


def _inductor() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    out: dict[str, Any] = {}
    for backend in (None, "inductor"):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = models.build("mlp")
        models.shard_model(model, fully_shard_traced, world_mesh())
        run = torch.compile(model, backend=backend, fullgraph=True) if backend else model
        opt = models.make_optimizer("adamw", model.parameters())
        losses = []
        for step in range(2):
            x, y = models.make_batch("mlp", step)
            rank, ws = dist.get_rank(), dist.get_world_size()
            loss = models.local_loss(run, "mlp", models.rank_slice(x, rank, ws),
                                     models.rank_slice(y, rank, ws))  # fmt: skip
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(models.mean_over_ranks(loss)))
        out[str(backend)] = {"losses": losses, "params": models.full_params(model)}
    out["breaks"] = sum(counters["graph_break"].values())
    out["graphs"] = counters["stats"]["unique_graphs"]
    return out


def test_traced_inductor() -> None:
    res = run_on_ranks(2, _inductor)[0]
    tol = {"rtol": 1e-4, "atol": 1e-5}
    check_close_run(res["inductor"], res["None"], "inductor vs uncompiled", tol=tol, param_tol=tol)
    assert res["breaks"] == 0 and res["graphs"] == 1, res


def _checkpointed() -> dict[str, Any]:
    from torch._dynamo.utils import counters
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    rank, ws = dist.get_rank(), dist.get_world_size()
    out = {}
    for ac in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = models.build("residual")
        if ac:
            for i, block in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(block)
        models.shard_model(model, fully_shard_traced, world_mesh())
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if ac else model
        opt = models.make_optimizer("adamw", model.parameters())
        losses = []
        for step in range(2):
            x, y = models.make_batch("residual", step)
            loss = models.local_loss(run, "residual", models.rank_slice(x, rank, ws),
                                     models.rank_slice(y, rank, ws))  # fmt: skip
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(models.mean_over_ranks(loss)))
        params = {
            k.replace("_checkpoint_wrapped_module.", ""): v
            for k, v in models.full_params(model).items()
        }
        out[str(ac)] = {"losses": losses, "params": params}
        out["breaks"] = sum(counters["graph_break"].values())
    return out


def test_traced_checkpoint_compiled() -> None:
    """Blocks under ``checkpoint_wrapper``, compiled (``aot_eager``, fullgraph): bitwise the
    uncompiled run without checkpointing (a region recomputing SDPA: test_traced_models.py)."""
    res = run_on_ranks(2, _checkpointed)[0]
    check_same_run(res["True"], res["False"], "compiled checkpointed vs uncompiled")
    assert res["breaks"] == 0, res["breaks"]


def _one_rank() -> dict[str, Any]:
    recorder = _Recorder(min_cut=True)
    out = {
        "replica": _train("replica", None),
        "traced": _train("traced", None),
        "compiled": _train("traced", recorder),
    }
    out["ops"] = recorder.ops
    return out


def test_traced_one_rank() -> None:
    """One shard rank: the local shard is the whole parameter, so the graphs hold no
    collective, and the traced mode trains as the unsharded model (bitwise, uncompiled)."""
    res = run_on_ranks(1, _one_rank)[0]
    assert res["ops"] == {"fw": [], "bw": []}, res["ops"]
    check_same_run(res["compiled"], res["traced"], "compiled traced vs uncompiled traced")
    check_same_run(res["traced"], res["replica"], "traced on one rank vs the unsharded model")
    assert res["compiled"]["graphs"] == [1] * STEPS, res["compiled"]["graphs"]
