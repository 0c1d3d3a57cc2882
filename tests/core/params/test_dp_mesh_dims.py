"""``fully_shard(..., mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))`` on 4 gloo ranks.

The parameters are DTensors on the full SPMD mesh with ``Replicate()`` on the data-parallel
dims and TP placements on ``"tp"``. torch's TP styles (``parallelize_module``) only take a 1D
mesh, so the model here, ``SPMDModel`` (embedding, two pre-norm GELU MLP blocks, norm, head;
the sizes of ``tp_models``: vocabulary 34 and hidden size 10 split unevenly), computes each
layer on DTensors on whatever mesh its parameters live on: the full mesh, the TP mesh (the
"2D" way, ``fully_shard(block, mesh=mesh["dp"])``) or none (the replicated reference). Each
data-parallel rank feeds its own slice of the batch as if replicated, so data-parallel dims
never communicate in forward: FSDP averages the gradients, as usual.

Per mesh configuration (several per ``run_on_ranks`` call, to amortize the workers):

* layout: every parameter's mesh dim names, placements and local shape equal those of
  torch's ``fully_shard(dp_mesh_dims=...)``; the mesh is the full mesh (one shard dim) and
  ``full_tensor()`` equals the unsharded parameter;
* training: 2 AdamW steps (the second with the state the first made) of fsdp2 with
  ``dp_mesh_dims``, torch with ``dp_mesh_dims`` and, where the mesh allows it, fsdp2 the
  "2D" way: losses and full parameters equal the replicated reference (fp32 tolerance);
* meshes: FSDP + TP ``(dp, tp)`` and ``(tp, dp)`` (the data-parallel dim to the left of TP
  shards plainly, not strided), HSDP ``(rep, shard)``, two shard dims flattened ``(a, b)``
  (with ``reshard_after_forward=2``, which torch does not implement), replicate-only
  ``(dp, tp)``;
* errors: bad dim names, a dim named twice, plain parameters, parameters on another mesh,
  non-``Replicate`` placements on a data-parallel dim, no mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from helpers import check_close
from models import full_params, mean_over_ranks, rank_slice
from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from tp_models import VOCAB, tp_batch

import fsdp2
from fsdp2 import DataParallelMeshDims
from fsdp2._core.support.compat import TORCH_VERSION

# torch's fully_shard takes dp_mesh_dims from 2.13; on older torch fsdp2 is checked against the
# replicated reference alone.
TorchDims = getattr(torch_fsdp, "DataParallelMeshDims", None)
WORLD_SIZE = 4
STEPS = 2
DIM, HIDDEN = 8, 10


# ---------------------------------------------------------------------------------------------
# A model that runs on DTensors on any mesh


def _on_mesh(fn: Callable[..., torch.Tensor], x: torch.Tensor, *params: Any) -> torch.Tensor:
    """``fn(x, *params)``; when the parameters are DTensors, ``x`` enters replicated on their
    mesh and the result leaves as a replicated local tensor."""
    w = params[0]
    if not isinstance(w, DTensor):
        return fn(x, *params)
    mesh = w.device_mesh
    rep = [Replicate()] * mesh.ndim
    out = fn(DTensor.from_local(x, mesh, rep, run_check=False), *params)
    return out.redistribute(mesh, rep).to_local()


class _Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _on_mesh(F.linear, x, self.weight, self.bias)


class _LayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, eps = self.normalized_shape, self.eps
        return _on_mesh(
            lambda t, w, b: F.layer_norm(t, shape, w, b, eps), x, self.weight, self.bias
        )


class _Embedding(nn.Embedding):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return _on_mesh(F.embedding, tokens, self.weight)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = _LayerNorm(DIM)
        self.w1 = _Linear(DIM, HIDDEN)
        self.w2 = _Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class SPMDModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = _Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(_Block() for _ in range(2))
        self.norm = _LayerNorm(DIM)
        self.head = _Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _tp_placement(name: str) -> Placement:
    """Megatron-style: colwise w1 / head / embedding columns, rowwise w2, norms replicated."""
    if name == "tok_emb.weight":
        return Shard(1)
    if name.endswith(("w1.weight", "w1.bias", "head.weight")):
        return Shard(0)
    if name.endswith("w2.weight"):
        return Shard(1)
    return Replicate()


def _build() -> SPMDModel:
    torch.manual_seed(0)
    return SPMDModel()


def _distribute(model: nn.Module, mesh: DeviceMesh, tp_name: str | None) -> nn.Module:
    """Every parameter a DTensor on ``mesh``: its TP placement on ``tp_name``, ``Replicate()``
    on the other dims. Every rank holds the same values, so no communication."""
    names = mesh.mesh_dim_names
    assert names is not None
    for mod_name, m in model.named_modules():
        for pname, p in list(m._parameters.items()):
            if p is None:
                continue
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            placements = [_tp_placement(fqn) if n == tp_name else Replicate() for n in names]
            dt = distribute_tensor(p.detach(), mesh, placements, src_data_rank=None)
            m._parameters[pname] = nn.Parameter(dt, requires_grad=p.requires_grad)
    return model


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


# ---------------------------------------------------------------------------------------------
# Configurations

# name -> (mesh shape, dim names, tp dim, shard names, replicate names, 2D-way dp dims[, how]);
# how: "fully_shard" (default), "replicate" (``replicate(dp_mesh_dims=...)``, torch's
# ``replicate`` where it takes dp_mesh_dims) or "norms" (``fully_shard`` with the 1-D parameters
# placed ``Replicate()`` by ``shard_placement_fn``, ahead of torch: against the reference)
CONFIGS: dict[str, tuple[Any, ...]] = {
    "replicate_fn_tp": ((2, 2), ("dp", "tp"), "tp", None, "dp", None, "replicate"),
    "fsdp_tp_norms": ((2, 2), ("dp", "tp"), "tp", "dp", None, None, "norms"),
    "hsdp_norms": ((2, 2), ("rep", "shard"), None, "shard", "rep", None, "norms"),
    "hsdp_tp_norms": ((2, 1, 2), ("rep", "shard", "tp"), "tp", "shard", "rep", None, "norms"),
    "fsdp_dp_tp": ((2, 2), ("dp", "tp"), "tp", "dp", None, ("dp",)),
    "fsdp_tp_dp": ((2, 2), ("tp", "dp"), "tp", "dp", None, None),
    "hsdp": ((2, 2), ("rep", "shard"), None, "shard", "rep", ("rep", "shard")),
    "flat_shard": ((2, 2), ("a", "b"), None, ("a", "b"), None, None),
    "replicate_tp": ((2, 2), ("dp", "tp"), "tp", None, "dp", None),
    "hsdp_tp": ((2, 1, 2), ("rep", "shard", "tp"), "tp", "shard", "rep", ("rep", "shard")),
    "flat_shard_tp": ((1, 2, 2), ("a", "b", "tp"), "tp", ("a", "b"), None, None),
}


def _shard(
    model: nn.Module, fn: Callable[..., Any], mesh: DeviceMesh, dims: Any, **kw: Any
) -> nn.Module:
    for block in model.layers:
        fn(block, mesh=mesh, dp_mesh_dims=dims, **kw)
    root_kw = {"shard_placement_fn": kw["shard_placement_fn"]} if "shard_placement_fn" in kw else {}
    fn(model, mesh=mesh, dp_mesh_dims=dims, **root_kw)
    return model


def _layout(model: nn.Module) -> dict[str, tuple[Any, str, tuple[int, ...]]]:
    return {
        n: (p.device_mesh.mesh_dim_names, repr(tuple(p.placements)), tuple(p.to_local().shape))
        for n, p in model.named_parameters()
    }


def _shapes(layout: dict[str, tuple[Any, str, tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
    return {n: shape for n, (_, _, shape) in layout.items()}


_MESH_CACHE: dict[tuple[Any, ...], DeviceMesh] = {}


def _cached_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    # One mesh object per layout and task: torch's fully_shard(dp_mesh_dims=...) wants the
    # parameters' mesh to be the very object passed, and DTensor may hand back an equal mesh
    # cached from an earlier one (fsdp2 compares meshes with ==).
    key = (shape, names)
    if key not in _MESH_CACHE:
        _MESH_CACHE[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESH_CACHE[key]


def _run_config(name: str) -> dict[str, Any]:
    shape, names, tp_name, shard, rep, two_d, *extra = CONFIGS[name]
    how = extra[0] if extra else "fully_shard"
    mesh = _cached_mesh(shape, names)
    ref = _build()
    models: dict[str, nn.Module] = {}
    kw: dict[str, Any] = {"reshard_after_forward": 2} if name == "flat_shard" else {}
    ours, theirs = fsdp2.fully_shard, torch_fully_shard
    if how == "replicate":
        ours, theirs = fsdp2.replicate, torch_replicate
    elif how == "norms":
        kw["shard_placement_fn"] = lambda p: Replicate() if p.ndim == 1 else None
    if TorchDims is not None and how != "norms":
        models["torch"] = _shard(
            _distribute(_build(), mesh, tp_name),
            theirs,
            mesh,
            TorchDims(shard=shard, replicate=rep),
        )
    models["fsdp2"] = _shard(
        _distribute(_build(), mesh, tp_name),
        ours,
        mesh,
        DataParallelMeshDims(shard=shard, replicate=rep),
        **kw,
    )
    if how != "fully_shard":  # whole on every data-parallel rank; TP placements kept
        dp_dims = [i for i, n in enumerate(names) if n != tp_name]
        for pname, p in models["fsdp2"].named_parameters():
            if how == "replicate" or p.ndim == 1:
                assert all(p.placements[i] == Replicate() for i in dp_dims), (pname, p.placements)
    if two_d is not None:  # the "2D" way: TP on mesh["tp"], FSDP on the data-parallel slice
        model = _build() if tp_name is None else _distribute(_build(), mesh[tp_name], tp_name)
        dp_mesh = mesh[two_d[0]] if len(two_d) == 1 else mesh[two_d]
        for block in model.layers:
            fsdp2.fully_shard(block, mesh=dp_mesh)
        models["fsdp2_2d"] = fsdp2.fully_shard(model, mesh=dp_mesh)

    if "torch" in models:
        ours, theirs = _layout(models["fsdp2"]), _layout(models["torch"])
        if isinstance(shard, tuple) and TORCH_VERSION < (2, 13):
            # torch 2.12 keeps several shard dims unflattened (Shard(0) on each); 2.13+
            # flattens them as fsdp2 does on every torch (docs/migration.md): same local shapes
            ours, theirs = _shapes(ours), _shapes(theirs)
        assert ours == theirs, f"{name}: layouts differ:\nfsdp2 {ours}\ntorch {theirs}"
    single = isinstance(shard, str) or shard is None
    for pname, p in models["fsdp2"].named_parameters():
        assert isinstance(p, DTensor)
        if single:
            assert p.device_mesh == mesh, f"{name} {pname}: mesh {p.device_mesh}"
    ref_named = dict(ref.named_parameters())
    for engine, model in models.items():
        for pname, full in full_params(model).items():
            assert torch.equal(full, ref_named[pname].detach()), f"{name} {engine} init {pname}"

    dp_names = (shard,) if isinstance(shard, str) else (shard or ())
    dp_names += (rep,) if isinstance(rep, str) else (rep or ())
    dp_size = 1
    for n in dp_names:
        dp_size *= mesh[n].size()
    # data-parallel rank: this rank's coordinate on the data-parallel dims, in mesh order
    dp_rank = 0
    for n in names:
        if n in dp_names:
            dp_rank = dp_rank * mesh[n].size() + mesh[n].get_local_rank()

    # In forward, the unsharded parameters are the user's DTensors on the full mesh.
    seen: list[tuple[bool, tuple[Placement, ...]]] = []
    w1 = models["fsdp2"].layers[0].w1
    hook = w1.register_forward_pre_hook(
        lambda m, args: seen.append((m.weight.device_mesh == mesh, tuple(m.weight.placements)))
    )

    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opts = {
        e: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for e, m in models.items()
    }
    losses: dict[str, list[float]] = {e: [] for e in models}
    for step in range(STEPS):
        x, y = tp_batch(step)
        ref_loss = _loss(ref, x, y)
        ref_loss.backward()
        xs, ys = rank_slice(x, dp_rank, dp_size), rank_slice(y, dp_rank, dp_size)
        for engine, model in models.items():
            loss = _loss(model, xs, ys)
            loss.backward()
            avg = mean_over_ranks(loss)
            check_close(avg, ref_loss.detach(), f"{name} {engine} step {step} loss")
            losses[engine].append(avg.item())
        for pname, p in models["fsdp2"].named_parameters():
            assert p.grad.device_mesh == p.device_mesh, f"{name} {pname}: grad mesh"
            assert repr(p.grad.placements) == repr(p.placements), f"{name} {pname}: grad"
        # Clipping reads the sharded gradients: their norm is the reference's.
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        for engine, model in models.items():
            norm = fsdp2.clip_grad_norm_(model.parameters(), 1.0)
            check_close(norm, ref_norm, f"{name} {engine} step {step} grad norm")
        for opt in (ref_opt, *opts.values()):
            opt.step()
            opt.zero_grad()
        for engine, model in models.items():
            for pname, full in full_params(model).items():
                check_close(full, ref_named[pname].detach(), f"{name} {engine} step {step} {pname}")
    hook.remove()
    want = tuple(
        Replicate() if n != tp_name else _tp_placement("layers.0.w1.weight") for n in names
    )
    assert seen == [(True, want)] * STEPS, f"{name}: unsharded w1.weight {seen}"

    # A full (plain) state dict loads into a fresh dp_mesh_dims model.
    full_sd = {k: v.full_tensor() for k, v in models["fsdp2"].state_dict().items()}
    fresh = _shard(
        _distribute(_build(), mesh, tp_name),
        fsdp2.fully_shard,
        mesh,
        DataParallelMeshDims(shard=shard, replicate=rep),
    )
    fresh.load_state_dict(full_sd)
    for pname, full in full_params(fresh).items():
        assert torch.equal(full, full_sd[pname]), f"{name} load {pname}"
    return losses


def _run_configs(names: list[str]) -> dict[str, Any]:
    _MESH_CACHE.clear()  # the harness destroys the process groups between tasks
    return {n: _run_config(n) for n in names}


@pytest.mark.parametrize(
    "names",
    [
        ["fsdp_dp_tp", "fsdp_tp_dp", "replicate_tp", "replicate_fn_tp", "fsdp_tp_norms"],
        ["hsdp", "hsdp_tp", "flat_shard", "flat_shard_tp", "hsdp_norms", "hsdp_tp_norms"],
    ],
    ids=["fsdp_tp_replicate", "hsdp_flat"],
)
def test_dp_mesh_dims_layout_and_parity(names: list[str]) -> None:
    results = run_on_ranks(WORLD_SIZE, _run_configs, names)
    for name in names:
        if "torch" in results[0][name]:
            assert results[0][name]["fsdp2"] == results[0][name]["torch"], name


# ---------------------------------------------------------------------------------------------
# Errors


def test_data_parallel_mesh_dims_validation() -> None:
    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        DataParallelMeshDims()
    with pytest.raises(TypeError, match="DataParallelMeshDims.shard"):
        DataParallelMeshDims(shard=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="DataParallelMeshDims.replicate"):
        DataParallelMeshDims(shard="dp", replicate=())
    dims = DataParallelMeshDims(shard=("a", "b"), replicate="r")
    assert dims.shard_names == ("a", "b") and dims.replicate_names == ("r",)
    assert DataParallelMeshDims(replicate="r").shard_names == ()


def _expect(exc: type[Exception], match: str, fn: Callable[[], Any]) -> str:
    with pytest.raises(exc, match=match) as info:
        fn()
    return str(info.value)


def _errors() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dims = DataParallelMeshDims(shard="dp")

    def fresh() -> nn.Module:
        return _distribute(_build(), mesh, "tp")

    msg = _expect(
        ValueError,
        "'zz'",
        lambda: fsdp2.fully_shard(fresh(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims("zz")),
    )
    assert "('dp', 'tp')" in msg, msg
    _expect(
        ValueError,
        "twice",
        lambda: fsdp2.fully_shard(
            fresh(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp", replicate="dp")
        ),
    )
    unnamed = init_device_mesh("cpu", (2, 2))
    _expect(
        ValueError,
        "mesh_dim_names",
        lambda: fsdp2.fully_shard(_build(), mesh=unnamed, dp_mesh_dims=dims),
    )
    _expect(ValueError, "needs mesh=", lambda: fsdp2.fully_shard(fresh(), dp_mesh_dims=dims))
    _expect(
        TypeError,
        "DataParallelMeshDims",
        lambda: fsdp2.fully_shard(fresh(), mesh=mesh, dp_mesh_dims="dp"),  # type: ignore[arg-type]
    )
    if TorchDims is not None:  # torch's DataParallelMeshDims is accepted too
        torch_dims = fsdp2.fully_shard(fresh(), mesh=mesh, dp_mesh_dims=TorchDims(shard="dp"))
        assert torch_dims.head.weight.device_mesh == mesh
    # plain parameters (torch raises ValueError too)
    engines = (fsdp2.fully_shard, torch_fully_shard) if TorchDims else (fsdp2.fully_shard,)
    for fn in engines:
        _expect(ValueError, "plain tensor", lambda f=fn: f(_build(), mesh=mesh, dp_mesh_dims=dims))
    # a parameter on the TP mesh, not the full mesh
    on_tp = _distribute(_build(), mesh["tp"], "tp")
    _expect(
        ValueError,
        "tok_emb.weight is a DTensor on mesh",
        lambda: fsdp2.fully_shard(on_tp, mesh=mesh, dp_mesh_dims=dims),
    )
    # sharded on the data-parallel dim
    bad = fresh()
    w = bad.head.weight
    bad.head.weight = nn.Parameter(
        distribute_tensor(w.full_tensor().detach(), mesh, [Shard(0), Shard(0)])
    )
    msg = _expect(
        ValueError,
        "head.weight has placement",
        lambda: fsdp2.fully_shard(bad, mesh=mesh, dp_mesh_dims=dims),
    )
    assert "'dp'" in msg, msg


def test_dp_mesh_dims_errors() -> None:
    run_on_ranks(WORLD_SIZE, _errors)
