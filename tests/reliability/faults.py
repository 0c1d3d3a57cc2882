"""Run a function on 2 fresh gloo ranks where one rank may die (SIGKILL) on purpose.

``tests/_harness.py`` reruns a task whose worker died (see its [Note: crashed workers]), so a
rank that kills itself needs processes of its own: ``run_killing`` forks one process per
rank (fast: torch is imported already), each forms its own gloo group with a short timeout
and runs ``fn(rank, *args)``; what each rank returned or raised comes back through a file.
A rank still running ``deadline`` seconds after the start is a hang: it is killed and
reported as ``"hung"``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["PG_TIMEOUT_S", "die", "run_killing"]

PG_TIMEOUT_S = 10.0  # the process group's timeout: a collective waits at most this long


def die() -> None:
    """SIGKILL this process: no Python cleanup, no exception, sockets closed by the kernel."""
    os.kill(os.getpid(), signal.SIGKILL)


def run_killing(
    fn: Callable[..., Any], *args: Any, world_size: int = 2, deadline: float = 90.0
) -> list[dict[str, Any]]:
    """Per rank: ``{"status": "ok" | "raised" | "killed" | "hung", "value" | "error": ...,
    "seconds": time from the start of ``fn`` to its end}``."""
    ctx = mp.get_context("fork")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_dir = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"fsdp2-faults-{os.getpid()}-{port}")
    os.makedirs(out_dir, exist_ok=True)
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, out_dir, fn, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    results: list[dict[str, Any]] = []
    for rank, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
            results.append({"status": "hung"})
            continue
        path = os.path.join(out_dir, f"rank{rank}.json")
        if p.exitcode == -signal.SIGKILL and not os.path.exists(path):
            results.append({"status": "killed"})
            continue
        with open(path) as f:
            results.append(json.load(f))
    return results


def _rank_main(
    rank: int, world_size: int, port: int, out_dir: str, fn: Callable[..., Any], args: Any
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )
    t0 = time.monotonic()
    try:
        result: dict[str, Any] = {"status": "ok", "value": fn(rank, *args)}
    except BaseException as e:  # SystemExit from argparse too
        result = {"status": "raised", "error": f"{type(e).__name__}: {e}"}
        result["traceback"] = traceback.format_exc()
    result["seconds"] = time.monotonic() - t0
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # no destroy_process_group: the peer may be dead
