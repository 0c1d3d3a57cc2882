"""Errors of ``fsdp2.checkpoint``'s ``save_full_checkpoint`` / ``load_full_checkpoint``, each
naming what is wrong (the model and the bitwise comparisons: ``full_checkpoint_helpers``).
Checked:

* load errors, and the parameters unchanged after each (a meta model stays on meta): missing
  path, directory without weights, index listing a missing file (``FileNotFoundError``);
  corrupt index, index listing a tensor its file lacks, garbage or truncated
  ``.safetensors``, garbage ``torch.save`` file, a ``torch.save`` of a nested dict or a list
  (``ValueError`` naming the file); missing / unexpected keys (``RuntimeError`` under
  ``strict``; ``strict=False`` returns them and loads the rest); a shape mismatch
  (``RuntimeError`` naming the key and both shapes, also with ``strict=False``); a
  ``key_map`` collision, a meta model whose checkpoint lacks a key or whose ``rope`` is meta
  (``ValueError``);
* save errors: bad ``max_shard_size`` / ``dtype`` / ``writers``, a path that is a file, a
  meta model, a ``key_map`` collision raise before any collective (only rank 0 calls); a
  failure on rank 1 only (``StreamWriter`` construction, write, commit, publish) raises
  ``RuntimeError`` naming rank 1 on every rank without hanging and publishes nothing: an
  older checkpoint at the path is untouched (it still loads), a fresh path does not exist,
  no staging folder is left; a tensor with no plain values (``TwoTensor``) fails alike on
  every rank with ``TypeError`` naming it and no ``.partial`` left;
* ranks that would write different checkpoints (another width on rank 1; another
  ``max_shard_size``): ``ValueError`` on every rank naming the difference, nothing written.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from full_checkpoint_helpers import (
    INDEX,
    SMALL,
    _build,
    _check_state,
    _meta_sharded,
    _shard,
    _state,
    _write_bytes,
    _write_on_rank0,
)
from helpers import expect_raises, world_mesh
from safetensors.torch import save_file

import fsdp2
import fsdp2.checkpoint._files
from fsdp2 import fully_shard
from fsdp2.checkpoint import LoadResult, load_full_checkpoint, save_full_checkpoint

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
        assert sorted(os.listdir(root)) == ["old"], f"{what}: {sorted(os.listdir(root))}"
        if path == old:
            assert sorted(os.listdir(old)) == old_files, f"{what}: {sorted(os.listdir(old))}"
            model = _shard(_build(2))
            load_full_checkpoint(model, old)
            _check_state(model, _state(_build(1)), f"{what}: the older checkpoint")
        dist.barrier()  # rank 0 is done reading before the next save writes there
    # Still usable: a save after the failures works and publishes.
    save_full_checkpoint(_shard(_build(0)), old, max_shard_size=SMALL)
    model = _shard(_build(1))
    load_full_checkpoint(model, old)
    _check_state(model, _state(_build(0)), "saved again after the failures")


@pytest.mark.parametrize("where", ["__init__", "write", "commit", "publish"])
def test_save_failure_on_one_rank(where: str, tmp_path) -> None:
    run_on_ranks(2, _fail_on_rank1, str(tmp_path), where, timeout=60)


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
