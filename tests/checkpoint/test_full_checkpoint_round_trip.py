"""Full checkpoints (``fsdp2.checkpoint``) saved and loaded back: round trips, another layout
at load time, parity with torch's FSDP2, torchao float8 weights. The model and the bitwise
comparisons: ``full_checkpoint_helpers``; ``tp_models.TPModel`` for FSDP + TP. Checked:

* round trip on 2 and 4 ranks (FSDP, several files): load into a meta-device model (``rope``
  built on the CPU first, optimizer built before the load) and into a materialised one: same
  parameter objects, nothing left on meta, full parameters and buffers and the logits equal
  the reference's, and one AdamW step gives a same-seed sharded twin's loss and parameters
  (bitwise) and the unsharded reference's (fp32 tolerance: the batch is split over ranks);
* another layout at load time (save and load in separate ``run_on_ranks`` calls sharing the
  directory): FSDP 2 -> 4, 4 -> 2, FSDP(4) -> HSDP(2x2), HSDP(2x2) -> FSDP(2), a
  ``shard_placement_fn`` giving ``Shard(1)`` (to ``Shard(1)`` and ``Shard(0)`` and back), FSDP(4)
  -> FSDP + TP on a (2, 2) mesh (plans ``tp`` and ``tp_sp``: ``_StridedShard`` parameters) and
  FSDP + TP -> FSDP(2); every saved checkpoint equals the reference, and every layout is also
  loaded into a meta-device model rank after rank (the others in a barrier: the load runs no
  collective);
* parity with torch's FSDP2: ``save_full_checkpoint`` of an fsdp2 model equals
  ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` of the same-seed
  ``torch.distributed.fsdp.fully_shard`` model; one checkpoint loaded into both engines'
  models (materialised or meta), 2 AdamW steps: equal losses every step, equal parameters;
* torchao float8 training weights (float8 all-gather): saved as their fp32 values, loaded
  back into the ``WeightWithDynamicFloat8CastTensor`` shards, same outputs.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from full_checkpoint_helpers import (
    INDEX,
    SMALL,
    _build,
    _check_logits,
    _check_saved,
    _check_state,
    _meta_sharded,
    _read_dir,
    _shard,
    _shard_dim,
    _state,
    _tokens,
    _want_saved,
)
from helpers import check_close, check_same, hsdp_mesh, mine, world_mesh
from models import full_value, mean_over_ranks, rank_slice, shard_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from tp_models import TPModel, make_meshes, parallelize, tp_batch, tp_loss

import fsdp2
from fsdp2 import fully_shard
from fsdp2.checkpoint import LoadResult, load_full_checkpoint, save_full_checkpoint

# name -> (world size, mesh shape, Shard dim of 2-D parameters)
LAYOUTS: dict[str, tuple[int, tuple[int, ...], int]] = {
    "fsdp2": (2, (2,), 0),
    "fsdp4": (4, (4,), 0),
    "hsdp2x2": (4, (2, 2), 0),
    "fsdp2-dim1": (2, (2,), 1),
    "fsdp4-dim1": (4, (4,), 1),
}
TP_LAYOUTS = ("tp", "tp_sp")  # FSDP + TP on a (dp, tp) = (2, 2) mesh, tp_models' plans


# ---------------------------------------------------------------------------------------------
# Helpers


def _layout_model(layout: str, seed: int, *, meta: bool = False) -> nn.Module:
    world_size, shape, dim = LAYOUTS[layout]
    assert dist.get_world_size() == world_size, f"{layout} needs {world_size} ranks"
    mesh = hsdp_mesh(shape) if len(shape) == 2 else world_mesh()
    model = _meta_sharded(seed, mesh, dim=dim) if meta else _shard(_build(seed), mesh, dim=dim)
    for name, p in model.named_parameters():
        want = Shard(_shard_dim(p, dim))
        assert p.placements[-1] == want, f"{layout}: {name} is on {p.placements}, want {want}"
    return model


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> torch.Tensor:
    """One step on this rank's slice of the global batch (every rank is a data shard);
    returns the rank-averaged loss."""
    x, y = _tokens(step)
    loss = model(mine(x), mine(y))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return mean_over_ranks(loss)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _same_objects(before: list[torch.Tensor], model: nn.Module, what: str) -> None:
    after = list(model.parameters())
    assert len(after) == len(before) and all(p is q for p, q in zip(before, after, strict=True)), (
        f"{what}: loading replaced parameter objects"
    )


# ---------------------------------------------------------------------------------------------
# Round trip


def _round_trip(root: str) -> None:
    ref = _build(0)
    src = _shard(_build(0))
    written = save_full_checkpoint(src, root, max_shard_size=SMALL)
    assert written[-1] == os.path.join(root, INDEX) and len(written) > 2, written
    _check_saved(root, _want_saved(ref), "round trip")
    want = _state(ref)
    for target in ("meta", "materialised"):
        model = _meta_sharded(1) if target == "meta" else _shard(_build(1))
        before = list(model.parameters())
        opt = _adamw(model)  # built before loading, as a training script does
        result = load_full_checkpoint(model, root)
        assert result == LoadResult([], []), f"{target}: {result}"
        assert isinstance(result, LoadResult)
        _same_objects(before, model, target)
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            assert not t.is_meta, f"{target}: {name} is still on the meta device"
        _check_state(model, want, f"{target} loaded")
        _check_logits(model, ref, target)
        # Training continues: the loaded model, a same-seed sharded twin and the reference.
        twin, ref_copy = _shard(_build(0)), copy.deepcopy(ref)
        got = _train_step(model, opt, 0)
        twin_loss = _train_step(twin, _adamw(twin), 0)
        x, y = _tokens(0)
        ref_opt = _adamw(ref_copy)
        ref_loss = ref_copy(x, y)
        ref_loss.backward()
        ref_opt.step()
        assert torch.equal(got, twin_loss), f"{target}: loss {got} after load, twin {twin_loss}"
        check_close(got, ref_loss.detach(), f"{target}: loss vs the unsharded reference")
        check_same(_state(model), _state(twin), f"{target} trained vs twin", bitwise=True)
        trained = _state(ref_copy)
        for name, t in _state(model).items():
            check_close(t, trained[name], f"{target} trained vs reference: {name}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_round_trip(world_size: int, tmp_path) -> None:
    run_on_ranks(world_size, _round_trip, str(tmp_path))


# ---------------------------------------------------------------------------------------------
# Another layout at load time


def _tp_model(layout: str, seed: int, *, meta: bool = False) -> nn.Module:
    """``tp_models.TPModel`` under ``seed``: FSDP + TP (``tp`` / ``tp_sp`` plan on a (2, 2)
    mesh) or plain FSDP at ``layout``; all of it on the meta device with ``meta``."""
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model = TPModel()
    if layout in TP_LAYOUTS:
        _, dp_mesh, tp_mesh = make_meshes("fsdp2x2")
        return shard_model(parallelize(model, tp_mesh, layout), fsdp2.fully_shard, dp_mesh)
    world_size, shape, dim = LAYOUTS[layout]
    assert dist.get_world_size() == world_size and len(shape) == 1, layout
    return _shard(model, dim=dim)


def _load_in_turn(model: nn.Module, root: str) -> LoadResult:
    """Rank after rank, the others waiting in a barrier: a collective inside
    ``load_full_checkpoint`` would hang or fail."""
    result = None
    for r in range(dist.get_world_size()):
        if r == dist.get_rank():
            result = load_full_checkpoint(model, root)
        dist.barrier()
    assert result is not None
    return result


def _is_strided(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and any(isinstance(q, _StridedShard) for q in p.placements)


def _tp_reference(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TPModel()


def _save_at(root: str, kind: str, layout: str) -> None:
    if kind == "llama":
        model, ref = _layout_model(layout, 0), _build(0)
    else:
        model, ref = _tp_model(layout, 0), _tp_reference(0)
    save_full_checkpoint(model, root, max_shard_size=SMALL)
    if dist.get_rank() == 0:
        _check_saved(root, _want_saved(ref), f"saved at {layout}")


def _load_at(root: str, kind: str, layouts: tuple[str, ...]) -> None:
    """Into a materialised model (all ranks at once) and a meta one (rank after rank)."""
    for layout in layouts:
        ref = _build(0) if kind == "llama" else _tp_reference(0)
        for meta in (False, True):
            what = f"loaded at {layout}{' (meta, rank after rank)' if meta else ''}"
            if kind == "llama":
                model = _layout_model(layout, 1, meta=meta)
            else:
                model = _tp_model(layout, 1, meta=meta)
                if layout in TP_LAYOUTS:  # the layout that is not a box of the full tensor
                    strided = [n for n, p in model.named_parameters() if _is_strided(p)]
                    assert "layers.0.attn.wq.weight" in strided, f"{what}: strided {strided}"
            load = _load_in_turn if meta else load_full_checkpoint
            assert load(model, root) == LoadResult([], []), what
            _check_state(model, _state(ref), what)
            if kind == "llama":
                _check_logits(model, ref, what)
                continue
            # The loaded model computes like the reference (fp32 tolerance: TP sums differ).
            tp = 2 if layout in TP_LAYOUTS else 1  # TP is the innermost mesh dim
            rank, size = dist.get_rank() // tp, dist.get_world_size() // tp
            x, y = tp_batch(0)
            loss = tp_loss(model, rank_slice(x, rank, size), rank_slice(y, rank, size))
            check_close(mean_over_ranks(loss), tp_loss(ref, x, y).detach(), f"{what}: loss")


@pytest.mark.parametrize(
    "kind, save_layout, load_layouts",
    [
        ("llama", "fsdp2", ("fsdp4",)),
        ("llama", "fsdp4", ("fsdp2",)),
        ("llama", "fsdp4", ("hsdp2x2",)),
        ("llama", "hsdp2x2", ("fsdp2",)),
        ("llama", "fsdp2-dim1", ("fsdp4-dim1", "fsdp4")),
        ("llama", "fsdp4", ("fsdp2-dim1",)),
        ("tp", "fsdp4", TP_LAYOUTS),
        ("tp", "tp", ("fsdp2",)),
        ("tp", "tp_sp", ("fsdp2",)),
    ],
    ids=lambda v: "+".join(v) if isinstance(v, tuple) else v,
)
def test_load_at_another_layout(
    kind: str, save_layout: str, load_layouts: tuple[str, ...], tmp_path
) -> None:
    def world(layout: str) -> int:
        return 4 if layout in TP_LAYOUTS else LAYOUTS[layout][0]

    root = str(tmp_path)
    run_on_ranks(world(save_layout), _save_at, root, kind, save_layout)
    sizes = {world(layout) for layout in load_layouts}
    assert len(sizes) == 1, load_layouts
    run_on_ranks(sizes.pop(), _load_at, root, kind, load_layouts)


# ---------------------------------------------------------------------------------------------
# Parity with torch's FSDP2


def _torch_parity(root: str, meta: bool) -> None:
    rank = dist.get_rank()
    ref = _build(0)
    # Our save of an fsdp2 model == torch's full state dict of the same-seed torch model.
    save_full_checkpoint(_shard(_build(0)), root, max_shard_size=SMALL)
    theirs = _shard(_build(0), engine="torch")
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(theirs, options=options)
    if rank == 0:
        ours = _read_dir(root)
        assert list(full) == list(ref.state_dict()), f"torch's keys {list(full)}"
        check_same(
            ours, dict(full), "save_full_checkpoint vs torch's full state dict", bitwise=True
        )
    # One checkpoint into both engines, then training side by side.
    models = {}
    for engine in ("fsdp2", "torch"):
        if meta:
            model = _shard(_build(1, meta=True), engine=engine)
            model.rope = model._rope(torch.device("cpu"))
        else:
            model = _shard(_build(1), engine=engine)
        before = list(model.parameters())
        result = load_full_checkpoint(model, root)
        assert result == LoadResult([], []), f"{engine}: {result}"
        _same_objects(before, model, engine)
        _check_state(model, _state(ref), f"{engine} loaded")
        models[engine] = model
    opts = {engine: _adamw(model) for engine, model in models.items()}
    for step in range(2):
        losses = {engine: _train_step(m, opts[engine], step) for engine, m in models.items()}
        assert torch.equal(losses["fsdp2"], losses["torch"]), f"step {step}: losses {losses}"
    check_same(
        _state(models["fsdp2"]), _state(models["torch"]), "trained fsdp2 vs torch", bitwise=True
    )


@pytest.mark.parametrize("meta", [False, True], ids=["materialised", "meta"])
def test_torch_fsdp2_parity(meta: bool, tmp_path) -> None:
    run_on_ranks(2, _torch_parity, str(tmp_path), meta)


# ---------------------------------------------------------------------------------------------
# torchao float8 weights


def _float8_round_trip(root: str) -> None:
    """torchao float8 training weights (``WeightWithDynamicFloat8CastTensor`` local shards,
    float8 all-gather): saved as their high-precision values, loaded back into the subclass
    (through a temporary: the subclass is never read into directly)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False))
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config)
        for layer in model:
            fully_shard(layer, mesh=world_mesh())
        fully_shard(model, mesh=world_mesh())
        return model

    source, target = build(0), build(1)
    local = source[0].weight.to_local()
    assert isinstance(local, WeightWithDynamicFloat8CastTensor), type(local)
    save_full_checkpoint(source, root)
    dist.barrier()
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        saved = load_file(os.path.join(root, "model.safetensors"))
        assert sorted(saved) == ["0.weight", "1.weight"], sorted(saved)
        assert all(t.dtype == torch.float32 for t in saved.values())
    load_full_checkpoint(target, root)
    for (name, a), (_, b) in zip(source.named_parameters(), target.named_parameters(), strict=True):
        assert isinstance(b.to_local(), WeightWithDynamicFloat8CastTensor), name
        assert torch.equal(full_value(a), full_value(b)), name
    x = torch.randn(4, 32)
    assert torch.equal(source(x), target(x))


def test_float8_weights_round_trip(tmp_path) -> None:
    run_on_ranks(2, _float8_round_trip, str(tmp_path))
