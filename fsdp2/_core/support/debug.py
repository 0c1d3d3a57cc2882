"""Debug mode: ranks that disagree get an error naming what each was about to do, not a hang.

# [Note: debug checks]
# A collective that ranks reach in different orders (one rank runs another micro-batch,
# skips a module, or built a different model) blocks forever, or on gloo aborts. In debug
# mode (``fsdp2.set_debug(True)`` or ``FSDP2_DEBUG=1``) every collective fsdp2 issues is
# first announced through the default process group's key-value store: each rank writes
# "collective #k of process group G: <op> of <modules> (<numel>, <dtype>) in the
# <phase> of step <s>" under a key of its own, then waits (up to the debug timeout) for
# the other ranks of G to write collective #k, and compares. On a mismatch every rank
# raises a ``RuntimeError`` listing what each rank was about to do, before the collective
# is issued. A rank that never arrives (it finished, or it is blocked elsewhere) makes
# the waiting ranks raise after the timeout, naming the last fsdp2 collective that rank
# announced. The store, not a collective, carries the check, so a disagreement can never
# hang the check itself. Cost: a few store round trips per collective, so a debugging
# tool only; off, it is one attribute read per collective.
# The step counts root forwards of every fsdp2 root in the process; the phase is the
# last step boundary seen. Both are the same on every rank that runs the same program.
# The checker is an observer ([Note: observation] in observe.py), subscribed while the
# debug mode is on: its ``collective`` runs before the engine issues each collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from fsdp2._core.support.observe import HUB, Collective, Observer

__all__ = ["is_debug", "set_debug"]

_HINT = (
    "Did the ranks run different numbers of micro-batches or steps, skip a module on some "
    "rank, or build different models? (fsdp2 debug mode: fsdp2.set_debug / FSDP2_DEBUG=1)"
)


@dataclass
class _Debug:
    enabled: bool
    timeout: float
    step: int = 0
    phase: str = "forward"
    seq: dict[str, int] = field(default_factory=dict)  # process group name -> checks
    session: int = 0  # set_debug calls so far: keys of an earlier session are never read


def _from_env() -> _Debug:
    enabled = os.environ.get("FSDP2_DEBUG", "0").strip().lower() not in ("", "0", "false")
    return _Debug(enabled, float(os.environ.get("FSDP2_DEBUG_TIMEOUT", "60")))


class _Checker(Observer):
    """The debug mode's observer: counts steps, follows phases, checks collectives."""

    def __init__(self, state: _Debug) -> None:
        self.state = state
        self.unsubscribe: Any = None

    def step_phase(self, name: str, new_step: bool) -> None:
        if new_step:
            self.state.step += 1
        self.state.phase = name

    def collective(self, c: Collective) -> None:
        _check(c.kind, c.what, c.numel, str(c.dtype), c.group)

    def turn(self, on: bool) -> None:
        if on and self.unsubscribe is None:
            self.unsubscribe = HUB.subscribe(self)
        elif not on and self.unsubscribe is not None:
            self.unsubscribe()
            self.unsubscribe = None


_STATE = _from_env()
_CHECKER = _Checker(_STATE)
_CHECKER.turn(_STATE.enabled)


def set_debug(enabled: bool = True, *, timeout: float | None = None) -> None:
    """Turn fsdp2's debug mode on or off (default: the ``FSDP2_DEBUG`` environment
    variable; ``FSDP2_DEBUG_TIMEOUT`` seconds, default 60).

    In debug mode, before every collective fsdp2 issues, the ranks of its process group
    compare what they are about to do (operation, modules, element count, dtype, phase and
    step) through the default process group's store; on a mismatch every rank raises
    ``RuntimeError`` naming each rank's collective, and a rank that does not arrive
    within ``timeout`` seconds is named with the last collective it announced. Call it on
    every rank, at the same point of the program (it restarts the step and collective counts).

    Args:
        enabled: on or off.
        timeout: seconds to wait for the other ranks at each check (must be > 0).
    """
    if timeout is not None and not timeout > 0:
        raise ValueError(f"set_debug: timeout must be a positive number of seconds, got {timeout}")
    _STATE.enabled = bool(enabled)
    if timeout is not None:
        _STATE.timeout = float(timeout)
    _STATE.seq.clear()
    _STATE.step = 0
    _STATE.session += 1
    _CHECKER.turn(_STATE.enabled)


def is_debug() -> bool:
    """Whether fsdp2's debug mode is on."""
    return _STATE.enabled


def _check(op: str, what: str, numel: int, dtype: str, group: dist.ProcessGroup) -> None:
    """Agree with the other ranks of ``group`` on the collective about to be issued, or
    raise (see [Note: debug checks])."""
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    me, name = dist.get_rank(), group.group_name
    seq = _STATE.seq.get(name, 0)
    _STATE.seq[name] = seq + 1
    dtype_name = dtype.removeprefix("torch.")
    desc = (
        f"{op} of {what} ({numel:,} elements, {dtype_name}) in the {_STATE.phase} of step "
        f"{_STATE.step}"
    )
    session = f"fsdp2/debug/{_STATE.session}"
    prefix = f"{session}/{name}"
    store.set(f"{prefix}/{seq}/{me}", desc)
    store.set(f"{session}/last/{me}", f"collective #{seq} of process group {name}: {desc}")
    others = [r for r in ranks if r != me]
    keys = [f"{prefix}/{seq}/{r}" for r in others]
    try:
        store.wait(keys, timedelta(seconds=_STATE.timeout))
    except Exception:
        missing = [r for r, k in zip(others, keys, strict=True) if not store.check([k])]
        if missing:  # (else all arrived just after the deadline)
            last = []
            for r in missing:
                key = f"{session}/last/{r}"
                seen = store.get(key).decode() if store.check([key]) else "none yet"
                last.append(f"rank {r}: {seen}")
            raise RuntimeError(
                f"fsdp2 debug: rank {me} is about to run collective #{seq} of process group "
                f"{name}: {desc}; rank(s) {', '.join(map(str, missing))} did not reach it "
                f"within {_STATE.timeout:g} s. Their last fsdp2 collective: "
                + "; ".join(last)
                + f". {_HINT}"
            ) from None
    theirs = {r: store.get(k).decode() for r, k in zip(others, keys, strict=True)}
    if any(d != desc for d in theirs.values()):
        lines = [f"rank {r}: {d}" for r, d in sorted({**theirs, me: desc}.items())]
        raise RuntimeError(
            f"fsdp2 debug: ranks disagree on collective #{seq} of process group {name}:\n  "
            + "\n  ".join(lines)
            + f"\n{_HINT}"
        )
    if seq:  # every rank of the group has finished reading #seq-1: drop our key of it
        store.delete_key(f"{prefix}/{seq - 1}/{me}")
