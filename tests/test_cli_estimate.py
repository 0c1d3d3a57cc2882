"""``fsdp2 estimate``'s extras (fsdp2/cli/__init__.py): fsdp2's own models by name, ``--optimizer
muon``, ``--plot``, and the Hugging Face configs under examples/configs.

* ``fsdp2 estimate llama-bench`` is benchmarks/estimate.py's estimate of the benchmark Llama
  (the configuration docs/benchmarks.md measures), to the byte.
* ``--optimizer muon`` counts one fp32 momentum per hidden matrix (``fsdp2.optim.Muon``) and
  AdamW's two moments and step for the rest, as ``muon_param_groups`` splits them.
* ``--plot`` writes a PNG and leaves stdout as it is.
* ``--shard-over-replicas`` divides HSDP's gradients and optimizer state by the replicas,
  scaled as simulated whole.
* ``--offload-budget`` offloads ``fsdp2.cpu_offload_by_budget``'s selection: the held bytes
  on the host are rank 0's shards of it, to the byte.
* The hand-written configs build the published models (parameter counts), and docs/cli.md's
  figures for ``accelerate estimate-memory`` are what accelerate's own functions give for them.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is a test extra")

from test_cli_checkpoint import fsdp2  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "examples", "configs")
SMALL = ["--batch", "2", "--seq", "32", "--device", "cpu"]


def test_benchmark_llama_equals_benchmarks_estimate() -> None:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import estimate as bench
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    want = bench.estimate(bench.Config("llama", "fp32", True, (2,)))
    argv = ["llama-bench", "--mesh", "2", "--batch", "8", "--seq", "256", "--mp", "fp32"]
    argv += ["--exact"]  # the whole model simulated, as benchmarks/estimate.py does
    code, out, err = fsdp2("estimate", *argv, "--device", "cpu", "--json")
    assert code == 0, err[-3000:]
    got = json.loads(out)
    assert got["peak_bytes"] == want.peak_bytes and got["parts"] == want.parts, (got, want)


def _state_bytes(params: list[torch.nn.Parameter], muon_ids: set[int]) -> int:
    """One rank's optimizer state, unsharded: Muon's fp32 momentum, or AdamW's two fp32
    moments and its fp32 step scalar."""
    return sum(p.numel() * 4 if id(p) in muon_ids else p.numel() * 8 + 4 for p in params)


def test_muon_counts_one_moment_per_hidden_matrix() -> None:
    from fsdp2.models import Llama, LlamaConfig
    from fsdp2.optim import muon_param_groups

    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab_size=256, dim=192, n_layers=4, n_heads=6))
    params = list(model.parameters())
    muon_ids = {id(p) for p in muon_param_groups(model)[0][0]["params"]}
    assert muon_ids and len(muon_ids) < len(params)
    parts = {}
    for optimizer in ("muon", "adamw"):
        argv = ["llama-train", "--mesh", "1", "--optimizer", optimizer, "--batch", "4"]
        code, out, err = fsdp2("estimate", *argv, "--seq", "128", "--device", "cpu", "--json")
        assert code == 0, err[-3000:]
        got = json.loads(out)
        # a peak in the backward: the state alone (in the step, its temporaries too)
        assert got["when"].startswith("backward"), got["when"]
        parts[optimizer] = got["parts"]["optimizer state"]
    assert parts["muon"] == _state_bytes(params, muon_ids)
    assert parts["adamw"] == _state_bytes(params, set())


def test_plot_writes_a_png(tmp_path: Any) -> None:
    png = str(tmp_path / "sweep.png")
    argv = ["estimate", "llama-train", "--sweep", "1,2", *SMALL, "--device-memory", "1MiB"]
    code, plain, err = fsdp2(*argv)
    assert code == 0, err[-3000:]
    code, out, err = fsdp2(*argv, "--plot", png)
    assert code == 0 and out == plain, err[-3000:]
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    code, _, err = fsdp2("estimate", "llama-nonesuch", *SMALL)
    assert code == 1 and "nor one of fsdp2's models (llama-bench" in err, err
    code, _, err = fsdp2(*argv, "--plot", str(tmp_path / "no" / "such" / "dir.png"))
    assert code == 1 and "--plot" in err and "cannot write it" in err, err


# The published parameter counts of the models whose shapes examples/configs holds.
PARAMETERS = {
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "qwen2.5-7b": 7_615_616_512,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-0.5b": 494_032_768,  # tied embeddings: the head is the embedding
}


def test_example_configs_and_accelerate_figures() -> None:
    """Each config builds its model (parameter count), and the page's figures for
    ``accelerate estimate-memory`` are accelerate's: its model (``AutoModel``, fp32, on no
    device), its ``calculate_maximum_sizes`` and its ``estimate_training_usage`` (``accelerate
    estimate-memory`` itself only takes names on the Hugging Face Hub)."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes, convert_bytes
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    assert sorted(os.listdir(CONFIGS)) == sorted(PARAMETERS)
    page = open(os.path.join(ROOT, "docs", "cli.md")).read()
    for name, count in PARAMETERS.items():
        config = AutoConfig.from_pretrained(os.path.join(CONFIGS, name))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        unique = {id(p): p for p in model.parameters()}.values()  # a tied head counted once
        assert sum(p.numel() for p in unique) == count, name
        with accelerate.init_empty_weights():
            bare = AutoModel.from_config(config, dtype=torch.float32)
        total, _ = calculate_maximum_sizes(bare)
        fp32 = max(estimate_training_usage(total, "float32").values())
        fp16 = max(estimate_training_usage(total, "float16").values())
        row = f"| {convert_bytes(total)} | {convert_bytes(fp32)} | {convert_bytes(fp16)} |"
        assert row in page, (name, row)


def test_shard_over_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--shard-over-replicas`` on an HSDP mesh: rank 0's gradients and optimizer state are
    pieces (``ceil(n / R)`` of each local shard of ``n``), its parameters whole; scaled from 4
    and 5 blocks as the whole model simulated (``--exact``), to the byte. ``--optim-dtype``'s
    optimizer is wrapped too. ``--sweep`` with HSDP meshes shows each without and with it.
    Refused without an ``RxS`` mesh, and with Muon."""
    from fsdp2.cli import _estimate as _cli_estimate
    from fsdp2.models import Llama, LlamaConfig

    # 6 blocks (scaled), and shapes whose shards and pieces round up
    tiny = {"vocab_size": 130, "dim": 38, "n_layers": 6, "n_heads": 1}
    monkeypatch.setitem(_cli_estimate.OWN_MODELS, "llama-tiny", tiny)
    replicas, shards = 4, 2
    with torch.device("meta"):
        params = list(Llama(LlamaConfig(**tiny)).parameters())
    local = [-(-p.shape[0] // shards) * p[0].numel() for p in params]
    pieces = [-(-n // replicas) for n in local]
    assert sum(pieces) > sum(local) / replicas
    flag = ["--shard-over-replicas"]
    argv = ["estimate", "llama-tiny", "--mesh", "4x2", *SMALL, *flag, "--optim-dtype", "bf16"]
    got = []
    for extra in ([], ["--exact"]):
        code, out, err = fsdp2(*argv, *extra, "--json")
        assert code == 0, err[-3000:]
        got.append(json.loads(out))
    scaled, exact = got
    assert "shard_over_replicas" in scaled["settings"] and "scaled from 4" in scaled["settings"]
    assert scaled["peak_bytes"] == exact["peak_bytes"] and scaled["held"] == exact["held"]
    assert scaled["held"] == {
        "parameters": 4 * sum(local),  # fp32
        "gradients": 4 * sum(pieces),  # fp32
        "optimizer state": 4 * sum(pieces),  # two bf16 moments
    }
    # a sweep shows each HSDP mesh without and with it (1D meshes once: docs/cli.md's
    # `--sweep 64,8x8 --shard-over-replicas`, run by test_cli.py)
    sweep = ["estimate", "llama-tiny", "--sweep", "4x2", *SMALL, *flag, "--optim-dtype", "bf16"]
    code, out, err = fsdp2(*sweep, "--json")
    assert code == 0, err[-3000:]
    rows = json.loads(out)
    assert [(r["mesh_shape"], "shard_over_replicas" in r["settings"]) for r in rows] == [
        ([4, 2], False),
        ([4, 2], True),
    ]
    assert rows[1]["held"] == scaled["held"]
    for bad in (["--mesh", "8"], ["--sweep", "4,8"], ["--mesh", "2x2", "--optimizer", "muon"]):
        code, _, err = fsdp2("estimate", "llama-tiny", *SMALL, *flag, *bad)
        assert code == 1 and "--shard-over-replicas" in err, err


def test_offload_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--offload-budget SIZE``: ``fsdp2.cpu_offload_by_budget(model, SIZE)``'s selection
    over the whole model, simulated whole (the selection does not grow with the blocks). What
    rank 0 holds on the host between steps is its shards of the selected parameters, their
    gradients and AdamW's state, to the byte; the text says so; 0 offloads nothing, a budget
    over the total everything. Refused: a bad size, and with ``--offload``."""
    import argparse

    from fsdp2 import cpu_offload_by_budget
    from fsdp2.cli import _estimate as _cli_estimate
    from fsdp2.models import Llama, LlamaConfig
    from fsdp2.planning.estimate import _fmt

    tiny = {"vocab_size": 130, "dim": 38, "n_layers": 2, "n_heads": 1}
    monkeypatch.setitem(_cli_estimate.OWN_MODELS, "llama-tiny", tiny)
    with torch.device("meta"):
        model = Llama(LlamaConfig(**tiny, max_seq_len=32))
    budget = sum(p.nbytes for p in model.parameters()) // 3
    chosen = cpu_offload_by_budget(model, budget)
    assert 0 < len(chosen) < len(list(model.parameters()))

    def rank0(name: str) -> int:  # rank 0's shard of 2: the first ceil(rows / 2) rows
        p = model.get_parameter(name)
        return -(-p.shape[0] // 2) * p[0].numel() * 4

    def run(*extra: str) -> str:
        code, out, err = fsdp2("estimate", "llama-tiny", "--mesh", "2", *SMALL, *extra)
        assert code == 0, err[-3000:]
        return out

    got = json.loads(run("--offload-budget", str(budget), "--json"))
    shards = sum(rank0(n) for n in chosen)
    assert got["held_on_host"] == {
        "parameters": shards,
        "gradients": shards,
        "optimizer state": 2 * shards + 4 * len(chosen),  # AdamW: 2 moments, a step each
    }
    assert f"CPU offload of {len(chosen)} parameters" in got["settings"], got["settings"]
    assert f"offload budget {_fmt(budget)}:" in got["settings"]
    # 0: nothing on the host; the whole model's bytes or more: all it holds, the text says
    out = run("--offload-budget", "0")
    assert "offload budget 0 B: 0 B of parameters" in out and "on the host" not in out, out
    held = got["held"]
    parts = ", ".join(f"{k} {_fmt(v)}" for k, v in held.items())
    line = f"on the host between steps: {_fmt(sum(held.values()))} ({parts})"
    assert run("--offload-budget", "1GiB").splitlines()[-1] == line
    # a model of 6 blocks (scaled without it) is simulated whole
    simulated: list[int | None] = []
    monkeypatch.setattr(
        _cli_estimate, "_simulate", lambda a, c, m, blocks: simulated.append(blocks)
    )
    deeper = _cli_estimate._OwnConfig("llama-6", {**tiny, "n_layers": 6})
    _cli_estimate._estimate(argparse.Namespace(exact=False, offload_budget=10), deeper, (2,))
    assert simulated == [None]
    code, _, err = fsdp2("estimate", "llama-tiny", *SMALL, "--offload-budget", "-1")
    assert code == 2 and "--offload-budget must be" in err, err
    code, _, err = fsdp2("estimate", "llama-tiny", *SMALL, "--offload", "--offload-budget", "1")
    assert code == 2 and "not allowed with argument --offload" in err, err


def test_built_models_keyed_by_config_contents() -> None:
    """The command's cache of built models is keyed by a config's contents: keyed by
    ``id(config)``, a later call in the same process whose config reused a freed config's id
    was given the earlier model."""
    from transformers import LlamaConfig

    from fsdp2.cli._estimate import _fingerprint

    small = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    same = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    deeper = LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128)
    assert _fingerprint(small) == _fingerprint(same)
    assert _fingerprint(small) != _fingerprint(deeper)
