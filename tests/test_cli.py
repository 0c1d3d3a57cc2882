"""The ``fsdp2`` command (fsdp2/cli/__init__.py): docs/cli.md's commands run exactly as shown, with
the output the page shows (stdout, and stderr where the page shows it); ``python -m fsdp2`` is
the same command; ``fsdp2 estimate``'s numbers are ``fsdp2.estimate_memory``'s, to the byte
(JSON, HSDP mesh, a sweep); the inputs a person gets wrong exit 1 or 2 with a message saying
what to fix.

Most runs call ``fsdp2.cli.main`` in this process (``fsdp2()`` in test_cli_checkpoint.py);
one runs ``python -m fsdp2`` in a subprocess, and test_cli_checkpoint.py runs the console
script. The checkpoint commands of the page run in a temporary folder holding what the
page names (``ckpt``: a DCP checkpoint saved by 2 ranks, with its ``config.json``) and a link
to ``examples``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is a test extra")

from test_cli_checkpoint import fsdp2, save_sharded_llama  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "cli.md")


def _subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    argv = [sys.executable, "-m", "fsdp2", *args]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _page() -> list[tuple[str, str]]:
    """``(command, the text block after it)`` for each ``sh`` block of the page."""
    text = open(PAGE).read()
    pairs = re.findall(r"```sh\n(.*?)```\s*\n```text\n(.*?)```", text, re.S)
    return [(cmd.strip(), out) for cmd, out in pairs]


def _page_stderr() -> list[tuple[str, str]]:
    """``(command, stderr)`` for each plain block of the page that shows what a command says on
    stderr (its lines start with ``fsdp2 <subcommand>:``): the command is the page's last
    ``sh`` block before it."""
    text = open(PAGE).read()
    out = []
    for m in re.finditer(r"^```\n(fsdp2 \w+: .*?)^```", text, re.M | re.S):
        commands = re.findall(r"```sh\n(.*?)```", text[: m.start()], re.S)
        out.append((commands[-1].strip(), m.group(1)))
    return out


def test_page_commands_print_what_the_page_shows(tmp_path: Any, monkeypatch: Any) -> None:
    from _harness import run_on_ranks

    pairs = _page()
    assert len(pairs) >= 7
    os.symlink(os.path.join(ROOT, "examples"), tmp_path / "examples")
    run_on_ranks(2, save_sharded_llama, str(tmp_path / "ckpt"))
    monkeypatch.chdir(tmp_path)
    stderr = {}
    for command, shown in pairs:
        argv = shlex.split(command)
        assert argv[0] == "fsdp2", command
        code, out, err = fsdp2(*argv[1:])
        assert code == 0, (command, err[-3000:])
        assert out == shown, (command, out)
        stderr[command] = err
    shown_stderr = _page_stderr()
    assert shown_stderr, "the page shows what fsdp2 convert leaves out, on stderr"
    for command, shown in shown_stderr:
        assert stderr[command] == shown, (command, stderr[command])


def _config(tmp_path: Any) -> str:
    from models import hf_llama_config

    cfg = hf_llama_config(512, hidden_size=64, intermediate_size=128)
    folder = str(tmp_path / "tiny")
    cfg.save_pretrained(folder)
    return folder


def _python_estimate(folder: str, mesh: Any) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import fsdp2

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return fsdp2.estimate_memory(
        model,
        {"input_ids": ids, "labels": ids},
        mesh_shape=mesh,
        device="cpu",
        mp_policy=mp,
        compare=False,
    )


def test_estimate_equals_estimate_memory(tmp_path: Any) -> None:
    folder = _config(tmp_path)
    common = ["--batch", "2", "--seq", "64", "--device", "cpu", "--json"]
    proc = _subprocess("estimate", folder, "--mesh", "2x2", "--device-memory", "1MiB", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)  # stdout holds the JSON only
    want = _python_estimate(folder, (2, 2))
    assert got["peak_bytes"] == want.peak_bytes and got["parts"] == want.parts, got
    assert got["mesh_shape"] == [2, 2] and got["world_size"] == 4
    assert got["fits"] is False and got["device_memory_bytes"] == 2**20
    code, out, err = fsdp2(
        "estimate", os.path.join(folder, "config.json"), "--sweep", "2,4", *common
    )
    assert code == 0, err[-3000:]
    lines = json.loads(out)
    assert [x["world_size"] for x in lines] == [2, 4]
    assert lines[1]["peak_bytes"] == _python_estimate(folder, 4).peak_bytes
    code, out, _ = fsdp2("estimate", folder, "--sweep", "2,4", *common[:-1])
    assert code == 0 and len(out.splitlines()) == 4, out


def test_inputs_a_person_gets_wrong(tmp_path: Any) -> None:
    folder = _config(tmp_path)
    bogus = tmp_path / "bogus"
    bogus.mkdir()
    (bogus / "config.json").write_text('{"model_type": "no-such-model"}')
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["estimate", str(tmp_path / "missing")], 1, "no such file or folder"),
        (["estimate", str(empty)], 1, "a folder without a config.json"),
        (["estimate", str(bogus)], 1, "transformers cannot read this config"),
        (["estimate", folder, "--device-memory", "lots"], 1, "--device-memory must be"),
        (["estimate", folder, "--mesh", "3x"], 2, "--mesh must be N"),
        (["estimate", folder, "--sweep", "8,x"], 2, "--sweep takes world sizes"),
        (["estimate", folder, "--batch", "0"], 2, "--batch must be at least 1"),
        (["nonsense"], 2, "invalid choice"),
    ]
    if not torch.backends.cuda.is_built():  # planning for CUDA on a CPU-only torch
        cases.append((["estimate", folder, "--device", "cuda"], 1, "needs a torch built with"))
    for args, want, message in cases:
        code, _, err = fsdp2(*args)
        assert code == want and message in err, (args, err[-2000:])
        assert "Traceback" not in err, err
        if want == 1:  # an input to fix: one line (2 is argparse's usage and its message)
            assert len(err.strip().splitlines()) == 1, err


def test_readme_shows_a_tested_command() -> None:
    readme = open(os.path.join(ROOT, "README.md")).read()
    shown = [line for line in readme.splitlines() if line.startswith("fsdp2 estimate ")]
    assert shown and all(line in [cmd for cmd, _ in _page()] for line in shown), shown
