"""Checkpoints of the example trainer (``examples/train.py``) when a save goes wrong.

2 gloo CPU ranks of their own (``faults.run_killing``), the tiny model of
``tests/test_example.py``; a reference run trains 6 steps, saves DCP checkpoints at steps 2,
4 and 6 and exports the final model with ``save_full_checkpoint`` (``--export``).

* Rank 1 SIGKILLed in the middle of writing the step-4 DCP checkpoint (after its first item):
  rank 0 raises within the bound; ``step_000002`` is complete and no ``step_000004`` is
  published (the trainer saves into ``step_000004.partial`` and renames it when every rank
  is done); ``--resume`` continues from step 2 with the reference run's losses, bitwise.
* Rank 0, the writer of the one-file export, SIGKILLed in the middle of
  ``save_full_checkpoint`` (``--export`` over the reference run's export): rank 1 raises;
  the older export is byte for byte what it was (the new one was staged in
  ``<dir>.partial``); the next export replaces it and leaves no stage.
* A full disk: the writes of one rank raise ``OSError(ENOSPC)`` (patched in that process
  only), rank 1's in the step-4 DCP save, then rank 0's in the export: every rank raises an
  error saying "No space left on device" (DCP's ``CheckpointException``; fsdp2's
  ``RuntimeError`` naming the rank);
  the earlier checkpoints and the older export are intact.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import re
import shutil
import sys
from typing import Any

import pytest
import torch.distributed.checkpoint.filesystem as dcp_fs
from faults import PG_TIMEOUT_S, die, run_killing

import fsdp2.checkpoint._files as ckpt_files

_EXAMPLES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"
)
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import train  # noqa: E402

TINY = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--lr", "1e-2"]
TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen jugs.\n"
BOUND_S = 2 * PG_TIMEOUT_S + 20


def _train(rank: int, argv: list[str], fault: str | None) -> dict[str, Any]:
    """``train.main(argv)`` on one rank, with ``fault`` injected on the rank that writes: rank
    1 for DCP (every rank writes), rank 0 for the export (a one-file checkpoint: file 0)."""
    if fault is not None and rank == (1 if fault.startswith("dcp") else 0):
        _inject(fault)
    with contextlib.redirect_stdout(io.StringIO()):
        summary = train.main(argv)
    return {"train": summary["history"]["train"], "resumed_from": summary["resumed_from"]}


def _inject(fault: str) -> None:
    """Patch this (forked, short-lived) process's checkpoint writes."""
    what, how = fault.split(":")

    def fail() -> None:
        if how == "kill":
            die()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if what == "dcp":
        write_item = dcp_fs._write_item

        def dcp_write(*args: Any, **kwargs: Any) -> Any:
            target = " ".join(str(getattr(a, "name", "")) for a in args)
            if "step_000004" in target:
                if how == "kill":
                    write_item(*args, **kwargs)  # one item on disk, then die
                fail()
            return write_item(*args, **kwargs)

        dcp_fs._write_item = dcp_write
    else:
        write = ckpt_files.StreamWriter.write
        calls = [0]

        def export_write(self: Any, name: str, tensor: Any) -> None:
            calls[0] += 1
            if calls[0] == 2:
                fail()
            write(self, name, tensor)

        ckpt_files.StreamWriter.write = export_write  # type: ignore[method-assign]


def _args(root: str, name: str, *extra: str) -> list[str]:
    return [
        *TINY,
        *("--data", os.path.join(root, "corpus.txt"), "--batch-size", "4", "--plot", "none"),
        *("--steps", "6", "--save-every", "2", "--out-dir", os.path.join(root, name), *extra),
    ]


def _digest(folder: str) -> dict[str, str]:
    out = {}
    for entry in sorted(os.listdir(folder)):
        with open(os.path.join(folder, entry), "rb") as f:
            out[entry] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[str, list[float]]:
    """The root folder (corpus, ``ref/`` with its checkpoints, ``export/``) and the losses."""
    root = str(tmp_path_factory.mktemp("ckpt_faults"))
    with open(os.path.join(root, "corpus.txt"), "w") as f:
        f.write(TEXT * 200)
    export = os.path.join(root, "export")
    results = run_killing(_train, _args(root, "ref", "--export", export), None)
    assert [r["status"] for r in results] == ["ok", "ok"], results
    assert "config.json" not in os.listdir(export)  # fsdp2's Llama has no HF config
    return root, results[0]["value"]["train"]


def _steps(root: str, name: str) -> list[str]:
    return sorted(os.listdir(os.path.join(root, name, "checkpoints")))


def test_killed_in_dcp_save_resumes_exactly(reference) -> None:
    root, losses = reference
    survivor, killed = run_killing(_train, _args(root, "crash"), "dcp:kill")
    assert killed["status"] == "killed", killed
    assert survivor["status"] == "raised" and survivor["seconds"] < BOUND_S, survivor
    published = [d for d in _steps(root, "crash") if not d.endswith(".partial")]
    assert published == ["step_000002"], _steps(root, "crash")
    assert os.path.isfile(os.path.join(root, "crash", "checkpoints", "step_000002", ".metadata"))
    resumed = run_killing(_train, _args(root, "crash", "--resume"), None)
    assert [r["status"] for r in resumed] == ["ok", "ok"], resumed
    value = resumed[0]["value"]
    assert value["resumed_from"] == 2, value
    assert value["train"] == losses, f"resumed losses {value['train']}, uninterrupted {losses}"
    assert _steps(root, "crash") == ["step_000002", "step_000004", "step_000006"]


def test_killed_in_export_keeps_older_export(reference) -> None:
    root, _ = reference
    export = os.path.join(root, "export_kill")
    shutil.copytree(os.path.join(root, "export"), export)
    before = _digest(export)
    argv = _args(root, "export_kill_run", "--steps", "2", "--save-every", "0", "--export", export)
    killed, survivor = run_killing(_train, argv, "export:kill")
    assert killed["status"] == "killed", killed
    assert survivor["status"] == "raised" and survivor["seconds"] < BOUND_S, survivor
    assert _digest(export) == before, "the older export changed"
    assert os.path.isdir(export + ".partial")  # the killed save's stage, never published
    again = run_killing(_train, argv, None)
    assert [r["status"] for r in again] == ["ok", "ok"], again
    assert _digest(export) != before and not os.path.exists(export + ".partial")


def test_disk_full(reference) -> None:
    root, _ = reference
    results = run_killing(_train, _args(root, "full"), "dcp:enospc")
    for rank, r in enumerate(results):
        assert r["status"] == "raised", f"rank {rank}: {r}"
        assert "No space left on device" in r["error"], f"rank {rank}: {r['error']}"
    assert [d for d in _steps(root, "full") if not d.endswith(".partial")] == ["step_000002"]
    export = os.path.join(root, "export_full")
    shutil.copytree(os.path.join(root, "export"), export)
    before = _digest(export)
    argv = _args(root, "export_full_run", "--steps", "2", "--save-every", "0", "--export", export)
    results = run_killing(_train, argv, "export:enospc")
    for rank, r in enumerate(results):
        assert r["status"] == "raised", f"rank {rank}: {r}"
        assert re.search(r"rank 0: OSError .*\[Errno 28\] No space left on device", r["error"]), r
        assert "nothing was published" in r["error"], r["error"]
    assert _digest(export) == before, "the older export changed"
    assert not os.path.exists(export + ".partial")
