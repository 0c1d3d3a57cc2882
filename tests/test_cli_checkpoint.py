"""``fsdp2 inspect`` and ``fsdp2 convert`` (fsdp2/cli/__init__.py, fsdp2/checkpoint/_inspect.py and
_convert.py) on real files: a DCP checkpoint of a tiny Hugging Face Llama sharded over 2 gloo
ranks with its AdamW state (``{"model": ..., "optim": ...}``), safetensors and FSDP1-style
``torch.save`` full state dicts.

* Round trips are bitwise: DCP -> safetensors (several files, an index, the config) -> DCP
  -> safetensors gives the saved full tensors, dtypes and names; safetensors with bf16, fp32
  and int64 tensors -> DCP -> safetensors too; ``from_pretrained`` loads the converted folder.
* Only the model's weights are converted (the ``model.`` prefix found and stripped; optimizer
  state and objects reported on stderr); ``--dtype`` casts floating tensors only.
* ``inspect --json`` reports the sharding (2 ranks, 2 chunks per tensor), the parameter count
  and the optimizer state.
* A conversion that fails half-way leaves no DST and no stage; an existing DST is refused
  unless ``--overwrite``; inputs a person gets wrong exit 1 or 2 with a message naming them.
* One run through the installed console script (a subprocess, ``--progress`` on stderr).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from fsdp2.cli import main

pytest.importorskip("transformers", reason="transformers is a test extra")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def save_sharded_llama(folder: str) -> dict[str, torch.Tensor] | None:
    """On 2 ranks: a tiny Llama, ``fully_shard`` per layer and root, one AdamW step, saved
    with ``dcp.save({"model": ..., "optim": ...})`` into ``folder`` with its ``config.json``.
    Rank 0 returns the full model tensors (used by docs/cli.md's test too)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from helpers import world_mesh
    from models import hf_llama_config
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import LlamaForCausalLM

    from fsdp2 import fully_shard

    torch.manual_seed(0)
    config = hf_llama_config(512, hidden_size=64, intermediate_size=128)
    model = LlamaForCausalLM(config)
    mesh = world_mesh()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 512, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model_sd.items()}
    if dist.get_rank() == 0:
        config.save_pretrained(folder)
        return {k: v.detach().clone() for k, v in full.items()}
    return None


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: Any) -> tuple[str, dict[str, torch.Tensor]]:
    from _harness import run_on_ranks

    folder = str(tmp_path_factory.mktemp("cli") / "ckpt")
    full = run_on_ranks(2, save_sharded_llama, folder)[0]
    return folder, full


def fsdp2(*argv: str) -> tuple[int, str, str]:
    """``fsdp2 argv`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse
            code = int(e.code or 0)
    return code, out.getvalue(), err.getvalue()


def _ok(*argv: str) -> tuple[str, str]:
    code, out, err = fsdp2(*argv)
    assert code == 0, (argv, err[-3000:])
    return out, err


def _dcp(folder: str) -> dict[str, torch.Tensor]:
    from fsdp2.checkpoint._inspect import open_checkpoint

    with open_checkpoint(folder) as ckpt:
        return dict(ckpt.read(list(ckpt.tensors)))


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert list(sorted(got)) == list(sorted(want)), what
    for k, v in want.items():
        assert got[k].dtype == v.dtype, (what, k, got[k].dtype, v.dtype)
        a, b = got[k].reshape(-1).view(torch.uint8), v.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), (what, k)


def test_dcp_round_trip_is_bitwise(sharded: Any, tmp_path: Any) -> None:
    src, full = sharded
    hf, back, again = (str(tmp_path / n) for n in ("hf", "back", "again"))
    out, err = _ok("convert", src, hf, "--max-shard-size", "100KB", "--config", src)
    assert "not converted, not model weights" in err and "optim.state" in err, err
    assert 'under "model."' in err
    files = sorted(os.listdir(hf))
    assert "model.safetensors.index.json" in files and "config.json" in files, files
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and all(os.path.getsize(os.path.join(hf, f)) < 200_000 for f in shards)
    index = json.load(open(os.path.join(hf, "model.safetensors.index.json")))
    loaded = {}
    for f in shards:
        loaded.update(load_file(os.path.join(hf, f)))
    assert set(index["weight_map"]) == set(loaded)
    _same(loaded, full, "DCP -> safetensors")
    assert f"{len(full)} tensors" in out and "hf/config.json" in out.replace(
        str(tmp_path) + "/", ""
    )
    _ok("convert", hf, back)  # safetensors -> DCP by default
    _same(_dcp(back), full, "-> DCP")
    _ok("convert", back, again + ".safetensors")  # one file
    _same(load_file(again + ".safetensors"), full, "-> DCP -> safetensors")

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf)  # the index, the shards, the config
    for name, t in model.state_dict().items():
        assert torch.equal(t, full[name]), name


def test_safetensors_round_trip_is_bitwise(tmp_path: Any) -> None:
    torch.manual_seed(0)
    tensors = {
        "embed.weight": torch.randn(64, 16).to(torch.bfloat16),
        "layers.0.w": torch.randn(16, 16),
        "layers.1.w": torch.randn(16, 16),
        "layers.0.b": torch.randn(16).to(torch.float16),
        "positions": torch.arange(10),
        "scalar": torch.tensor(3.5),
    }
    tensors["layers.1.w"][0, 0] = float("nan")  # bit for bit, not allclose
    src = str(tmp_path / "src.safetensors")
    save_file(tensors, src)
    _ok("convert", src, str(tmp_path / "dcp"))
    _same(_dcp(str(tmp_path / "dcp")), tensors, "safetensors -> DCP")
    _ok("convert", str(tmp_path / "dcp"), str(tmp_path / "hf"))
    _same(load_file(str(tmp_path / "hf" / "model.safetensors")), tensors, "-> DCP -> safetensors")
    # --dtype casts floating tensors, keeps the others
    _ok("convert", src, str(tmp_path / "bf16"), "--to", "safetensors", "--dtype", "bf16")
    cast = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert cast["layers.0.w"].dtype == torch.bfloat16 and cast["positions"].dtype == torch.int64
    assert torch.equal(cast["layers.0.w"], tensors["layers.0.w"].to(torch.bfloat16))


def test_torch_save_full_state_dict(sharded: Any, tmp_path: Any) -> None:
    """FSDP1's FULL_STATE_DICT (rank 0's ``torch.save``), flat and nested with optimizer state."""
    _, full = sharded
    flat, nested = str(tmp_path / "model.pt"), str(tmp_path / "train.bin")
    torch.save(full, flat)
    optim = {"state": {0: {"exp_avg": torch.zeros(3), "step": torch.tensor(1.0)}}, "lr": 0.1}
    torch.save({"model": full, "optim": optim, "step": 7}, nested)
    _ok("convert", flat, str(tmp_path / "a"))
    _same(load_file(str(tmp_path / "a" / "model.safetensors")), full, "torch.save -> safetensors")
    os.mkdir(tmp_path / "bin")  # a Hugging Face folder of the torch.save era
    os.link(flat, tmp_path / "bin" / "pytorch_model.bin")
    _ok("convert", str(tmp_path / "bin"), str(tmp_path / "c"), "--to", "dcp")
    _same(_dcp(str(tmp_path / "c")), full, "pytorch_model.bin -> DCP")
    _, err = _ok("convert", nested, str(tmp_path / "b"), "--to", "dcp")
    assert "2 tensors" in err and "2 non-tensor objects" in err, err
    _same(_dcp(str(tmp_path / "b")), full, "nested torch.save -> DCP")
    info = json.loads(_ok("inspect", nested, "--json")[0])
    assert info["format"] == "torch" and info["model_prefix"] == "model."
    assert info["optimizer_state"]["present"] and info["optimizer_state"]["tensors"] == 2


def test_inspect_reports_sharding_and_optimizer_state(sharded: Any) -> None:
    src, full = sharded
    info = json.loads(_ok("inspect", src, "--json")[0])
    assert info["format"] == "dcp" and info["ranks"] == 2 and info["files"] == 2
    assert info["chunks_per_tensor"] == [2] and info["model_prefix"] == "model."
    assert info["model"]["parameters"] == sum(t.numel() for t in full.values())
    assert info["model"]["bytes"] == sum(t.nbytes for t in full.values())
    assert info["optimizer_state"]["present"] and info["optimizer_state"]["tensors"] > 0
    assert any(o.startswith("optim.param_groups") for o in info["objects"])
    text, _ = _ok("inspect", src)
    assert "model.layers.{0..1}.mlp.up_proj.weight (x2)" in text, text
    every, _ = _ok("inspect", src, "--all")
    assert "model.layers.1.mlp.up_proj.weight" in every and "exp_avg_sq" in every


def test_failed_conversion_leaves_nothing(sharded: Any, tmp_path: Any, monkeypatch: Any) -> None:
    from fsdp2.checkpoint import _inspect

    src, _ = sharded
    real = _inspect.Checkpoint.read
    seen = []

    def failing(self: Any, names: list[str]) -> Any:
        for pair in real(self, names):
            seen.append(pair[0])
            if len(seen) == 5:
                raise OSError("No space left on device (injected)")
            yield pair

    monkeypatch.setattr(_inspect.Checkpoint, "read", failing)
    for to in ("safetensors", "dcp"):
        seen.clear()
        dst = str(tmp_path / to)
        code, _, err = fsdp2("convert", src, dst, "--to", to, "--max-shard-size", "100KB")
        assert code == 1 and "failed, nothing was written: No space left" in err, err
        assert os.listdir(tmp_path) == [], os.listdir(tmp_path)  # no DST, no stage


def test_existing_dst_and_overwrite(tmp_path: Any) -> None:
    src, dst = str(tmp_path / "a.safetensors"), str(tmp_path / "out")
    save_file({"w": torch.ones(2)}, src)
    os.mkdir(dst)
    open(os.path.join(dst, "old"), "w").close()
    code, _, err = fsdp2("convert", src, dst)
    assert code == 1 and "exists: remove it, or pass --overwrite" in err, err
    _ok("convert", src, dst, "--overwrite")
    assert sorted(os.listdir(dst)) == [".metadata", "__0_0.distcp"]
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors", "out"]


def test_inputs_a_person_gets_wrong(tmp_path: Any) -> None:
    good = str(tmp_path / "good.safetensors")
    save_file({"w": torch.ones(2)}, good)
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"garbage")
    torch.save([1, 2], str(tmp_path / "list.pt"))
    (tmp_path / "text.pt").write_text("hello")
    torch.save({"w": torch.zeros(2, dtype=torch.complex128)}, str(tmp_path / "complex.pt"))
    cases = [
        (["inspect", str(tmp_path / "missing")], 1, "no such file or folder"),
        (["inspect", str(tmp_path / "empty")], 1, "a folder that holds no checkpoint"),
        (["inspect", str(tmp_path / "bad.safetensors")], 1, "not a readable safetensors file"),
        (["inspect", str(tmp_path / "dcp")], 1, "unreadable .metadata"),
        (["inspect", str(tmp_path / "list.pt")], 1, "not a state dict"),
        (["inspect", str(tmp_path / "text.pt")], 1, "not a checkpoint torch.load can read"),
        (["convert", str(tmp_path / "missing"), str(tmp_path / "x")], 1, "no such file"),
        (["convert", good, str(tmp_path / "x"), "--dtype", "int8"], 2, "bf16, fp16 or fp32"),
        (["convert", good, str(tmp_path / "x"), "--to", "onnx"], 2, "invalid choice"),
        (["convert", good, str(tmp_path / "x"), "--prefix", "model."], 1, "matches no tensor"),
        (["convert", good, str(tmp_path / "x"), "--max-shard-size", "big"], 1, "must be"),
        (["convert", good, str(tmp_path / "x"), "--config", str(tmp_path)], 1, "--config"),
        (["convert", good, good], 1, "DST must not be SRC"),
        (["convert", good, str(tmp_path), "--overwrite"], 1, "or hold it"),
        (["convert", str(tmp_path / "complex.pt"), str(tmp_path / "x")], 1, "cannot be stored"),
        (["convert", good, str(tmp_path / "y.safetensors"), "--to", "dcp"], 1, "name a folder"),
        (["convert", good], 2, "the following arguments are required: dst"),
    ]
    for argv, want_code, message in cases:
        code, _, err = fsdp2(*argv)
        assert code == want_code and message in err, (argv, code, err[-2000:])
    assert sorted(os.listdir(tmp_path)) == [
        "bad.safetensors", "complex.pt", "dcp", "empty", "good.safetensors", "list.pt", "text.pt"
    ]  # fmt: skip


def test_console_script_with_progress(sharded: Any, tmp_path: Any) -> None:
    src, full = sharded
    script = os.path.join(os.path.dirname(sys.executable), "fsdp2")
    argv = [script] if os.path.exists(script) else [sys.executable, "-m", "fsdp2"]
    dst = str(tmp_path / "hf")
    proc = subprocess.run(
        [*argv, "convert", src, dst, "--dtype", "bf16", "--progress"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "convert: 100%" in proc.stderr and "bfloat16" in proc.stdout, proc.stderr[-3000:]
    got = load_file(os.path.join(dst, "model.safetensors"))
    _same(got, {k: v.to(torch.bfloat16) for k, v in full.items()}, "--dtype bf16")


def test_tied_model_into_dcp_and_back(tmp_path: Any) -> None:
    """A tied Hugging Face model (Qwen2, ``tie_word_embeddings``) saved as safetensors holds
    the shared tensor once; converted into DCP, the command says how to load it, and that
    load (``allow_partial_load``) gives back every weight, the head through the embedding."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path / "hf")
    code, out, err = fsdp2("convert", str(tmp_path / "hf"), str(tmp_path / "dcp"))
    assert code == 0, err
    assert "tied embeddings" in out and "allow_partial_load=True" in out, out
    torch.manual_seed(1)
    fresh = Qwen2ForCausalLM(config)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    sd = fresh.state_dict()
    dcp.load(
        sd, checkpoint_id=str(tmp_path / "dcp"), planner=DefaultLoadPlanner(allow_partial_load=True)
    )
    fresh.load_state_dict(sd)
    for name, p in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], p), name
