"""fsdp2 stages under ``torch.distributed.pipelining``'s schedules: :func:`enable`,
:func:`disable`, :func:`is_enabled`.

torch's schedules recognise torch's FSDP2 stages by class; :func:`enable` teaches them
fsdp2's (one all-gather and one reduce-scatter per group per step, the runtime's ``UNSHARD``
/ ``RESHARD`` actions). fsdp2 calls it itself once ``torch.distributed.pipelining`` is
imported, and so does ``use_fsdp2()``. The code is the engine's
(``fsdp2/_core/front/pipelining.py``, [Note: pipelining]); see docs/pipelining.md.
"""

from fsdp2._core.front.pipelining import disable, enable, is_enabled

__all__ = ["disable", "enable", "is_enabled"]
