"""The example trainer (``examples/train.py``) end to end on 2 gloo ranks, with a tiny model.

Checks that ``train.main`` trains (finite loss that falls on a small repeated text) and
writes its outputs; that the same seed gives the same losses; that resuming from the step-3
checkpoint of a 6-step run repeats that run's losses bitwise (and a model of another width
is refused with a clear message), with AdamW and with ``--optimizer muon`` (Muon + AdamW, both
optimizers' state in the checkpoint); that mesh shapes (FSDP, HSDP both ways), gradient
accumulation and ``reshard_after_forward=False`` give the same losses as the plain run (up to
float rounding); that bf16 trains; that ``--export`` / ``--init-from`` round-trip the weights,
``--timeline`` writes a step's trace and chart and ``--estimate`` prints a memory estimate;
and that bad options exit with status 2 and a message on rank 0 naming the option.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys

import pytest
import torch
from _harness import run_on_ranks

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import train  # noqa: E402

STEPS = 6
TINY = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--lr", "1e-2"]
TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen jugs.\n"
PLAIN = ["--batch-size", "4", "--plot", "none"]  # the run other layouts are compared with


def _run(argv: list[str]) -> tuple[dict, str]:
    """On one rank: ``train.main(argv)``; its summary and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = train.main(argv)
    return summary, out.getvalue()


def _run_expecting_exit(argv: list[str]) -> tuple[object, str]:
    """On one rank: ``train.main(argv)``, which must exit; its exit code and its stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            train.main(argv)
        except SystemExit as e:
            return e.code, err.getvalue()
    raise AssertionError(f"train.main({argv}) did not exit")


def _args(tmp_path, data_file: str, name: str, *extra: str) -> list[str]:
    """Tiny-model options for a 6-step run on ``data_file`` writing under ``tmp_path/name``."""
    out = str(tmp_path / name)
    return [*TINY, "--data", data_file, "--steps", str(STEPS), "--out-dir", out, *extra]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    """A small repeated text: the loss falls fast on it."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(TEXT * 200)
    return str(path)


@pytest.fixture(scope="module")
def plain_losses(tmp_path_factory, data_file) -> list[float]:
    """The per-step losses of a plain run (1D mesh, no accumulation), computed once."""
    argv = _args(tmp_path_factory.mktemp("plain"), data_file, "plain", *PLAIN)
    return run_on_ranks(2, _run, argv)[0][0]["history"]["train"]


def test_trains_and_resumes_exactly(tmp_path, data_file):
    full, printed = run_on_ranks(
        2, _run, _args(tmp_path, data_file, "full", "--save-every", "3", "--eval-every", "2")
    )[0]
    losses = full["history"]["train"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.5, f"loss did not fall on repeated text: {losses}"
    assert [s for s, _ in full["history"]["val"]] == [2, 4, 6]
    assert "done: 6 steps" in printed and "validation loss" in printed, printed
    ckpt = tmp_path / "full" / "checkpoints"
    assert sorted(os.listdir(ckpt)) == ["step_000003", "step_000006"]
    with open(tmp_path / "full" / "metrics.json") as f:
        assert json.load(f)["history"]["train"] == losses
    plotted = os.path.isfile(tmp_path / "full" / "loss.png")
    assert plotted or "no plot: matplotlib is not installed" in printed, printed

    resumed, printed = run_on_ranks(
        2,
        _run,
        _args(
            tmp_path,
            data_file,
            "resumed",
            "--eval-every",
            "2",
            "--resume",
            str(ckpt / "step_000003"),
        ),
    )[0]
    assert "resumed from" in printed and resumed["resumed_from"] == 3
    assert resumed["history"] == full["history"]  # bitwise equal, validation losses too

    wider = _args(
        tmp_path, data_file, "wider", "--dim", "64", "--resume", str(ckpt / "step_000003")
    )
    code, err = run_on_ranks(2, _run_expecting_exit, wider)[0]
    assert code == 2 and "does not fit this model" in err and "Size mismatch" in err, err


def test_muon_trains_and_resumes_exactly(tmp_path, data_file):
    """``--optimizer muon``: Muon for the hidden matrices, AdamW for the rest; the loss falls,
    the checkpoint holds both optimizers' state (Muon's momentum, AdamW's moments) and a run
    resumed from it repeats the uninterrupted run bitwise; an AdamW run resuming it is
    refused."""
    from torch.distributed.checkpoint import FileSystemReader

    muon = ["--optimizer", "muon", "--eval-every", "3"]
    full = run_on_ranks(
        2, _run, _args(tmp_path, data_file, "full", *PLAIN, *muon, "--save-every", "3")
    )[0][0]
    losses = full["history"]["train"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5, losses
    ckpt = str(tmp_path / "full" / "checkpoints" / "step_000003")
    keys = set(FileSystemReader(ckpt).read_metadata().state_dict_metadata)
    for key in (
        "optim.state.layers.0.attention.wq.weight.momentum_buffer",
        "optim.state.layers.1.feed_forward.w2.weight.momentum_buffer",
        "optim.state.output.weight.exp_avg",
        "optim.state.tok_embeddings.weight.exp_avg_sq",
        "optim.state.norm.weight.exp_avg",
    ):
        assert key in keys, sorted(keys)
    assert not any(k.startswith("optim.state.output.weight.momentum") for k in keys), keys
    resumed = run_on_ranks(
        2, _run, _args(tmp_path, data_file, "resumed", *PLAIN, *muon, "--resume", ckpt)
    )[0][0]
    assert resumed["resumed_from"] == 3
    assert resumed["history"] == full["history"]  # bitwise equal, validation losses too
    code, err = run_on_ranks(
        2, _run_expecting_exit, _args(tmp_path, data_file, "adamw", *PLAIN, "--resume", ckpt)
    )[0]
    assert code == 2 and "does not fit this model" in err and "--optimizer" in err, err


def test_export_and_init_from(tmp_path, data_file):
    """``--export`` writes the final weights (equal to the final DCP checkpoint's); a run with
    ``--init-from`` that export starts from exactly those weights (with a learning rate too
    small to move fp32 weights, its own export is bitwise the same file contents)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    export = str(tmp_path / "export")
    first = run_on_ranks(2, _run, _args(tmp_path, data_file, "a", *PLAIN, "--export", export))[0]
    assert first[0]["export"] == export and f"exported: {export}" in first[1], first[1]
    exported = load_file(os.path.join(export, "model.safetensors"))
    dcp_to_torch_save(first[0]["checkpoint"], str(tmp_path / "final.pt"))
    final = torch.load(tmp_path / "final.pt", weights_only=False)["model"]
    assert sorted(exported) == sorted(final), (sorted(exported), sorted(final))
    for name, value in final.items():
        assert torch.equal(exported[name], value), name

    again = str(tmp_path / "again")
    frozen = ["--steps", "1", "--warmup", "0", "--lr", "1e-30", "--grad-clip", "0"]
    argv = [*_args(tmp_path, data_file, "b", *PLAIN), *frozen, "--init-from", export]
    second = run_on_ranks(2, _run, [*argv, "--export", again])[0][0]
    assert second["history"]["train"][0] < first[0]["history"]["train"][0] - 0.5, second
    reloaded = load_file(os.path.join(again, "model.safetensors"))
    for name, value in exported.items():
        assert torch.equal(reloaded[name], value), name

    argv = [*_args(tmp_path, data_file, "c", *PLAIN), "--init-from", str(tmp_path / "nope")]
    code, err = run_on_ranks(2, _run_expecting_exit, argv)[0]
    assert code == 2 and "--init-from" in err and "does not exist" in err, err


def test_timeline_option(tmp_path, data_file):
    """``--timeline`` profiles step 3: a Chrome trace and a PNG per rank, the summary printed,
    and the same losses as the plain run."""
    out = tmp_path / "tl"
    summary, printed = run_on_ranks(
        2, _run, _args(tmp_path, data_file, "tl", *PLAIN, "--timeline")
    )[0]
    assert "timeline: step " in printed and "exposed comm" in printed, printed
    for rank in (0, 1):
        assert (out / f"timeline.rank{rank}.json").is_file()
        assert (out / f"timeline.rank{rank}.png").is_file()
    assert all(math.isfinite(x) for x in summary["history"]["train"])


def test_estimate_option():
    """``--estimate`` prints the per-rank peak for the options on ``--mesh`` and trains
    nothing (in this process: it needs no process group)."""
    summary, printed = _run([*TINY, "--estimate", "--mesh", "16", "--dtype", "bf16"])
    est = summary["estimate"]
    assert est["world_size"] == 16 and est["peak_bytes"] == sum(est["parts"].values())
    assert "fsdp2 memory estimate: rank 0 of 16" in printed
    assert "reshard_after_forward=False" in printed  # the alternatives' table
    assert not torch.distributed.is_initialized()


def test_same_seed_same_losses(tmp_path, data_file, plain_losses):
    def losses(name: str, *extra: str) -> list[float]:
        argv = _args(tmp_path, data_file, name, *PLAIN, *extra)
        return run_on_ranks(2, _run, argv)[0][0]["history"]["train"]

    assert losses("again") == plain_losses
    assert losses("seed2", "--seed", "2") != plain_losses


@pytest.mark.parametrize(
    "options",
    [
        ["--mesh", "1x2"],  # HSDP: shard over 2, replicate over 1
        ["--mesh", "2x1"],  # HSDP: replicate over 2, no sharding
        ["--batch-size", "2", "--grad-accum", "2"],
        ["--reshard-after-forward", "false"],
    ],
    ids=lambda o: " ".join(o),
)
def test_layouts_match_plain_run(tmp_path, data_file, plain_losses, options):
    got = run_on_ranks(2, _run, _args(tmp_path, data_file, "variant", *PLAIN, *options))[0][0]
    pairs = zip(got["history"]["train"], plain_losses, strict=True)
    for step, (g, w) in enumerate(pairs, 1):
        assert math.isclose(g, w, rel_tol=1e-4), f"step {step}: loss {g} with {options}, want {w}"


def test_bf16_trains(tmp_path, data_file):
    summary = run_on_ranks(2, _run, _args(tmp_path, data_file, "bf16", "--dtype", "bf16"))[0][0]
    losses = summary["history"]["train"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5, losses


BAD_OPTIONS = [
    (["--mesh", "3"], "--mesh 3 has 3 ranks but the world size is 2"),
    (["--mesh", "2x2x1"], "--mesh: expected N (FSDP) or RxS (HSDP)"),
    (["--reshard-after-forward", "3"], "--reshard-after-forward 3 must divide the shard"),
    (["--reshard-after-forward", "sometimes"], "--reshard-after-forward: expected true"),
    (["--heads", "3"], "--dim 32 must be a multiple of --heads 3"),
    (["--steps", "0"], "--steps: must be an integer >= 1, got 0"),
    (["--warmup", "6"], "--warmup 6 must be smaller than --steps 6"),
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--resume"], "--resume: no step_* checkpoint"),
    (["--optimizer", "sgd"], "--optimizer: invalid choice: 'sgd'"),
    (["--muon-lr", "0"], "--muon-lr must be a positive number"),
    (["--optimizer", "muon", "--estimate"], "--estimate models AdamW's optimizer state only"),
]


@pytest.mark.parametrize("options, message", BAD_OPTIONS, ids=[" ".join(o) for o, _ in BAD_OPTIONS])
def test_bad_options_exit_with_a_message(tmp_path, data_file, options, message):
    results = run_on_ranks(2, _run_expecting_exit, _args(tmp_path, data_file, "bad", *options))
    assert [code for code, _ in results] == [2, 2]
    assert message in results[0][1], results[0][1]
    assert results[1][1] == "", "only rank 0 prints the error"


def test_missing_data_is_an_error(tmp_path):
    code, err = run_on_ranks(2, _run_expecting_exit, [*TINY, "--data", str(tmp_path / "nope")])[0]
    assert code == 2 and "--data" in err and "no such file" in err, err
