"""Multi-process runner for distributed tests: CPU, gloo, 127.0.0.1.

``run_on_ranks(world_size, fn, *args)`` runs ``fn(*args)`` on every rank of a gloo process
group and returns the per-rank results in rank order. See [Note: worker pools].

[Note: worker pools]
Starting processes and forming a process group costs seconds on a 2-core machine, so each
world size keeps a pool of persistent workers (daemonic, one thread for torch, default
process group initialized once). Workers fork from a server process that imported torch
once ('forkserver' context, ``_PRELOAD``): a pool starts in under 0.1 s, where spawned
interpreters took 2 to 9 s each importing torch (about 20 pools a suite: 80 s); each worker
takes the parent's current environment and ``sys.path``, as a spawned one would. Under
``make coverage`` workers are spawned (coverage.py measures a spawned worker from its start).
A task is ``(fn, args)`` pickled once in
the parent, so ``fn`` must be a module-level function, pickled by reference; workers import
test modules by the name pytest gave them (pytest puts each test file's folder, e.g.
``tests/core/``, on ``sys.path``, which the workers take; ``tests/`` itself is
added in ``_worker_main``). Results travel back pickled, so return plain data or CPU
tensors (detached; a DTensor does not pickle: return ``.full_tensor()`` or ``.to_local()``).

A task that fails or times out discards its pool: after one rank raised, the others may be
blocked in a collective, and the collective sequence differs between ranks. The next call
builds a fresh pool. A worker exits when its parent dies, even mid-collective, and ignores
SIGINT, so Ctrl-C in pytest leaves no process behind.

[Note: crashed workers]
A worker killed by a signal (e.g. a segfault inside gloo's C++ threads; CI saw one once, in
a test that passes hundreds of times in a row) fails its task without any Python error. Such
a task is rerun once on a fresh pool and a ``RuntimeWarning`` with the crashed rank's stacks
is emitted (pytest lists it in the summary). A second crash, a Python error or a timeout
fails the test as usual: a real bug still shows, a rare platform crash does not turn CI red.

[Note: worker threads]
Destroying a gloo process group stops its threads only once nothing refers to it any more,
and each gloo group kept alive holds a few threads whose network loops wake up: 4 idle
workers holding 100 such groups each (300 threads) burn 0.37 of a core between tasks. Over
the main suite a 4-rank worker once gathered about 640 threads, the load average rose above
30 on 2 cores, and a recipe launched with torchrun took 36 s instead of 7. The cause was
this harness's ``gc.freeze()`` (below): it ran right after a task that imported modules,
while that task's meshes were still alive (its groups are destroyed only when the next task
starts, and a mesh fsdp2 used holds groups in its cache, in a reference cycle); frozen, they
stayed when they became garbage a moment later, and their groups' threads with them. So the
freeze now waits for the start of the next task, after its groups are destroyed and a
collection ran (``tests/test_harness.py`` checks the threads stay put). As a guard against
any other holder (some tasks still leave a group's threads for a while), a pool whose worker
holds more than ``_MAX_WORKER_THREADS`` threads after a task is discarded (a new one starts
for the next task, in under 0.1 s: [Note: worker pools]); ``FSDP2_HARNESS_LOG`` records
each such drop with the threads by name.

Between tasks a worker destroys the process groups the previous task created (safe then:
the parent sends a task only once every rank finished the last one), restores torch's
default dtype and grad mode, and runs ``gc.collect()``; objects from imports done at startup
are frozen (``gc.freeze()``), so that collection takes ~1 ms, not ~140 ms, and so are those
of modules a task imported (a test file, transformers, ...): the task after one that imported
any first collects and freezes again. Without that, the order of the test
files decided the suite's time: once a heavy import happened early (the checkpoint tests
import transformers), every later task's collection walked its objects, and the whole suite
took 8 min 30 s instead of 7 min 20 s. Seeding RNGs is the test's job.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["run_on_ranks"]

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_START_TIMEOUT_S = 120.0  # spawning and importing torch; 4 ranks on 2 cores take a few s
_FAILURE_GRACE_S = 3.0  # after one rank fails, how long to wait for the others to report
_STACK_DUMP_WAIT_S = 2.0
_MAX_WORKER_THREADS = 64  # see [Note: worker threads]

_SIGNAL_DEATH = "worker died (exit code -"  # killed by a signal, e.g. SIGSEGV
_Outcome = tuple[str, Any]  # ("ok", value) or ("error", traceback text)


def _log(event: str, world_size: int, what: str) -> None:
    """A line of ``FSDP2_HARNESS_LOG`` (benchmarks/suite.py --pools reads it): ``spawn <world
    size> <seconds> <test>``, or ``drop <world size> <threads by name> <test>`` for a pool
    discarded for its threads ([Note: worker threads])."""
    log = os.environ.get("FSDP2_HARNESS_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(log, "a") as f:
            f.write(f"{event} {world_size} {what} {test}\n")


def run_on_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 180.0
) -> list[Any]:
    """Run ``fn(*args)`` on every rank of a ``world_size``-rank gloo group; return the results.

    The default process group is initialized in each worker before ``fn`` runs. ``fn`` must be
    a module-level function and ``args`` and return values must pickle. Workers are reused
    across calls; see [Note: worker pools].

    Returns:
        ``fn``'s return values in rank order.

    Raises:
        AssertionError: if any rank raised (the message holds each failing rank's traceback),
            died, or did not finish within ``timeout`` seconds (the message names those ranks
            and holds their Python stacks). The pool is discarded in these cases.
        TypeError: if ``fn`` or ``args`` do not pickle (lambdas, local functions).
    """
    try:
        payload = pickle.dumps((fn, args))
    except Exception as e:
        raise TypeError(
            f"run_on_ranks: cannot pickle {fn!r} and its args ({e}); fn must be a module-level "
            "function and args plain data or tensors"
        ) from e
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
    for attempt in range(2):
        pool = _get_pool(world_size)
        for conn in pool.conns:
            conn.send_bytes(payload)
        try:
            outcomes, pending = pool.collect(timeout)
        except BaseException:  # e.g. KeyboardInterrupt: the task is in flight on the workers
            _discard_pool(world_size)
            raise
        errors = {rank: out[1] for rank, out in outcomes.items() if out[0] != "ok"}
        if not errors and not pending:
            if pool.threads() > _MAX_WORKER_THREADS:  # see [Note: worker threads]
                _log("drop", world_size, pool.thread_names())
                _discard_pool(world_size)
            return [outcomes[rank][1] for rank in range(world_size)]
        crashed = [rank for rank, tb in errors.items() if tb.startswith(_SIGNAL_DEATH)]
        if attempt == 0 and crashed:
            # See [Note: crashed workers]: rerun once on a fresh pool, loudly.
            _discard_pool(world_size)
            warnings.warn(
                f"run_on_ranks({world_size}, {name}): ranks {crashed} crashed "
                f"({errors[crashed[0]].splitlines()[0]}); reran the task on fresh workers. "
                f"Rank {crashed[0]}'s stacks:\n{errors[crashed[0]]}",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        break
    stacks = pool.dump_stacks(pending)
    _discard_pool(world_size)
    parts = [f"run_on_ranks(world_size={world_size}, fn={name}) failed"]
    parts += [f"rank {rank} failed:\n{tb}" for rank, tb in sorted(errors.items())]
    if pending:
        why = "after another rank failed" if errors else f"within the timeout of {timeout:g} s"
        parts.append(f"ranks {pending} did not finish {why}")
        parts += [f"rank {rank} Python stacks:\n{stacks[rank]}" for rank in pending]
    raise AssertionError("\n\n".join(parts))


def _context() -> Any:
    """'forkserver' with torch preloaded ([Note: worker pools]); 'spawn' under coverage.py
    (``make coverage``), which measures spawned workers from their start."""
    if "coverage" in sys.modules:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


# What the fork server imports once, for every worker forked from it.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp"]
_PRELOAD += ["torch.testing"]


class _Pool:
    """``world_size`` persistent worker processes sharing one gloo process group."""

    def __init__(self, world_size: int) -> None:
        ctx = _context()
        self.world_size = world_size
        self.stack_dir = tempfile.mkdtemp(prefix=f"fsdp2-harness-ws{world_size}-")
        port = _free_port()
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(
                    rank,
                    world_size,
                    port,
                    child_conn,
                    self.stack_path(rank),
                    os.getpid(),
                    dict(os.environ),
                    list(sys.path),
                ),
                name=f"fsdp2-test-ws{world_size}-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            self.conns.append(parent_conn)
            self.procs.append(proc)
        outcomes, pending = self.collect(_START_TIMEOUT_S)
        errors = [f"rank {r}: {out[1]}" for r, out in sorted(outcomes.items()) if out[0] != "ok"]
        if errors or pending:
            self.close()
            raise AssertionError(
                f"harness: starting {world_size} gloo workers failed; not ready: {pending}\n"
                + "\n".join(errors)
            )

    def stack_path(self, rank: int) -> str:
        return os.path.join(self.stack_dir, f"rank{rank}.stacks")

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def threads(self) -> int:
        """The most threads one worker holds (0 where /proc cannot tell)."""
        most = 0
        for proc in self.procs:
            try:
                most = max(most, len(os.listdir(f"/proc/{proc.pid}/task")))
            except OSError:
                pass
        return most

    def thread_names(self) -> str:
        """Rank 0's threads by name, most first (``gloo_tcp_loop*12 ...``)."""
        names: dict[str, int] = {}
        try:
            for tid in os.listdir(f"/proc/{self.procs[0].pid}/task"):
                with open(f"/proc/{self.procs[0].pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
                names[name] = names.get(name, 0) + 1
        except OSError:
            pass
        return ",".join(f"{n}*{c}" for n, c in sorted(names.items(), key=lambda x: -x[1]))

    def collect(self, timeout: float) -> tuple[dict[int, _Outcome], list[int]]:
        """Wait for one reply per rank; stop early ``_FAILURE_GRACE_S`` after a failure.

        Returns the outcomes received and the ranks that did not reply (in rank order).
        """
        deadline = time.monotonic() + timeout
        outcomes: dict[int, _Outcome] = {}
        while len(outcomes) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            pending = [r for r in range(self.world_size) if r not in outcomes]
            waitables = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            ready = wait(waitables, timeout=remaining)
            for rank in pending:
                if self.conns[rank] in ready or self.procs[rank].sentinel in ready:
                    outcomes[rank] = self._receive(rank)
                if rank in outcomes and outcomes[rank][0] != "ok":
                    deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
        return outcomes, [r for r in range(self.world_size) if r not in outcomes]

    def _receive(self, rank: int) -> _Outcome:
        conn, proc = self.conns[rank], self.procs[rank]
        if conn.poll():  # a reply sent just before the worker exited is still buffered
            try:
                outcome: _Outcome = pickle.loads(conn.recv_bytes())
                return outcome
            except (EOFError, OSError):
                pass
            except Exception:
                return (
                    "error",
                    f"cannot unpickle the reply in the parent:\n{traceback.format_exc()}",
                )
        proc.join(timeout=5)
        stacks = self._read_stacks(rank) or "(no stack dumped; its stderr may say why)"
        return ("error", f"worker died (exit code {proc.exitcode}):\n{stacks}")

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask the given ranks' workers to write their Python stacks (SIGUSR1) and read them."""
        for rank in ranks:
            pid = self.procs[rank].pid
            if pid is not None and self.procs[rank].is_alive():
                os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + _STACK_DUMP_WAIT_S
        while time.monotonic() < deadline and not all(self._read_stacks(r) for r in ranks):
            time.sleep(0.05)
        time.sleep(0.1)  # let a dump in progress finish
        return {rank: self._read_stacks(rank) or "(no stack dumped)" for rank in ranks}

    def _read_stacks(self, rank: int) -> str:
        try:
            with open(self.stack_path(rank)) as f:
                return f.read()
        except OSError:
            return ""

    def close(self) -> None:
        """Kill every worker (they hold nothing worth flushing) and remove the stack files."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=10)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.stack_dir, ignore_errors=True)


_pools: dict[int, _Pool] = {}


def _get_pool(world_size: int) -> _Pool:
    pool = _pools.get(world_size)
    if pool is not None and not pool.alive():
        _discard_pool(world_size)
        pool = None
    if pool is None:
        start = time.monotonic()
        pool = _pools[world_size] = _Pool(world_size)
        _log("spawn", world_size, f"{time.monotonic() - start:.2f}")
    return pool


def _discard_pool(world_size: int) -> None:
    pool = _pools.pop(world_size, None)
    if pool is not None:
        pool.close()


@atexit.register
def _close_all_pools() -> None:
    for world_size in list(_pools):
        _discard_pool(world_size)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------------------------------------
# Worker side


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    conn: Connection,
    stack_path: str,
    parent_pid: int,
    environ: dict[str, str],
    path: list[str],
) -> None:
    # The fork server started with the parent's environment and sys.path of that moment;
    # a worker takes them as they are now, as a spawned one would.
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = path
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns our lifetime
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    stack_file = open(stack_path, "w")  # faulthandler writes here until exit
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    if _TESTS_DIR not in sys.path:
        sys.path.insert(0, _TESTS_DIR)
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # never leave the loopback device
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        # Modules most tests import, loaded once so that gc.freeze() covers them.
        import torch.distributed.fsdp  # noqa: F401
        import torch.distributed.tensor  # noqa: F401
        import torch.testing  # noqa: F401

        gc.freeze()  # the per-task gc.collect() then skips import-time objects (~140 ms -> ~1)
        reply = pickle.dumps(("ok", os.getpid()))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    conn.send_bytes(reply)
    default_dtype = torch.get_default_dtype()
    freeze = False
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:  # the parent closed the pool
            break
        imported = len(sys.modules)
        reply = _run_task(payload, freeze)
        torch.set_default_dtype(default_dtype)
        torch.set_grad_enabled(True)
        gc.collect()
        freeze = len(sys.modules) != imported  # (a test file, transformers)
        _save_coverage()
        conn.send_bytes(reply)
    dist.destroy_process_group()


def _save_coverage() -> None:
    """Under ``make coverage`` (coverage.py measuring this worker): write what the task ran,
    since the pool is killed, not exited, when pytest ends."""
    coverage = sys.modules.get("coverage")
    current = getattr(getattr(coverage, "Coverage", None), "current", None)
    cov = current() if current is not None else None
    if cov is not None:
        cov.save()


def _run_task(payload: bytes, freeze: bool) -> bytes:
    """Run one pickled ``(fn, args)``; return the pickled outcome. Locals die on return.
    First the last task's groups are destroyed and, if it imported modules (``freeze``),
    what is alive is frozen: only now, once its groups are gone, is its garbage collectable
    ([Note: worker threads])."""
    try:
        _destroy_subgroups()
        if freeze:
            gc.collect()
            gc.freeze()
        fn, args = pickle.loads(payload)
        return pickle.dumps(("ok", fn(*args)))
    except BaseException:  # SystemExit and KeyboardInterrupt from a test are failures too
        return pickle.dumps(("error", traceback.format_exc()))


def _destroy_subgroups() -> None:
    """Destroy every process group but the default one (each gloo group holds threads, fds)."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    world = dist.GroupMember.WORLD
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)
    # DTensor caches sharding decisions per mesh shape and names; a new mesh equal to
    # an earlier task's would otherwise bring back that task's destroyed groups.
    _clear_sharding_prop_cache()


def _exit_with_parent(parent_pid: int) -> None:
    """Exit once the test process is gone (a worker's parent is the fork server, not it)."""
    while True:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(1)
        time.sleep(1.0)
