"""Let gloo's worker threads finish with the interpreter alive, so a job that succeeded
does not abort at exit. See [Note: clean exit]."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

__all__ = ["drain", "install_exit_drain"]

# [Note: clean exit]
# A CPU job (gloo) that finished without error sometimes died at exit with "terminate
# called without an active exception" (SIGABRT), and torchrun reported it failed. The
# cause is in torch's gloo backend, and torch's FSDP2 hits it as often (a save script
# with either engine: about 1 run in 3 here). gloo runs each collective on a worker
# thread of its process group; after marking the collective done (which wakes the Python
# caller) the worker drops its reference to the collective's tensors. When the caller has
# dropped its own meanwhile (``all_gather_object`` does, and every synchronous
# collective), that drop is the last one and releases the tensors' Python objects, which
# takes the GIL. Python switches threads only every 5 ms, so a worker wanting the GIL
# right after a script's last collective often waits until the main thread reaches
# interpreter finalization; a thread that takes the GIL then is ended with
# ``pthread_exit``, whose unwinding through the C++ destructor calls ``std::terminate``.
# It needs the process group to outlive ``destroy_process_group()`` (``destroy`` itself
# joins the workers with the GIL released), and sharded models hold their process groups
# (fsdp2's and torch's engines both). A pure-torch script (keep a reference to the group,
# ``all_gather_object``, ``destroy_process_group()``, exit) aborts 11 runs in 20 here.
#
# ``fully_shard`` and ``fsdp2.checkpoint`` install an ``atexit`` handler (once) that
# sleeps with the GIL released until no other thread of the process has been runnable for
# two 2 ms slices (at most 0.2 s; about 4 ms on an idle process): a worker waiting for the
# GIL gets it and drops its tensors while the interpreter is alive. atexit handlers run
# before finalization starts, after the script's last statement. Threads are read from
# /proc (Linux); elsewhere the handler sleeps 20 ms. Measured: 60 launches of the example
# and of a save script, every exit 0 (docs/reliability.md, "A clean exit").

SLICE_S = 0.002
QUIET_SLICES = 2
BUDGET_S = 0.2
_FALLBACK_S = 0.02

_lock = threading.Lock()
_installed = False


def install_exit_drain() -> None:
    """Register ``drain`` to run at interpreter exit (idempotent, thread-safe)."""
    global _installed
    with _lock:
        if not _installed:
            atexit.register(drain)
            _installed = True


def _others_runnable(own: int) -> bool | None:
    """Whether a thread of this process other than ``own`` is running or runnable (state
    R in /proc); ``None`` where /proc cannot tell."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        if int(tid) == own:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        # "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the
        # last ')'.
        state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
        if state == b"R":
            return True
    return False


def drain(budget_s: float = BUDGET_S) -> float:
    """Sleep, the GIL released, until no other thread has been runnable for
    ``QUIET_SLICES`` slices or ``budget_s`` passed; the seconds slept. See [Note: clean
    exit]."""
    start = time.monotonic()
    if not sys.platform.startswith("linux"):
        time.sleep(_FALLBACK_S)
        return time.monotonic() - start
    own = threading.get_native_id()
    quiet = 0
    while quiet < QUIET_SLICES and time.monotonic() - start < budget_s:
        time.sleep(SLICE_S)
        busy = _others_runnable(own)
        if busy is None:
            time.sleep(_FALLBACK_S)
            break
        quiet = 0 if busy else quiet + 1
    return time.monotonic() - start
