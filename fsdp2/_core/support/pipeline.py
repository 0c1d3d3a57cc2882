"""Making sure torch's pipeline schedules know fsdp2's modules whenever they may run them.

# [Note: stages under torch's schedules]
# ``torch.distributed.pipelining`` recognises torch's FSDP2 stages by class and drives them
# (no gradient sync and no resharding between micro-batches, one reduction at the end). An
# fsdp2 stage is invisible to it unless ``fsdp2.integrations.pipelining.enable()`` taught it
# fsdp2's modules; it would then gather and reduce once per micro-batch: right numbers,
# several times the traffic. So fsdp2 enables that integration itself whenever
# ``torch.distributed.pipelining`` is imported: at the end of every ``fully_shard`` call and
# at every root forward (a dictionary lookup and a flag read when there is nothing to do).
# A root forward is early enough even inside a schedule's first step: the integration lets
# a runtime schedule compute on an fsdp2 stage whose ``UNSHARD`` action it skipped before
# (fsdp2 gathers on demand). Code that only changed its ``fully_shard`` import to fsdp2's
# therefore gets torch's schedule behaviour unchanged. The integration is the front wing's
# (``fsdp2/_core/front/pipelining.py``, public as ``fsdp2.integrations.pipelining``), which
# registers itself here (``set_enabler``) when the package imports it: this wing, below it,
# never imports it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["mark_enabled", "maybe_enable", "opt_out", "set_enabler"]

_PIPELINING = "torch.distributed.pipelining"
_enabled = False
_opted_out = False  # disable() was called: do not enable by ourselves
_enabler: Callable[[], None] | None = None


def set_enabler(enabler: Callable[[], None]) -> None:
    """``enabler()`` enables the integration (registered by the package)."""
    global _enabler
    _enabler = enabler


def mark_enabled(enabled: bool = True) -> None:
    """The integration patched (or unpatched) torch's schedules."""
    global _enabled
    _enabled = enabled


def opt_out(out: bool) -> None:
    """``True``: the user disabled the integration; ``maybe_enable`` leaves it off."""
    global _opted_out
    _opted_out = out


def maybe_enable() -> None:
    """Enable the integration if torch's pipelining is imported and it is not enabled (nor
    disabled by the user); see [Note: stages under torch's schedules]."""
    if not (_enabled or _opted_out) and _enabler is not None and _PIPELINING in sys.modules:
        _enabler()
