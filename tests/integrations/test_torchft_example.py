"""examples/torchft_train.py as docs/fault_tolerance.md launches it, with one group killed.

A torchft lighthouse (in process, with the page's settings: ``min_replicas`` 1, heartbeat
timeout 1 s) and two replica groups, each one ``torchrun --standalone --nproc_per_node 2``
(2 gloo CPU ranks) of the example. Once the groups have trained together, every process of
group 1 (its ``torchrun`` and both ranks) is SIGKILLed, and the group is started again with
the same command. Checked: both groups exit 0 and print the closing line; the survivor lost
at most one step and went on alone; the restarted group healed (joined at the survivor's
step, not at 0) and trained with it again; both groups end with the same parameters
(the digest the example prints). About 30-45 s on 2 cores: ``long`` (``make test-long``),
test_torchft.py's kill test checks the same behaviour in the main suite.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

pytest.importorskip("torchft", reason="torchft is a test extra")

from torchft._torchft import LighthouseServer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
TIMEOUT_S = 150
# The survivor's pace: slow enough that the killed group is restarted (Python, torch,
# torchrun: several seconds on a loaded machine) well before the survivor finishes.
STEPS, SLEEP_S = 60, 0.3
STEP = re.compile(r"^step (\d+): loss [\d.]+ \(replica groups: (\d)\)$", re.M)
DONE = re.compile(
    r"^replica group (\d): trained (\d+) steps with torchft replica groups, "
    r"parameters ([0-9a-f]+)$",
    re.M,
)


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (torchrun starts each rank in a session of its own, so
    killing torchrun's process group would leave the ranks running)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a group: its torchrun and every rank, at once (a lost node)."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


class _Groups:
    def __init__(self, tmp: str, lighthouse: str) -> None:
        self.tmp, self.lighthouse = tmp, lighthouse
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, tag: str, group: int) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "TORCHFT_LIGHTHOUSE": self.lighthouse,
            "REPLICA_GROUP_ID": str(group),
            "NUM_REPLICA_GROUPS": "2",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": ROOT,
        }
        argv = [TORCHRUN, "--standalone", "--nproc_per_node", "2", "examples/torchft_train.py"]
        argv += ["--steps", str(STEPS), "--sleep", str(SLEEP_S)]
        path = os.path.join(self.tmp, tag)
        with open(path + ".out", "w") as out, open(path + ".err", "w") as err:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=err)
        self.procs[tag] = proc
        return proc

    def out(self, tag: str) -> str:
        with open(os.path.join(self.tmp, tag + ".out")) as f:
            return f.read()

    def steps(self, tag: str) -> list[tuple[int, int]]:
        """``(step, replica groups)`` of each step line rank 0 of ``tag`` printed."""
        return [(int(s), int(g)) for s, g in STEP.findall(self.out(tag))]

    def report(self) -> str:
        text = []
        for tag in self.procs:
            with open(os.path.join(self.tmp, tag + ".err")) as f:
                err = f.read()
            text.append(f"--- {tag}.out\n{self.out(tag)[-2000:]}\n--- {tag}.err\n{err[-3000:]}")
        return "\n".join(text)


@contextmanager
def _groups(tmp: str) -> Iterator[_Groups]:
    # The lighthouse of docs/fault_tolerance.md: torchft_lighthouse --min_replicas 1
    # --quorum_tick_ms 100 --join_timeout_ms 10000 --heartbeat_timeout_ms 1000
    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=10000,
        quorum_tick_ms=100,
        heartbeat_timeout_ms=1000,
    )
    groups = _Groups(tmp, lighthouse.address())
    try:
        yield groups
    finally:
        for proc in groups.procs.values():
            if proc.poll() is None:
                _kill(proc)
        lighthouse.shutdown()


# long: test_torchft.py::test_a_killed_group_costs_one_step[pg-sync] checks the same (a killed
# group restarts, heals at the survivor's step, then equal parameters) with its worker
@pytest.mark.long
def test_killed_group_restarts_heals_and_ends_equal(tmp_path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    with _groups(str(tmp_path)) as job:

        def until(cond) -> None:
            while not cond():
                assert time.monotonic() < deadline, job.report()
                assert job.procs["a"].poll() is None, job.report()  # the survivor lives
                time.sleep(0.1)

        job.start("a", 0)
        doomed = job.start("b", 1)
        until(lambda: sum(g == 2 for _, g in job.steps("b")) >= 2)  # trained together
        _kill(doomed)
        killed_at = job.steps("a")[-1][0]
        job.start("c", 1)  # the same command again
        for tag in ("a", "c"):
            try:
                job.procs[tag].wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{tag} did not finish in {TIMEOUT_S} s\n{job.report()}")
            assert job.procs[tag].returncode == 0, job.report()

        a, c = job.steps("a"), job.steps("c")
        # the survivor: at most the step the kill landed in discarded, then on alone
        numbers = [s for s, _ in a]
        assert len(numbers) - len(set(numbers)) <= 1, a
        assert any(g == 1 for s, g in a if s > killed_at), (killed_at, a)
        # the restarted group healed: it joined at the survivor's step, not at 0
        assert "healed from a live replica group" in job.out("c"), job.report()
        assert c[0][0] > killed_at, (killed_at, c)
        assert any(g == 2 for _, g in c), c  # and the two trained together again
        assert a[-1][0] == c[-1][0] == STEPS, (a[-1], c[-1])
        done = {tag: DONE.findall(job.out(tag)) for tag in ("a", "c")}
        assert [d[:2] for d in done["a"]] == [("0", str(STEPS))], job.report()
        assert [d[:2] for d in done["c"]] == [("1", str(STEPS))], job.report()
        assert done["a"][0][2] == done["c"][0][2], done  # the same parameters
