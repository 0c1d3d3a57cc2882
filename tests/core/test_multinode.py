"""Two "nodes" on one machine: two ``torchrun`` agents joined by the c10d rendezvous.

Multi-node jobs fail in ways a single-process-group test never sees: how torchrun numbers the
ranks of several agents, whether the HSDP mesh really puts the shard groups inside a node and the
replicate groups across nodes, and whether training through such a launch gives the numbers of
a plain one. This launches ``tests/multinode_train.py`` twice:

- as two torchrun agents (``--nnodes 2 --nproc_per_node 2``, c10d rendezvous on 127.0.0.1),
  each the "node" of two ranks, HSDP mesh ``(replicate=2, shard=2)``;
- as one ``torchrun --standalone --nproc_per_node 4`` on the same mesh.

and checks that each agent's workers got one ``GROUP_RANK`` and the consecutive global ranks
``2 * GROUP_RANK + LOCAL_RANK``, that the shard groups are the two nodes and the replicate groups
cross them (the script asserts this too), and that both launches give bitwise the same per-step
losses and final parameters: the same ranks run the same gloo collectives in the same groups,
only the rendezvous differs. ``docs/parallelism.md`` ("Running on several nodes") describes the
same launch on real nodes.

Everything runs in subprocesses (~10 s per launch on 2 cores, most of it importing torch), with
a timeout; on any failure both agents, and every worker they started, are killed and the
agents' output is in the assertion message.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

_TESTS_DIR = Path(__file__).resolve().parent.parent  # tests/ (this file is in tests/core/)
_SCRIPT = _TESTS_DIR / "multinode_train.py"
_TIMEOUT_S = 240.0  # per launch; a healthy one takes ~10 s
_TOKEN_VAR = "FSDP2_MULTINODE_TEST_TOKEN"  # marks every process one launch started


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env(token: str, agent: str) -> dict[str, str]:
    """The environment of one agent (its workers inherit it)."""
    env = dict(os.environ)
    env.pop("TORCHELASTIC_RUN_ID", None)  # in case pytest itself runs under torchrun
    root = str(_TESTS_DIR.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"  # also silences torchrun's warning that it sets it
    if sys.platform == "linux":
        env["GLOO_SOCKET_IFNAME"] = "lo"  # never leave the loopback device
    env["FSDP2_TEST_AGENT"] = agent  # the worker records it: which agent started it
    env[_TOKEN_VAR] = token
    return env


def _processes_with_token(token: str) -> list[int]:
    """Our processes (agents' workers included) whose environment holds ``token``."""
    needle = f"{_TOKEN_VAR}={token}".encode()
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:  # gone, or not ours
            pass
    return pids


def _killpg(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the agent's own group: start_new_session=True
    except ProcessLookupError:  # exited meanwhile
        pass


def _kill_all(agents: dict[str, subprocess.Popen[bytes]], token: str) -> None:
    """SIGTERM the agents (torchrun forwards it to its workers), then SIGKILL what is left:
    the agents' process groups and any worker still carrying ``token`` (torchrun starts each
    worker in a session of its own, out of the agent's process group)."""
    for proc in agents.values():
        if proc.poll() is None:
            _killpg(proc, signal.SIGTERM)
    deadline = time.monotonic() + 10.0
    for proc in agents.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in agents.values():
        if proc.poll() is None:
            _killpg(proc, signal.SIGKILL)
            proc.wait()
    for pid in _processes_with_token(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _launch(out: Path, agents: dict[str, list[str]]) -> None:
    """Run one torchrun agent per entry of ``agents`` (name -> torchrun options) on
    ``multinode_train.py out``; return when all exited 0, else raise ``AssertionError`` with
    every agent's output (its workers' output included) after killing what still runs."""
    out.mkdir()
    token = uuid.uuid4().hex
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {name: out / f"agent_{name}.log" for name in agents}
    failure = None
    try:
        for name, options in agents.items():
            cmd = [sys.executable, "-m", "torch.distributed.run", *options, str(_SCRIPT), str(out)]
            with open(logs[name], "wb") as log:
                procs[name] = subprocess.Popen(
                    cmd,
                    env=_env(token, name),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
        deadline = time.monotonic() + _TIMEOUT_S
        while failure is None and any(p.poll() is None for p in procs.values()):
            failed = {n: p.returncode for n, p in procs.items() if p.poll() not in (None, 0)}
            if failed:
                failure = f"agents exited with {failed}"
            elif time.monotonic() > deadline:
                failure = f"the launch did not finish within {_TIMEOUT_S:g} s"
            else:
                time.sleep(0.2)
        if failure is None:
            failed = {n: p.returncode for n, p in procs.items() if p.returncode != 0}
            failure = f"agents exited with {failed}" if failed else None
    finally:
        _kill_all(procs, token)
    if failure is not None:
        outputs = "\n\n".join(
            f"--- agent {name} ({' '.join(agents[name])}):\n"
            + (logs[name].read_text(errors="replace") if logs[name].exists() else "(no log)")
            for name in agents
        )
        raise AssertionError(f"torchrun launch in {out} failed: {failure}\n\n{outputs}")


def _results(out: Path) -> dict[str, Any]:
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    result = json.loads((out / "result.json").read_text())
    params = torch.load(out / "params.pt", weights_only=True)
    return {"ranks": ranks, "losses": result["losses"], "params": params, "result": result}


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Both launches, each run once for the module's tests."""
    tmp = tmp_path_factory.mktemp("multinode")
    port = _free_port()
    rdzv = [
        "--nnodes", "2", "--nproc_per_node", "2", "--max_restarts", "0",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
        "--rdzv_id", f"fsdp2-test-{uuid.uuid4().hex[:8]}",
        "--local_addr", "127.0.0.1",  # node 0's MASTER_ADDR for all workers (else its FQDN)
    ]  # fmt: skip
    # Both agents run on the rendezvous endpoint's host, so both would try to host the c10d
    # store; the loser of that race falls back to a client after a failed bind. Say which.
    two_nodes = {
        "a": [*rdzv, "--rdzv_conf", "is_host=1,join_timeout=60"],
        "b": [*rdzv, "--rdzv_conf", "is_host=0,join_timeout=60"],
    }
    _launch(tmp / "two_nodes", two_nodes)
    _launch(tmp / "one_node", {"solo": ["--standalone", "--nproc_per_node", "4"]})
    return {"two_nodes": _results(tmp / "two_nodes"), "one_node": _results(tmp / "one_node")}


def test_agents_are_nodes(launches: dict[str, dict[str, Any]]) -> None:
    """Each agent's two workers share a ``GROUP_RANK`` and hold global ranks ``2g`` and
    ``2g + 1``; the two agents are nodes 0 and 1; each shard group is one node and each
    replicate group one rank of each node."""
    ranks = launches["two_nodes"]["ranks"]
    by_agent: dict[str, list[dict[str, Any]]] = {}
    for info in ranks:
        by_agent.setdefault(info["agent"], []).append(info)
    assert sorted(by_agent) == ["a", "b"], ranks
    nodes = []
    for agent, infos in by_agent.items():
        (node,) = {info["env"]["GROUP_RANK"] for info in infos}
        nodes.append(node)
        got = sorted((info["env"]["LOCAL_RANK"], info["env"]["RANK"]) for info in infos)
        assert got == [(0, 2 * node), (1, 2 * node + 1)], (agent, infos)
        assert all(info["env"]["LOCAL_WORLD_SIZE"] == 2 for info in infos), infos
    assert sorted(nodes) == [0, 1], ranks
    for info in ranks:
        node = info["env"]["GROUP_RANK"]
        assert info["shard_ranks"] == [2 * node, 2 * node + 1], info
        assert info["shard_nodes"] == [node, node], info
        column = info["env"]["RANK"] % 2
        assert info["replicate_ranks"] == [column, column + 2], info
        assert info["replicate_nodes"] == [0, 1], info
    assert launches["two_nodes"]["result"]["num_nodes"] == 2
    assert launches["one_node"]["result"]["num_nodes"] == 1


def test_two_nodes_train_like_one(launches: dict[str, dict[str, Any]]) -> None:
    """The same losses and final parameters, bitwise, as the 4-process standalone run: the
    same ranks run the same collectives in the same groups (gloo sums in a fixed order)."""
    two, one = launches["two_nodes"], launches["one_node"]
    losses = two["losses"]
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.3, f"did not train: {losses}"
    assert losses == one["losses"], f"two nodes: {losses}\none node:  {one['losses']}"
    assert sorted(two["params"]) == sorted(one["params"])
    for name, value in two["params"].items():
        assert torch.equal(value, one["params"][name]), name
