"""The files ``fsdp2.checkpoint.save_full_checkpoint`` writes, read with ``safetensors``
itself (the model and the bitwise comparisons: ``full_checkpoint_helpers``). Checked:

* the index's ``weight_map`` and ``metadata.total_size``, ``model-0000i-of-0000n`` names,
  ``__metadata__ = {"format": "pt"}``, save_pretrained's cut (state-dict order, a new file only
  when the next tensor does not fit, within ``max_shard_size`` unless one tensor is bigger),
  file ``i`` written by rank ``i % writers`` (``writers=1``: rank 0 only), the same returned
  paths on every rank, the index file itself as a load path; one ``model.safetensors`` and no
  index when it fits; a ``.safetensors`` file target; ``dtype=torch.bfloat16`` (floats bf16,
  ints untouched; loads into fp32 as ``ref.to(bf16).to(fp32)``); a bf16 model (loads rounded,
  saves bf16); mixed precision (fp32 sharded parameters saved, also while bf16 unsharded ones
  are registered); ``reshard_after_forward=False`` after a training forward (load: the next
  forward uses the loaded values; save: the sharded values); CPU offload (save, load, meta
  load); a model not sharded at all, with ``pathlib`` paths; activation-checkpoint and
  ``torch.compile`` wrappers (names without ``_checkpoint_wrapped_module`` / ``_orig_mod``);
* saving over a checkpoint with more files, or several files over one, removes the stale ones
  and keeps other files.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
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
    _check_logits,
    _check_saved,
    _check_state,
    _meta_sharded,
    _shard,
    _state,
    _tokens,
    _want_saved,
    _write_bytes,
    _write_on_rank0,
)
from helpers import check_same, mine
from safetensors import safe_open
from torch.distributed.tensor import DTensor

import fsdp2
import fsdp2.checkpoint._files
from fsdp2.checkpoint import LoadResult, load_full_checkpoint, save_full_checkpoint


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


def _registered(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters registered on the modules now (``parameters()`` gives the sharded ones
    outside forward and backward, even while unsharded ones are registered)."""
    return [t for m in model.modules() for t in m._parameters.values() if t is not None]


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
        assert any(t.dtype == torch.bfloat16 for t in _registered(kept)), "no bf16 registered"
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
        assert not all(isinstance(t, DTensor) for t in _registered(model)), "nothing unsharded"
        load_full_checkpoint(model, root)
        _check_logits(model, ref, f"{case}: after load")  # not the kept seed-1 values
        _check_state(model, _state(ref), f"{case} loaded")
        model(x)
        assert not all(isinstance(t, DTensor) for t in _registered(model)), "nothing unsharded"
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
# Saving over an older checkpoint


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
