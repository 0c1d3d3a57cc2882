"""fsdp2 under torchft (``fsdp2.integrations.torchft.wire``), with the real torchft 0.2.0 and
its lighthouse, on CPU (gloo, 127.0.0.1): 2 replica groups x 2 ranks, each rank a process
running ``torchft_worker.py`` (one JSON line per step: loss, participants, a digest of the
rank's shards). Every process a test starts is killed when it ends.

* No fault (synchronous quorum): the groups' shards are bitwise equal after every step, and
  fsdp2's losses and shards equal torch's FSDP2 wired the way torchft's own test wires it.
* No fault, asynchronous quorum (the quorum thread reads the state during a forward): equal
  groups. (torch's FSDP2 with the same local-shard state functions fails there: the quorum
  thread finds the unsharded parameters registered mid-forward.) ``long``: the MoE case runs
  the asynchronous quorum too.
* An EP + FSDP MoE (two parameter groups per block: the hook runs on both), asynchronous
  quorum: equal groups.
* torchft's ``LocalSGD`` (``wire(..., average_gradients=False)``): equal groups after every
  sync, and the same losses as torch's FSDP2 under it.
* One group SIGKILLed mid-run (HTTP transport with the asynchronous quorum, PG transport with
  the synchronous one): the survivor raises nothing, loses at most the step the kill lands in
  and goes on with one participant; the group restarted heals from it, and the two are
  bitwise equal at every step they share afterwards. (HTTP with the asynchronous quorum:
  ``long``, as are LocalSGD and test_torchft_example.py, the same kill through the example.)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("torchft", reason="torchft is a test extra")

from torchft._torchft import LighthouseServer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "integrations", "torchft_worker.py")
TIMEOUT_S = 90


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Job:
    """The lighthouse and the replica groups' processes of one test."""

    def __init__(self, tmp: str, min_replicas: int) -> None:
        self.tmp = tmp
        os.makedirs(tmp, exist_ok=True)
        self.lighthouse = LighthouseServer(
            bind="[::]:0",
            min_replicas=min_replicas,
            join_timeout_ms=500,
            quorum_tick_ms=50,
            heartbeat_timeout_ms=1000,
        )
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, group: int, tag: str, *args: str) -> list[subprocess.Popen[bytes]]:
        """One replica group: 2 ranks, output under ``tag``."""
        master = str(_port())
        procs = []
        for rank in range(2):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": master,
                "TORCHFT_LIGHTHOUSE": self.lighthouse.address(),
                "REPLICA_GROUP_ID": str(group),
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": ROOT,
            }
            path = os.path.join(self.tmp, f"{tag}{rank}")
            with open(path + ".out", "w") as out, open(path + ".err", "w") as err:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, WORKER, *args], env=env, stdout=out, stderr=err
                    )
                )
        self.procs += procs
        return procs

    def lines(self, tag: str, rank: int) -> list[dict[str, Any]]:
        with open(os.path.join(self.tmp, f"{tag}{rank}.out")) as f:
            return [json.loads(line) for line in f if line.startswith("{")]

    def wait(self, procs: list[subprocess.Popen[bytes]], deadline: float) -> None:
        for i, p in enumerate(procs):
            p.wait(timeout=max(deadline - time.monotonic(), 1))
            assert p.returncode == 0, f"process {i} exited {p.returncode}: {self.errors()}"

    def errors(self) -> str:
        out = []
        for name in sorted(os.listdir(self.tmp)):
            if name.endswith(".err"):
                with open(os.path.join(self.tmp, name)) as f:
                    text = [line for line in f if "Error" in line or "Traceback" in line]
                out.append(f"{name}: {''.join(text[-5:])}")
        return "\n".join(out)


@contextmanager
def _job(tmp_path: Any, min_replicas: int) -> Iterator[_Job]:
    job = _Job(str(tmp_path), min_replicas)
    try:
        yield job
    finally:
        for p in job.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        job.lighthouse.shutdown()


def _run_two_groups(tmp_path: Any, *args: str) -> dict[tuple[int, int], list[dict[str, Any]]]:
    with _job(tmp_path, min_replicas=2) as job:
        procs = job.start(0, "g0", *args) + job.start(1, "g1", *args)
        job.wait(procs, time.monotonic() + TIMEOUT_S)
        return {(g, r): job.lines(f"g{g}", r) for g in range(2) for r in range(2)}


def _assert_groups_equal(out: dict[tuple[int, int], list[dict[str, Any]]], steps: int) -> None:
    for rank in range(2):
        a, b = out[(0, rank)], out[(1, rank)]
        assert [x["after"] for x in a] == [x["after"] for x in b] == list(range(1, steps + 1))
        assert all(x["participants"] == 2 for x in a + b), (a, b)
        for x, y in zip(a, b, strict=True):
            assert x["digest"] == y["digest"], (rank, x, y)


def test_no_fault_groups_equal_and_like_torch(tmp_path: Any) -> None:
    ours = _run_two_groups(tmp_path / "fsdp2", "--steps", "3", "--sync-quorum")
    _assert_groups_equal(ours, 3)
    theirs = _run_two_groups(
        tmp_path / "torch", "--steps", "3", "--sync-quorum", "--engine", "torch"
    )
    _assert_groups_equal(theirs, 3)
    for key, lines in ours.items():
        for x, y in zip(lines, theirs[key], strict=True):
            assert x["loss"] == pytest.approx(y["loss"], rel=1e-5), (key, x, y)


# long: test_no_fault_moe runs fsdp2 under the asynchronous quorum too (the state read by the
# quorum thread mid-forward at the first step's init sync), on a model with two groups a block
@pytest.mark.long
def test_no_fault_async_quorum(tmp_path: Any) -> None:
    _assert_groups_equal(_run_two_groups(tmp_path, "--steps", "3"), 3)


def test_no_fault_moe(tmp_path: Any) -> None:
    _assert_groups_equal(_run_two_groups(tmp_path, "--steps", "3", "--model", "moe"), 3)


@pytest.mark.long  # docs/testing.md: LocalSGD's averaging is torchft's; the hook is off for it
def test_local_sgd_like_torch(tmp_path: Any) -> None:
    # torchft's LocalSGD (parameters averaged every 2 local steps; wire(...,
    # average_gradients=False) for the healing state): the groups are equal after every
    # sync, and fsdp2 trains like torch's FSDP2 under it.
    runs = {
        engine: _run_two_groups(
            tmp_path / engine, "--steps", "3", "--local-sgd", "2", "--engine", engine
        )
        for engine in ("fsdp2", "torch")
    }
    for engine, out in runs.items():
        for rank in range(2):
            a, b = out[(0, rank)], out[(1, rank)]
            assert [x["after"] for x in a] == [x["after"] for x in b], engine
            synced = [(x, y) for x, y in zip(a, b, strict=True) if x["step"] % 2 == 0]
            assert len(synced) == 3, (engine, a)
            for x, y in synced:
                assert x["digest"] == y["digest"], (engine, rank, x, y)
    for key, lines in runs["fsdp2"].items():
        for x, y in zip(lines, runs["torch"][key], strict=True):
            assert x["loss"] == pytest.approx(y["loss"], rel=1e-5), (key, x, y)


@pytest.mark.parametrize(
    "transport, quorum",
    [pytest.param("http", "async", marks=pytest.mark.long), ("pg", "sync")],
    ids=["http-async", "pg-sync"],
)
def test_a_killed_group_costs_one_step(tmp_path: Any, transport: str, quorum: str) -> None:
    stop = str(tmp_path / "stop")
    args = ["--steps", "200", "--step-sleep", "0.1", "--stop-file", stop, "--transport", transport]
    args += ["--sync-quorum"] if quorum == "sync" else []
    deadline = time.monotonic() + TIMEOUT_S
    with _job(tmp_path, min_replicas=1) as job:
        survivor = job.start(0, "a", *args)
        doomed = job.start(1, "b", *args)

        def until(cond: Any) -> None:
            while not cond():
                assert time.monotonic() < deadline, job.errors()
                assert all(p.poll() in (None, 0) for p in survivor), job.errors()
                time.sleep(0.05)

        def together(tag: str, n: int) -> bool:  # n steps with both groups in the quorum
            lines = job.lines(tag, 0)
            return sum(x["participants"] == 2 for x in lines) >= n

        until(lambda: together("b", 2))
        for p in doomed:
            p.send_signal(signal.SIGKILL)
        killed_at = job.lines("a", 0)[-1]["after"]
        until(lambda: any(x["participants"] == 1 for x in job.lines("a", 0)[killed_at - 1 :]))
        back = job.start(1, "c", *args)
        until(lambda: together("c", 3))
        open(stop, "w").close()
        job.wait(survivor + back, deadline)
        for rank in range(2):
            a, c = job.lines("a", rank), job.lines("c", rank)
            # the survivor: never raised, at most the step the kill landed in discarded
            lost = [x for x in a if x["after"] == x["step"]]
            assert len(lost) <= 1, lost
            assert any(x["participants"] == 1 for x in a if x["step"] >= killed_at), a
            # the restarted group healed: it joined at the survivor's step, not at 0
            assert c[0]["after"] > 1, c[0]
            shared = {x["after"]: x for x in a if x["participants"] == 2}
            both = [(shared[y["after"]], y) for y in c if y["after"] in shared]
            assert len(both) >= 3, (a, c)
            for x, y in both:
                assert x["digest"] == y["digest"], (rank, x, y)


def _wire_errors() -> None:
    import torch
    from helpers import world_mesh

    from fsdp2 import fully_shard
    from fsdp2.integrations.torchft import wire
    from fsdp2.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4))
    for block in model.layers:
        fully_shard(block, mesh=world_mesh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # before the root is sharded
    with pytest.raises(ValueError, match="tok_embeddings.weight.* not managed by fully_shard"):
        wire(None, model, opt)  # raises before the manager is used
    fully_shard(model, mesh=world_mesh())
    with pytest.raises(ValueError, match=r"optimizer's param_groups\[0\]\['params'\]\[0\]"):
        wire(None, model, opt)


def test_wire_errors_before_anything_is_set() -> None:
    from _harness import run_on_ranks

    run_on_ranks(2, _wire_errors)
