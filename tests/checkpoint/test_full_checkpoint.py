"""Full checkpoints (``fsdp2.checkpoint``): ``save_full_checkpoint`` / ``load_full_checkpoint``.

Values are compared bitwise (``torch.equal`` of ``full_tensor()``, same dtype) with an
unsharded reference built under the same seed. The model is a tiny ``fsdp2.models.llama.Llama``
(vocabulary 61: uneven shards; non-persistent ``rope`` buffer) plus persistent buffers
(int64, 0-dim int64, empty, fp32) and a (3, 2) parameter that leaves empty shards on 4 ranks;
``tp_models.TPModel`` for FSDP + TP. Checked:

* ranks that would write different checkpoints (another width on rank 1; another
  ``max_shard_size``): ``ValueError`` on every rank naming the difference, nothing written;
* torchao float8 training weights (float8 all-gather): saved as their fp32 values, loaded
  back into the ``WeightWithDynamicFloat8CastTensor`` shards, same outputs;
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
* the files, read with ``safetensors`` itself: the index's ``weight_map`` and
  ``metadata.total_size``, ``model-0000i-of-0000n`` names, ``__metadata__ = {"format": "pt"}``,
  save_pretrained's cut (state-dict order, a new file only when the next tensor does not fit,
  within ``max_shard_size`` unless one tensor is bigger), file ``i`` written by rank
  ``i % writers`` (``writers=1``: rank 0 only), the same returned paths on every rank, the
  index file itself as a load path; one ``model.safetensors`` and no index when it fits; a
  ``.safetensors`` file target; ``dtype=torch.bfloat16`` (floats bf16, ints untouched; loads
  into fp32 as ``ref.to(bf16).to(fp32)``); a bf16 model (loads rounded, saves bf16); mixed
  precision (fp32 sharded parameters saved, also while bf16 unsharded ones are registered);
  ``reshard_after_forward=False`` after a training forward (load: the next forward uses the
  loaded values; save: the sharded values); CPU offload (save, load, meta load); a model not
  sharded at all, with ``pathlib`` paths; activation-checkpoint and ``torch.compile``
  wrappers (names without ``_checkpoint_wrapped_module`` / ``_orig_mod``);
* other inputs: ``safetensors.torch.save_file`` and ``torch.save`` of a state dict, directories
  with ``pytorch_model.bin`` and with ``pytorch_model.bin.index.json``; persistent buffers
  (saved, plain, loaded; the non-persistent one not saved); tied embeddings (saved once under
  the first name; a checkpoint with only the other name, or with both, loads; the tie stays);
  ``key_map`` as a dict (names it lacks kept) and as a callable, ``None`` dropping a tensor,
  on load and on save; an unexpected tensor is reported under its checkpoint name;
* parity with torch's FSDP2: ``save_full_checkpoint`` of an fsdp2 model equals
  ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` of the same-seed
  ``torch.distributed.fsdp.fully_shard`` model; one checkpoint loaded into both engines'
  models (materialised or meta), 2 AdamW steps: equal losses every step, equal parameters;
* load errors, each naming what is wrong, and the parameters unchanged after each (a meta
  model stays on meta): missing path, directory without weights, index listing a missing
  file (``FileNotFoundError``); corrupt index, index listing a tensor its file lacks, garbage
  or truncated ``.safetensors``, garbage ``torch.save`` file, a ``torch.save`` of a nested dict
  or a list (``ValueError`` naming the file); missing / unexpected keys (``RuntimeError``
  under ``strict``; ``strict=False`` returns them and loads the rest); a shape mismatch
  (``RuntimeError`` naming the key and both shapes, also with ``strict=False``); a
  ``key_map`` collision, a meta model whose checkpoint lacks a key or whose ``rope`` is meta
  (``ValueError``);
* save errors: bad ``max_shard_size`` / ``dtype`` / ``writers``, a path that is a file, a
  meta model, a ``key_map`` collision raise before any collective (only rank 0 calls); a
  failure on rank 1 only (``StreamWriter`` construction, write, commit, publish) raises
  ``RuntimeError`` naming rank 1 on every rank without hanging, leaves no index (an older
  checkpoint's is removed, so it is not mistaken for complete; a fresh directory stays
  empty); a tensor with no plain values (``TwoTensor``) fails alike on every rank with
  ``TypeError`` naming it and no ``.partial`` left; saving over a checkpoint with more files,
  or several files over one, removes the stale ones and keeps other files.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pathlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from helpers import check_close, check_same, expect_raises, hsdp_mesh, mine, world_mesh
from models import full_value, mean_over_ranks, rank_slice, shard_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from tp_models import TPModel, make_meshes, parallelize, tp_batch, tp_loss

import fsdp2
import fsdp2.checkpoint._files
from fsdp2 import fully_shard
from fsdp2.checkpoint import LoadResult, load_full_checkpoint, save_full_checkpoint
from fsdp2.models.llama import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, ffn_multiple_of=16, max_seq_len=16)
TIED = dataclasses.replace(CFG, tie_embeddings=True)
BATCH, SEQ = 4, 8
SMALL = 8192  # bytes: a few tensors per file, so a save writes several files
INDEX = "model.safetensors.index.json"
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
# Models and values


def _build(seed: int = 0, *, tied: bool = False, meta: bool = False) -> Llama:
    """The Llama under ``seed``, plus persistent buffers ``counts`` (int64), ``step`` (0-dim
    int64), ``empty`` (0 elements) and ``norm.scale`` (fp32) and a small parameter ``tiny``
    (3, 2). On the meta device, ``rope`` is meta too."""
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model = Llama(TIED if tied else CFG)
        model.register_buffer("counts", torch.arange(7) * 3 + seed)
        model.register_buffer("step", torch.tensor(5 + seed))  # 0-dim
        model.register_buffer("empty", torch.zeros(0, 3))
        model.norm.register_buffer("scale", torch.linspace(0.5, 1.5, 5) + seed)
        # Unused in forward; 3 rows or 2 columns: empty shards on 4 ranks.
        model.tiny = nn.Parameter(torch.randn(3, 2))
    return model


def _shard_dim(p: torch.Tensor, dim: int) -> int:
    """``dim`` for 2-D parameters it divides evenly (fully_shard's rule), else 0."""
    return dim if p.dim() == 2 and p.shape[dim] % dist.get_world_size() == 0 else 0


def _shard(
    model: nn.Module, mesh: Any = None, engine: str = "fsdp2", dim: int = 0, **kw: Any
) -> nn.Module:
    """Every block, then the root; 2-D parameters on ``Shard(dim)`` where even."""
    fn = fsdp2.fully_shard if engine == "fsdp2" else torch_fully_shard
    if dim:
        kw["shard_placement_fn"] = lambda p: Shard(_shard_dim(p, dim))
    return shard_model(model, fn, world_mesh() if mesh is None else mesh, **kw)


def _meta_sharded(seed: int, mesh: Any = None, **kw: Any) -> nn.Module:
    """Built and sharded on the meta device, then ``rope`` built on the CPU (it is in no
    checkpoint): what a user does before ``load_full_checkpoint``."""
    model = _shard(_build(seed, meta=True), mesh, **kw)
    model.rope = model._rope(torch.device("cpu"))
    return model


def _layout_model(layout: str, seed: int, *, meta: bool = False) -> nn.Module:
    world_size, shape, dim = LAYOUTS[layout]
    assert dist.get_world_size() == world_size, f"{layout} needs {world_size} ranks"
    mesh = hsdp_mesh(shape) if len(shape) == 2 else world_mesh()
    model = _meta_sharded(seed, mesh, dim=dim) if meta else _shard(_build(seed), mesh, dim=dim)
    for name, p in model.named_parameters():
        want = Shard(_shard_dim(p, dim))
        assert p.placements[-1] == want, f"{layout}: {name} is on {p.placements}, want {want}"
    return model


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters and buffers (non-persistent ones too) by name. Collective."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    return {n: full_value(t) for n, t in named}


def _check_state(model: nn.Module, want: dict[str, torch.Tensor], what: str) -> None:
    check_same(_state(model), want, what, bitwise=True)


def _tokens(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _check_logits(model: nn.Module, ref: nn.Module, what: str) -> None:
    x, _ = _tokens()
    with torch.no_grad():
        got, want = model(x), ref(x)
    assert torch.equal(got, want), (
        f"{what}: logits differ (max abs diff {(got - want).abs().max().item():.3g})"
    )


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


def _read_dir(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a saved checkpoint (a directory or a ``.safetensors`` file), read with
    ``safetensors`` itself."""
    if path.endswith(".safetensors"):
        return load_file(path)
    index = os.path.join(path, INDEX)
    if not os.path.exists(index):
        return load_file(os.path.join(path, "model.safetensors"))
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        tensors = load_file(os.path.join(path, file))
        assert sorted(tensors) == sorted(k for k, v in weight_map.items() if v == file), (
            f"{file}: holds {sorted(tensors)}, the index says otherwise"
        )
        out.update(tensors)
    return out


def _check_saved(path: str, want: dict[str, torch.Tensor], what: str) -> None:
    """The checkpoint at ``path`` holds exactly ``want`` (bitwise, same dtypes)."""
    got = _read_dir(path)
    assert sorted(got) == sorted(want), f"{what}: saved {sorted(got)}, want {sorted(want)}"
    check_same({k: got[k] for k in want}, want, f"{what} saved", bitwise=True)


def _want_saved(ref: nn.Module) -> dict[str, torch.Tensor]:
    """What a full checkpoint of ``ref`` holds: its state dict, a tied tensor once."""
    seen: set[int] = set()
    out = {}
    for name, t in ref.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t.detach().clone()
    return out


def _write_on_rank0(write: Any) -> None:
    """``write()`` on rank 0 (files every rank then reads), then a barrier."""
    if dist.get_rank() == 0:
        write()
    dist.barrier()


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


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
# The files


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_index(root: str, want: dict[str, torch.Tensor], limit: int, what: str) -> list[str]:
    """The index and the files it lists, read with ``safetensors``; returns the file names."""
    with open(os.path.join(root, INDEX)) as f:
        index = json.load(f)
    weight_map = index["weight_map"]
    assert sorted(weight_map) == sorted(want), f"{what}: weight_map keys {sorted(weight_map)}"
    files = sorted(set(weight_map.values()))
    n = len(files)
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)], files
    total = sum(_nbytes(t) for t in want.values())
    assert index["metadata"]["total_size"] == total, f"{what}: {index['metadata']}, want {total}"
    sizes, members = [], []
    for file in files:
        with safe_open(os.path.join(root, file), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}, f"{what} {file}: metadata {f.metadata()}"
            names = sorted(f.keys(), key=list(want).index)
            assert set(names) == {k for k, v in weight_map.items() if v == file}, file
            sizes.append(sum(_nbytes(f.get_tensor(k)) for k in names))
            members.append(names)
        assert sizes[-1] <= limit or len(names) == 1, f"{what} {file}: {sizes[-1]} bytes {names}"
    # save_pretrained's rule: tensors in state-dict order, a new file only when the next
    # tensor would not fit.
    assert [k for names in members for k in names] == list(want), f"{what}: order {members}"
    for i in range(n - 1):
        nxt = _nbytes(want[members[i + 1][0]])
        assert sizes[i] + nxt > limit, f"{what}: {members[i + 1][0]} fits in {files[i]}"
    return files


def _record_writers() -> tuple[list[str], Any]:
    """Patch ``StreamWriter.__init__`` to record the files this rank writes; returns the list
    and the original (restore it!)."""
    seen: list[str] = []
    original = fsdp2.checkpoint._files.StreamWriter.__init__

    def init(self: Any, path: str, specs: Any) -> None:
        seen.append(os.path.basename(path))
        original(self, path, specs)

    fsdp2.checkpoint._files.StreamWriter.__init__ = init
    return seen, original


def _files_case(root: str, case: str) -> Any:
    rank = dist.get_rank()
    ref = _build(0)
    want = _want_saved(ref)
    if case in ("index", "writers=1"):
        seen, original = _record_writers()
        try:
            kw = {"writers": 1} if case == "writers=1" else {}
            written = save_full_checkpoint(_shard(_build(0)), root, max_shard_size="8KiB", **kw)
        finally:
            fsdp2.checkpoint._files.StreamWriter.__init__ = original
        if rank == 0:
            files = _check_index(root, want, SMALL, case)
            assert written == [os.path.join(root, f) for f in files] + [os.path.join(root, INDEX)]
            assert not [e for e in os.listdir(root) if e.endswith(".partial")], os.listdir(root)
        _check_saved(root, want, case)
        model = _shard(_build(1))  # the index itself as the path
        assert load_full_checkpoint(model, os.path.join(root, INDEX)) == LoadResult([], [])
        _check_state(model, _state(ref), f"{case}: loaded from the index file")
        return {"written": written, "wrote": seen}
    if case == "single file":
        written = save_full_checkpoint(_shard(_build(0)), root)
        assert written == [os.path.join(root, "model.safetensors")], written
        assert sorted(os.listdir(root)) == ["model.safetensors"], os.listdir(root)
        with safe_open(written[0], framework="pt") as f:
            assert f.metadata() == {"format": "pt"}, f.metadata()
        _check_saved(root, want, case)
    elif case == "file target":
        path = os.path.join(root, "sub", "weights.safetensors")
        written = save_full_checkpoint(_shard(_build(0)), path, max_shard_size=SMALL)
        assert written == [path], written
        assert sorted(os.listdir(os.path.dirname(path))) == ["weights.safetensors"]
        _check_saved(path, want, case)
        model = _shard(_build(1))
        load_full_checkpoint(model, path)
        _check_state(model, _state(ref), f"{case} loaded")
    elif case == "bf16":
        save_full_checkpoint(_shard(_build(0)), root, dtype=torch.bfloat16, max_shard_size=SMALL)
        rounded = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in want.items()}
        assert rounded["counts"].dtype == torch.int64
        _check_saved(root, rounded, case)
        expected = {
            k: v.to(torch.float32) if v.is_floating_point() else v
            for k, v in _state(copy.deepcopy(ref).to(torch.bfloat16)).items()
        }
        expected["rope"] = ref.rope  # non-persistent: not in the checkpoint, not rounded
        for meta in (False, True):
            model = _meta_sharded(1) if meta else _shard(_build(1))
            load_full_checkpoint(model, root)
            _check_state(model, expected, f"{case}{' meta' if meta else ''} loaded into fp32")
    elif case == "mixed precision":
        mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = _shard(_build(0), mp_policy=mp)
        x, y = _tokens()
        model(mine(x), mine(y)).backward()  # no step: the fp32 values stay the reference's
        save_full_checkpoint(model, root, max_shard_size=SMALL)
        _check_saved(root, want, case)
        # bf16 unsharded parameters registered (kept after a training forward) at save time.
        kept = _shard(_build(0), mp_policy=mp, reshard_after_forward=False)
        kept(mine(x), mine(y))
        assert any(p.dtype == torch.bfloat16 for p in kept.parameters()), "no bf16 registered"
        save_full_checkpoint(kept, os.path.join(root, "kept"), max_shard_size=SMALL)
        _check_saved(os.path.join(root, "kept"), want, f"{case}, bf16 parameters registered")
        other = _shard(_build(1), mp_policy=mp)
        load_full_checkpoint(other, root)
        for name, p in other.named_parameters():
            assert p.dtype == torch.float32, f"{case}: {name} loaded as {p.dtype}"
        _check_state(other, _state(ref), f"{case} loaded")
    elif case == "bf16 model":  # parameters themselves bf16: fp32 checkpoint rounded on load
        save_full_checkpoint(_shard(_build(0)), root, max_shard_size=SMALL)
        model = _shard(_build(1).to(torch.bfloat16))
        load_full_checkpoint(model, root)
        rounded = copy.deepcopy(ref).to(torch.bfloat16)
        _check_state(model, _state(rounded), f"{case} loaded")
        out = os.path.join(root, "bf16")
        save_full_checkpoint(model, out, max_shard_size=SMALL)
        _check_saved(out, _want_saved(rounded), f"{case} saved")
    elif case == "unsharded model":  # and pathlib paths
        out = pathlib.Path(root) / "plain"
        written = save_full_checkpoint(_build(0), out, max_shard_size=SMALL)
        assert written[-1] == os.path.join(root, "plain", INDEX), written
        _check_saved(str(out), want, case)
        for meta in (False, True):
            model = _build(1, meta=meta)
            if meta:
                model.rope = model._rope(torch.device("cpu"))
            assert load_full_checkpoint(model, out) == LoadResult([], [])
            _check_state(model, _state(ref), f"{case}{' (meta)' if meta else ''} loaded")
            _check_logits(model, ref, case)
    elif case == "reshard_after_forward=False":
        save_full_checkpoint(_shard(_build(0)), root)
        model = _shard(_build(1), reshard_after_forward=False)
        x, _ = _tokens()
        model(x)  # a training forward: the unsharded parameters stay registered
        assert not all(isinstance(p, DTensor) for p in model.parameters()), "nothing unsharded"
        load_full_checkpoint(model, root)
        _check_logits(model, ref, f"{case}: after load")  # not the kept seed-1 values
        _check_state(model, _state(ref), f"{case} loaded")
        model(x)
        assert not all(isinstance(p, DTensor) for p in model.parameters()), "nothing unsharded"
        save_full_checkpoint(model, os.path.join(root, "again"))
        _check_saved(os.path.join(root, "again"), want, f"{case} saved after forward")
    elif case == "cpu offload":
        policy = fsdp2.CPUOffloadPolicy(pin_memory=False)
        save_full_checkpoint(_shard(_build(0), offload_policy=policy), root, max_shard_size=SMALL)
        _check_saved(root, want, case)
        for meta in (False, True):
            what = f"{case}{' meta' if meta else ''}"
            model = (_meta_sharded if meta else lambda s, **kw: _shard(_build(s), **kw))(
                1, offload_policy=policy
            )
            load_full_checkpoint(model, root)
            for name, p in model.named_parameters():
                assert p.to_local().device.type == "cpu", f"{what}: {name} on {p.device}"
            _check_state(model, _state(ref), f"{what} loaded")
            _check_logits(model, ref, what)
    elif case == "wrapper names":  # activation checkpointing, torch.compile's wrapper
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        def wrapped(seed: int) -> nn.Module:
            model = _build(seed)
            for i, block in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(block)
            return torch.compile(_shard(model))  # never called: nothing compiles

        def plain_names(model: nn.Module) -> dict[str, torch.Tensor]:
            return {
                n.replace("._checkpoint_wrapped_module", "").removeprefix("_orig_mod."): t
                for n, t in _state(model).items()
            }

        model = wrapped(0)
        names = [n for n, _ in model.named_parameters()]
        assert any("_checkpoint_wrapped_module" in n for n in names), names
        assert all(n.startswith("_orig_mod.") for n in names), names
        save_full_checkpoint(model, root, max_shard_size=SMALL)
        _check_saved(root, want, case)
        other = wrapped(1)
        assert load_full_checkpoint(other, root) == LoadResult([], [])
        check_same(plain_names(other), _state(ref), f"{case} loaded", bitwise=True)
    else:
        raise AssertionError(case)
    return None


FILE_CASES = [
    "index",
    "writers=1",
    "single file",
    "file target",
    "bf16",
    "mixed precision",
    "bf16 model",
    "unsharded model",
    "reshard_after_forward=False",
    "cpu offload",
    "wrapper names",
]


@pytest.mark.parametrize("case", FILE_CASES)
def test_saved_files(case: str, tmp_path) -> None:
    results = run_on_ranks(2, _files_case, str(tmp_path), case)
    if case in ("index", "writers=1"):
        written = [r["written"] for r in results]
        assert written[0] == written[1], f"{case}: ranks returned different paths {written}"
        files = [os.path.basename(f) for f in written[0][:-1]]
        wrote = [r["wrote"] for r in results]
        if case == "index":  # file i by rank i % 2
            assert wrote == [files[0::2], files[1::2]], f"{case}: files by rank {wrote}"
        else:
            assert wrote == [files, []], f"{case}: files by rank {wrote}"


# ---------------------------------------------------------------------------------------------
# Other inputs: files written by others, tied weights, key_map


def _load_checks(path: str, want: dict[str, torch.Tensor], what: str, **kw: Any) -> None:
    """Load ``path`` into a materialised and a meta-device sharded model (seed 1)."""
    for meta in (False, True):
        model = _meta_sharded(1) if meta else _shard(_build(1))
        result = load_full_checkpoint(model, path, **kw)
        assert result == LoadResult([], []), f"{what}: {result}"
        _check_state(model, want, f"{what}{' (meta)' if meta else ''}")


def _input_case(root: str, case: str) -> None:
    ref = _build(0)
    want = _state(ref)
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    if case == "safetensors file":
        path = os.path.join(root, "plain.safetensors")
        _write_on_rank0(lambda: save_file(sd, path))
        _load_checks(path, want, case)
    elif case == "torch.save file":
        path = os.path.join(root, "state.pt")
        _write_on_rank0(lambda: torch.save(sd, path))
        _load_checks(path, want, case)
    elif case == "pytorch_model.bin":
        _write_on_rank0(lambda: torch.save(sd, os.path.join(root, "pytorch_model.bin")))
        _load_checks(root, want, case)
    elif case == "pytorch_model.bin.index.json":
        names = list(sd)
        parts = {"pytorch_model-00001-of-00002.bin": names[:5]}
        parts["pytorch_model-00002-of-00002.bin"] = names[5:]

        def write() -> None:
            for file, keys in parts.items():
                torch.save({k: sd[k] for k in keys}, os.path.join(root, file))
            weight_map = {k: file for file, keys in parts.items() for k in keys}
            with open(os.path.join(root, "pytorch_model.bin.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f)

        _write_on_rank0(write)
        _load_checks(root, want, case)
    elif case == "persistent buffers":
        src = _shard(_build(0))
        for name, buf in src.named_buffers():
            assert not isinstance(buf, DTensor), name
        save_full_checkpoint(src, root)
        saved = _read_dir(root)
        for name in ("counts", "step", "empty", "norm.scale"):
            assert torch.equal(saved[name], ref.get_buffer(name)), f"{case}: saved {name}"
        assert "rope" not in saved, "a non-persistent buffer was saved"
        _load_checks(root, want, case)
    elif case == "tied":
        tied_ref = _build(0, tied=True)
        tied_want = _state(tied_ref)

        def tied_model(seed: int) -> nn.Module:
            model = _shard(_build(seed, tied=True))
            assert model.output.weight is model.tok_embeddings.weight
            return model

        save_full_checkpoint(tied_model(0), os.path.join(root, "ours"))
        saved = _read_dir(os.path.join(root, "ours"))
        assert "tok_embeddings.weight" in saved and "output.weight" not in saved, sorted(saved)
        check_same(saved, _want_saved(tied_ref), f"{case} saved", bitwise=True)
        # Only the other name (renamed on save), and both names (a torch.save state dict).
        save_full_checkpoint(
            tied_model(0),
            os.path.join(root, "other"),
            key_map={"tok_embeddings.weight": "output.weight"},
        )
        saved = _read_dir(os.path.join(root, "other"))
        assert "output.weight" in saved and "tok_embeddings.weight" not in saved, sorted(saved)
        both = os.path.join(root, "both.pt")
        _write_on_rank0(lambda: torch.save(tied_ref.state_dict(), both))
        for source in ("ours", "other", "both.pt"):
            for meta in (False, True):
                what = f"{case} from {source}{' (meta)' if meta else ''}"
                if meta:
                    model = _shard(_build(1, tied=True, meta=True))
                    model.rope = model._rope(torch.device("cpu"))
                else:
                    model = tied_model(1)
                result = load_full_checkpoint(model, os.path.join(root, source))
                assert result == LoadResult([], []), f"{what}: {result}"
                assert model.output.weight is model.tok_embeddings.weight, f"{what}: untied"
                _check_state(model, tied_want, what)
    elif case == "key_map":
        hf = {f"model.{k}": v for k, v in sd.items() if k != "output.weight"}
        hf["lm_head.weight"] = sd["output.weight"]
        hf["model.rotary_emb.inv_freq"] = torch.ones(4)  # an old checkpoint's extra
        path = os.path.join(root, "hf.safetensors")
        _write_on_rank0(lambda: save_file(hf, path))

        def from_hf(name: str) -> str | None:
            if name.endswith("inv_freq"):
                return None
            return "output.weight" if name == "lm_head.weight" else name.removeprefix("model.")

        _load_checks(path, want, f"{case} callable", key_map=from_hf)
        as_dict: dict[str, str | None] = {k: k.removeprefix("model.") for k in hf}
        as_dict.update({"lm_head.weight": "output.weight", "model.rotary_emb.inv_freq": None})
        _load_checks(path, want, f"{case} dict", key_map=as_dict)
        # A partial dict: names it lacks stay as they are, so they are unexpected.
        model = _shard(_build(1))
        partial = {"lm_head.weight": "output.weight", "model.rotary_emb.inv_freq": None}
        result = load_full_checkpoint(model, path, key_map=partial, strict=False)
        assert "model.norm.weight" in result.unexpected_keys, result
        assert "lm_head.weight" not in result.unexpected_keys, result
        assert "output.weight" not in result.missing_keys, result
        assert "model.rotary_emb.inv_freq" not in result.unexpected_keys, result

        # An unexpected tensor is reported under its name in the checkpoint.
        def keep_inv_freq(name: str) -> str:
            return "output.weight" if name == "lm_head.weight" else name.removeprefix("model.")

        model = _shard(_build(1))
        with expect_raises(f"{case}: strict", RuntimeError, match=r'"model\.rotary_emb\.inv_freq"'):
            load_full_checkpoint(model, path, key_map=keep_inv_freq)
        result = load_full_checkpoint(model, path, key_map=keep_inv_freq, strict=False)
        assert result == LoadResult([], ["model.rotary_emb.inv_freq"]), f"{case}: {result}"
        _check_state(model, want, f"{case}: strict=False with an unexpected tensor")
        # On save: a dict, a callable, None dropping a tensor.
        out = os.path.join(root, "saved_hf")
        to_hf = {k: f"model.{k}" for k in sd if k != "output.weight"}
        to_hf["output.weight"] = "lm_head.weight"
        save_full_checkpoint(_shard(_build(0)), out, key_map=to_hf, max_shard_size=SMALL)
        saved = _read_dir(out)
        assert sorted(saved) == sorted(k for k in hf if "inv_freq" not in k), sorted(saved)
        _load_checks(out, want, f"{case} saved with a dict", key_map=from_hf)
        out = os.path.join(root, "saved_callable")
        save_full_checkpoint(
            _shard(_build(0)), out, key_map=lambda n: None if n == "counts" else f"m.{n}"
        )
        saved = _read_dir(out)
        assert sorted(saved) == sorted(f"m.{k}" for k in sd if k != "counts"), sorted(saved)
        model = _shard(_build(1))
        result = load_full_checkpoint(model, out, key_map=lambda n: n[2:], strict=False)
        assert result == LoadResult(["counts"], []), f"{case}: {result}"
        partly = dict(want, counts=_build(1).counts)  # left unchanged
        _check_state(model, partly, f"{case} saved with a callable")
    else:
        raise AssertionError(case)


INPUT_CASES = [
    "safetensors file",
    "torch.save file",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "persistent buffers",
    "tied",
    "key_map",
]


@pytest.mark.parametrize("case", INPUT_CASES)
def test_other_inputs(case: str, tmp_path) -> None:
    run_on_ranks(2, _input_case, str(tmp_path), case)


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
# Load errors


def _write_garbage(path: str) -> None:
    _write_bytes(path, b"\xff\x13 this is not a checkpoint \x00" * 3)


def _load_error(root: str, case: str) -> None:
    ref = _build(0)
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    path = os.path.join(root, "ckpt.safetensors")
    meta = case.startswith("meta")
    model = _meta_sharded(1) if meta else _shard(_build(1))
    if case == "meta rope":
        model.rope = torch.empty_like(model.rope, device="meta")
    before = None if meta else _state(model)
    kw: dict[str, Any] = {}
    result_kw: dict[str, Any] | None = None  # the same load with strict=False: its result
    key = "layers.1.attention.wq.weight"
    if case == "missing path":
        path, exc, match = os.path.join(root, "nowhere"), FileNotFoundError, "nowhere"
    elif case == "directory without weights":
        path, exc, match = (
            os.path.join(root, "empty"),
            FileNotFoundError,
            "empty.*model.safetensors",
        )
        _write_on_rank0(lambda: os.makedirs(path))
    elif case == "index lists a missing file":
        path, exc, match = root, FileNotFoundError, "model-00002-of-00002.safetensors"

        def write() -> None:
            save_file(
                {k: sd[k] for k in list(sd)[:3]},
                os.path.join(root, "model-00001-of-00002.safetensors"),
            )
            weight_map = {k: "model-00001-of-00002.safetensors" for k in list(sd)[:3]}
            weight_map.update({k: "model-00002-of-00002.safetensors" for k in list(sd)[3:]})
            with open(os.path.join(root, INDEX), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f)

        _write_on_rank0(write)
    elif case == "corrupt index":
        path, exc, match = root, ValueError, INDEX
        _write_on_rank0(lambda: _write_bytes(os.path.join(root, INDEX), b'{"weight_map": '))
    elif case == "index lists a tensor its file lacks":
        path, exc, match = root, ValueError, r"model\.safetensors.*'extra\.weight'"

        def write() -> None:
            save_file(sd, os.path.join(root, "model.safetensors"))
            weight_map = dict.fromkeys([*sd, "extra.weight"], "model.safetensors")
            with open(os.path.join(root, INDEX), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f)

        _write_on_rank0(write)
    elif case == "torch.save of a nested dict":
        path, exc, match = os.path.join(root, "nested.pt"), ValueError, "nested.pt.*'model'"
        _write_on_rank0(lambda: torch.save({"model": sd, "step": 3}, path))
    elif case == "torch.save of a list":
        path, exc, match = os.path.join(root, "list.pt"), ValueError, "list.pt.*list"
        _write_on_rank0(lambda: torch.save(list(sd.values()), path))
    elif case == "corrupt safetensors":
        exc, match = ValueError, "ckpt.safetensors"
        _write_on_rank0(lambda: _write_garbage(path))
    elif case == "truncated safetensors":
        exc, match = ValueError, "ckpt.safetensors"

        def write() -> None:
            save_file(sd, path)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) - 7)

        _write_on_rank0(write)
    elif case == "corrupt model.safetensors in a directory":
        path, exc, match = root, ValueError, "model.safetensors"
        _write_on_rank0(lambda: _write_garbage(os.path.join(root, "model.safetensors")))
    elif case == "corrupt torch.save file":
        path, exc, match = os.path.join(root, "ckpt.pt"), ValueError, "ckpt.pt"
        _write_on_rank0(lambda: _write_garbage(path))
    elif case == "missing key":
        del sd[key]
        _write_on_rank0(lambda: save_file(sd, path))
        exc, match = RuntimeError, rf'Missing key\(s\) in state_dict: "{key}"'
        result_kw = {"missing_keys": [key], "unexpected_keys": []}
    elif case == "unexpected key":
        sd["extra.weight"] = torch.zeros(3)
        _write_on_rank0(lambda: save_file(sd, path))
        exc, match = RuntimeError, r'Unexpected key\(s\) in state_dict: "extra\.weight"'
        result_kw = {"missing_keys": [], "unexpected_keys": ["extra.weight"]}
    elif case == "shape mismatch":
        key = "layers.0.feed_forward.w1.weight"  # (96, 32)
        sd[key] = torch.zeros(95, 32)
        _write_on_rank0(lambda: save_file(sd, path))
        exc = RuntimeError
        match = rf"{key}.*torch.Size\(\[95, 32\]\).*torch.Size\(\[96, 32\]\)"
    elif case == "key_map collision":
        _write_on_rank0(lambda: save_file(sd, path))
        kw["key_map"] = {"norm.weight": "norm.weight", "layers.0.ffn_norm.weight": "norm.weight"}
        exc = ValueError
        match = r"(?=.*'layers\.0\.ffn_norm\.weight')(?=.*both map to 'norm\.weight')"
    elif case == "meta missing key":
        del sd[key]
        _write_on_rank0(lambda: save_file(sd, path))
        kw["strict"] = False
        exc, match = ValueError, key
    elif case == "meta rope":
        _write_on_rank0(lambda: save_file(sd, path))
        exc, match = ValueError, "rope"
    else:
        raise AssertionError(case)
    for strict in (True, False) if "strict" not in kw else (kw.pop("strict"),):
        what = f"{case} (strict={strict})"
        if result_kw is not None and not strict:
            result = load_full_checkpoint(model, path, strict=False, **kw)
            assert result == LoadResult(**result_kw), f"{what}: {result}"
            want = _state(ref)
            if case == "missing key":
                want[key] = before[key]  # left unchanged
            _check_state(model, want, f"{what}: the rest is loaded")
            continue
        with expect_raises(what, exc, match=match):
            load_full_checkpoint(model, path, strict=strict, **kw)
        if meta:
            for name, p in model.named_parameters():
                assert p.is_meta, f"{what}: {name} was materialised"
        else:
            _check_state(model, before, f"{what}: after the error")


LOAD_ERRORS = [
    "missing path",
    "directory without weights",
    "index lists a missing file",
    "corrupt index",
    "index lists a tensor its file lacks",
    "torch.save of a nested dict",
    "torch.save of a list",
    "corrupt safetensors",
    "truncated safetensors",
    "corrupt model.safetensors in a directory",
    "corrupt torch.save file",
    "missing key",
    "unexpected key",
    "shape mismatch",
    "key_map collision",
    "meta missing key",
    "meta rope",
]


@pytest.mark.parametrize("case", LOAD_ERRORS)
def test_load_errors(case: str, tmp_path) -> None:
    run_on_ranks(2, _load_error, str(tmp_path), case)


# ---------------------------------------------------------------------------------------------
# Save errors


def _save_bad_arguments(root: str) -> None:
    """Only rank 0 calls: an error after a collective would hang it (the harness's timeout)."""
    if dist.get_rank() != 0:
        return
    model = _shard(_build(0))
    a_file = os.path.join(root, "config.json")
    with open(a_file, "w") as f:
        f.write("{}")
    meta_model = _shard(_build(0, meta=True))
    cases: list[tuple[str, Any, dict[str, Any], type[BaseException], str]] = [
        ("max_shard_size=0", model, {"max_shard_size": 0}, ValueError, "max_shard_size"),
        ("max_shard_size=-1", model, {"max_shard_size": -1}, ValueError, "max_shard_size"),
        ("max_shard_size='0GB'", model, {"max_shard_size": "0GB"}, ValueError, "'0GB'"),
        (
            "max_shard_size='5 parsecs'",
            model,
            {"max_shard_size": "5 parsecs"},
            ValueError,
            "parsecs",
        ),
        ("max_shard_size=1.5", model, {"max_shard_size": 1.5}, ValueError, "1.5"),
        ("dtype=int32", model, {"dtype": torch.int32}, TypeError, "int32"),
        ("writers=0", model, {"writers": 0}, ValueError, "writers"),
        ("writers=-2", model, {"writers": -2}, ValueError, "writers"),
        ("path is a file", model, {"path": a_file}, ValueError, "config.json"),
        ("meta model", meta_model, {}, ValueError, "meta"),
        (
            "key_map collision",
            model,
            {"key_map": {"norm.weight": "w", "output.weight": "w"}},
            ValueError,
            r"'norm\.weight' and 'output\.weight' both map to 'w'",
        ),
    ]
    for what, m, kw, exc, match in cases:
        target = kw.pop("path", os.path.join(root, "out"))
        with expect_raises(what, exc, match=match):
            save_full_checkpoint(m, target, **kw)
    assert not os.path.exists(os.path.join(root, "out")), os.listdir(os.path.join(root, "out"))


def test_save_bad_arguments(tmp_path) -> None:
    run_on_ranks(2, _save_bad_arguments, str(tmp_path), timeout=60)


def _fail_on_rank1(root: str, where: str) -> None:
    rank = dist.get_rank()
    old, fresh = os.path.join(root, "old"), os.path.join(root, "fresh")
    save_full_checkpoint(_shard(_build(1)), old, max_shard_size=SMALL)
    old_files = sorted(os.listdir(old))
    assert INDEX in old_files and len(old_files) > 3, old_files
    cls = fsdp2.checkpoint._files.StreamWriter
    original = getattr(cls, where)

    def fail(self: Any, *args: Any) -> None:
        raise OSError(f"injected {where} failure (disk full)")

    for path in (fresh, old):
        what = f"{where} fails on rank 1, saving to {os.path.basename(path)}"
        if rank == 1:
            setattr(cls, where, fail)
        try:
            with expect_raises(what, RuntimeError, match=rf"rank 1: .*injected {where} failure"):
                save_full_checkpoint(_shard(_build(0)), path, max_shard_size=SMALL)
        finally:
            setattr(cls, where, original)
        dist.barrier()
        left = sorted(os.listdir(path))
        assert INDEX not in left, f"{what}: an index is left: {left}"
        if where != "publish":  # then rank 0's files are out already, and rank 1's are not
            partial = [e for e in left if e.endswith(".partial")]
            assert not partial, f"{what}: partial files {partial}"
        if where in ("__init__", "write") and path == fresh:
            assert left == [], f"{what}: files left {left}"
        with expect_raises(f"{what}: loading", FileNotFoundError):
            load_full_checkpoint(_shard(_build(2)), path)
        dist.barrier()  # rank 0 is done reading before the next save writes there
    # Still usable: a save after the failures works and publishes.
    save_full_checkpoint(_shard(_build(0)), old, max_shard_size=SMALL)
    model = _shard(_build(1))
    load_full_checkpoint(model, old)
    _check_state(model, _state(_build(0)), "saved again after the failures")


@pytest.mark.parametrize("where", ["__init__", "write", "commit", "publish"])
def test_save_failure_on_one_rank(where: str, tmp_path) -> None:
    run_on_ranks(2, _fail_on_rank1, str(tmp_path), where, timeout=60)


def _overwrite(root: str) -> None:
    rank = dist.get_rank()
    ref = _build(0)
    keep = os.path.join(root, "config.json")
    _write_on_rank0(lambda: _write_bytes(keep, b"{}"))
    steps = [  # (what, seed, max_shard_size)
        ("many files", 2, SMALL // 2),
        ("fewer files", 3, SMALL * 2),
        ("one file", 4, None),
        ("many files again", 5, SMALL),
        ("last", 0, SMALL * 2),
    ]
    counts = []
    for what, seed, size in steps:
        kw = {} if size is None else {"max_shard_size": size}
        written = save_full_checkpoint(_shard(_build(seed)), root, **kw)
        counts.append(len(written))
        dist.barrier()
        names = {os.path.basename(p) for p in written}
        left = set(os.listdir(root))
        assert left == names | {"config.json"}, f"{what}: {sorted(left)}, wrote {sorted(names)}"
        if rank == 0:
            _check_saved(root, _want_saved(_build(seed)), what)
        dist.barrier()
    assert counts[0] > counts[1] > 2 and counts[2] == 1, f"files per save: {counts}"
    model = _shard(_build(1))
    load_full_checkpoint(model, root)
    _check_state(model, _state(ref), "after overwriting")


def test_overwrite_removes_stale_files(tmp_path) -> None:
    run_on_ranks(2, _overwrite, str(tmp_path))


def _unsavable_tensor(root: str) -> None:
    """A tensor that has no plain values (a ``TwoTensor`` parameter, left unsharded) is a
    ``TypeError`` naming it on every rank alike, raised before anything is gathered or
    written: no hang, no ``.partial`` file, the older checkpoint untouched (it still loads)."""
    from torch.testing._internal.two_tensor import TwoTensor

    save_full_checkpoint(_shard(_build(1)), root, max_shard_size=SMALL)
    model = _build(0)
    model.layers[1].odd = nn.Parameter(TwoTensor(torch.ones(3), torch.zeros(3)))
    _shard(model, ignored_params={model.layers[1].odd})
    with expect_raises("a TwoTensor parameter", TypeError, match="layers.1.odd"):
        save_full_checkpoint(model, root, max_shard_size=SMALL)
    dist.barrier()
    left = sorted(os.listdir(root))
    assert INDEX in left, f"the older checkpoint was touched: {left}"
    assert not [e for e in left if e.endswith(".partial")], f"partial files left: {left}"
    older = _shard(_build(2))
    load_full_checkpoint(older, root)
    _check_state(older, _state(_build(1)), "the older checkpoint")
    dist.barrier()


def test_save_unsavable_tensor(tmp_path) -> None:
    run_on_ranks(2, _unsavable_tensor, str(tmp_path), timeout=60)


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


def _disagreeing_ranks(root: str, case: str) -> str:
    """Ranks that would write different checkpoints: ``ValueError`` on every rank before any
    tensor is gathered (no hang, no file)."""
    rank = dist.get_rank()
    out = 6 if case != "width" or rank == 0 else 8
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, out), nn.Linear(out, 2))
    for layer in model:
        fully_shard(layer, mesh=world_mesh())
    fully_shard(model, mesh=world_mesh())
    kw = {"max_shard_size": 100 if case == "max_shard_size" and rank == 1 else 10_000}
    try:
        save_full_checkpoint(model, root, **kw)
    except ValueError as e:
        message = str(e)
    else:
        message = ""
    dist.barrier()
    assert not os.path.exists(root), "nothing is written"
    return message


@pytest.mark.parametrize("case", ["width", "max_shard_size"])
def test_save_ranks_that_disagree(tmp_path, case) -> None:
    root = str(tmp_path / "ckpt")
    for message in run_on_ranks(2, _disagreeing_ranks, root, case, timeout=60):
        assert "the ranks would write different checkpoints" in message, message
        if case == "width":
            assert "'0.weight', (6, 4)" in message and "'0.weight', (8, 4)" in message, message
        else:
            assert "model.safetensors" in message and "model-00001-of" in message, message
