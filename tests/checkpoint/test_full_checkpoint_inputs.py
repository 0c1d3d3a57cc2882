"""What ``fsdp2.checkpoint.load_full_checkpoint`` reads besides its own checkpoints, tied
weights and ``key_map`` (the model and the bitwise comparisons: ``full_checkpoint_helpers``).
Checked:

* other inputs: ``safetensors.torch.save_file`` and ``torch.save`` of a state dict, directories
  with ``pytorch_model.bin`` and with ``pytorch_model.bin.index.json``; persistent buffers
  (saved, plain, loaded; the non-persistent one not saved); tied embeddings (saved once under
  the first name; a checkpoint with only the other name, or with both, loads; the tie stays);
  ``key_map`` as a dict (names it lacks kept) and as a callable, ``None`` dropping a tensor,
  on load and on save; an unexpected tensor is reported under its checkpoint name.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.nn as nn
from _harness import run_on_ranks
from full_checkpoint_helpers import (
    SMALL,
    _build,
    _check_state,
    _meta_sharded,
    _read_dir,
    _shard,
    _state,
    _want_saved,
    _write_on_rank0,
)
from helpers import check_same, expect_raises
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from fsdp2.checkpoint import LoadResult, load_full_checkpoint, save_full_checkpoint


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
