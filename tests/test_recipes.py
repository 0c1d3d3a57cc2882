"""The recipes of docs/recipes.md, rl_weight_sync.md, replicate.md, pipelining.md,
mixed_precision.md, reproducibility.md, replica_optim.md, frameworks.md and compile.md run
exactly as shown.

Every command in the pages' ``sh`` blocks is run as written (``torchrun`` and ``accelerate``
are the venv's), in a fresh directory holding a link to ``examples/``, on 2 to 4 CPU ranks
(as the command says): each
exits 0 (no abort at exit either: see [Note: clean exit] in fsdp2/_core/support/clean_exit.py) and
prints its closing line. Every ``python`` block of docs/ marked as an excerpt of a script
(``<!-- excerpt: examples/x.py -->`` on the line before) is that script's text, verbatim;
the other ``python`` blocks of docs/huggingface.md run, in order, in one namespace, and print
what their comments show.
``examples/hf_finetune.py`` trains with the same losses and weights, bit for bit, with
transformers' activation checkpointing, torch's ``checkpoint_wrapper`` and none.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="transformers is a test extra")
pytest.importorskip("accelerate", reason="accelerate is a test extra")
if importlib.util.find_spec("peft") is None:  # (importing it here costs the collection ~1 s)
    pytest.skip("peft is a test extra", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "recipes.md")
PAGES = (
    PAGE,
    os.path.join(ROOT, "docs", "rl_weight_sync.md"),
    os.path.join(ROOT, "docs", "replicate.md"),
    os.path.join(ROOT, "docs", "pipelining.md"),
    os.path.join(ROOT, "docs", "mixed_precision.md"),
    os.path.join(ROOT, "docs", "reproducibility.md"),
    os.path.join(ROOT, "docs", "replica_optim.md"),
    os.path.join(ROOT, "docs", "frameworks.md"),
    os.path.join(ROOT, "docs", "compile.md"),
)
BIN = os.path.dirname(sys.executable)
TIMEOUT_S = 300

# The line each script prints last, when all its checks passed.
DONE = {
    "examples/hf_finetune.py": "from_pretrained gives the trained weights",
    "examples/lora_finetune.py": "PeftModel.from_pretrained gives the trained adapter",
    "examples/accelerate_train.py": "from_pretrained gives the trained weights",
    "examples/hf_trainer.py": "from_pretrained loads",
    "examples/rl_weight_sync.py": "the engine's generations match",
    "examples/replicate_mixed.py": "sharded and replicated modules trained like DDP",
    "examples/pipeline_train.py": "pipeline stages trained like the unsharded model",
    "examples/low_precision_wire.py": "the bf16 wire trained like the fp32 reduce-scatter",
    "examples/reproducible.py": "2 ranks and 1 rank trained to the same bits",
    "examples/replica_optim.py": "the optimizer sharded over the replicas trained like plain HSDP",
    "examples/framework_modes.py": "trained with --mode",
    "examples/traced_train.py": "the traced mode trained like eager fully_shard",
}


def _blocks(lang: str, page: str = PAGE) -> list[tuple[str, str]]:
    """``(the line before the block, its text)`` for each fenced ``lang`` block of ``page``."""
    text = open(page).read()
    pattern = re.compile(r"(?:^([^\n]*)\n)?```" + lang + r"\n(.*?)```", re.M | re.S)
    return [(m.group(1) or "", m.group(2)) for m in pattern.finditer(text)]


def _commands() -> list[str]:
    commands = []
    for _, block in [b for page in PAGES for b in _blocks("sh", page)]:
        joined = block.replace("\\\n", " ")
        commands += [line.strip() for line in joined.splitlines() if line.strip()]
    return commands


def _run(command: str, cwd: str) -> str:
    argv = shlex.split(command)
    assert argv[0] in ("torchrun", "accelerate"), command
    argv[0] = os.path.join(BIN, argv[0])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{out[-6000:]}"
    return out


# Each command's output and the directory it ran in, by command: a command two tests read
# (test_activation_checkpointing_keeps_losses reads hf_finetune.py's shown runs) runs once.
_RUNS: dict[str, tuple[str, str]] = {}


def _run_once(command: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """``command``'s output and its directory (fresh, holding a link to ``examples/``); run
    on the first call, read back on the later ones."""
    if command not in _RUNS:
        workdir = tmp_path_factory.mktemp("recipe")
        os.symlink(os.path.join(ROOT, "examples"), workdir / "examples")
        _RUNS[command] = (_run(command, str(workdir)), str(workdir))
    return _RUNS[command]


def test_page_shows_every_recipe() -> None:
    commands = _commands()
    for script in DONE:
        assert any(script in c for c in commands), f"no page runs {script}"


def test_excerpts_are_verbatim() -> None:
    excerpts = 0
    for page in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        for before, block in _blocks("python", page):
            m = re.search(r"<!-- excerpt: (\S+) -->", before)
            if m is None:
                continue
            excerpts += 1
            source = open(os.path.join(ROOT, m.group(1))).read()
            where = os.path.relpath(page, ROOT)
            assert block in source, f"{where}: this excerpt is not in {m.group(1)}:\n{block}"
    assert excerpts >= len(DONE)


def test_huggingface_page_runs() -> None:
    """docs/huggingface.md's own examples (the memory estimate): one process, no group."""
    namespace: dict = {}
    blocks = [
        b
        for before, b in _blocks("python", os.path.join(ROOT, "docs", "huggingface.md"))
        if "<!-- excerpt:" not in before
    ]
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/huggingface.md", "exec"), namespace)
    assert namespace["est"].peak_bytes > 0
    # `print(est)  # peak 1.70 GiB per rank, in ... ...`: the printed text holds the comment's
    shown = re.findall(r"^print\((\w+)\)  # (.*?)(?: \.\.\.)?$", "\n".join(blocks), re.M)
    assert shown, "the page shows what print(est) prints"
    for name, text in shown:
        assert text in str(namespace[name]), (text, str(namespace[name]))


@pytest.mark.parametrize("command", _commands())
def test_recipe_runs_as_shown(command: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    out, _ = _run_once(command, tmp_path_factory)
    script = next(s for s in DONE if s in command)
    assert DONE[script] in out, f"{command}: no '{DONE[script]}' in its output\n{out[-4000:]}"
    if script != "examples/hf_trainer.py":  # the Trainer logs its own way
        assert re.search(r"^step 0: loss \d", out, re.M), out[-4000:]


def test_activation_checkpointing_keeps_losses(tmp_path_factory: pytest.TempPathFactory) -> None:
    """transformers' switch, torch's checkpoint_wrapper and no checkpointing: the same
    losses (as printed) and the same trained weights, bitwise, after the script's default
    steps. The first two are docs/recipes.md's commands (their runs for
    test_recipe_runs_as_shown are read back, not rerun); ``--ac none`` runs here."""
    hf_finetune = "torchrun --standalone --nproc_per_node 2 examples/hf_finetune.py"
    commands = {"hf": hf_finetune, "wrapper": f"{hf_finetune} --ac wrapper"}
    assert set(commands.values()) <= set(_commands()), "the page no longer shows these"
    commands["none"] = f"{hf_finetune} --ac none"
    losses, weights = {}, {}
    for ac, command in commands.items():
        out, workdir = _run_once(command, tmp_path_factory)
        losses[ac] = re.findall(r"^step \d+: loss .*$", out, re.M)
        assert len(losses[ac]) >= 2, losses  # past the first step: optimizer state in play
        with open(os.path.join(workdir, "runs", "hf_finetune", "model.safetensors"), "rb") as f:
            weights[ac] = f.read()
    assert losses["hf"] == losses["wrapper"] == losses["none"], losses
    assert weights["hf"] == weights["wrapper"] == weights["none"]
