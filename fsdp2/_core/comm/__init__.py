"""Communication: every collective the engine issues, and how its bytes travel.

One function per collective kind (``collectives``: ``all_gather``, ``reduce_scatter``,
``all_reduce``: the copy-in, the profiler label, the debug check, once for every caller),
gloo's faster sends and receives (``gloo``), the tensors a collective holds and the copies
around it (``transport``), and sums in a fixed order (``exact``: the canonical tree and the
exchanges of the deterministic mode and the low-precision wire).

Imports: ``support`` only. Helpers here take values (a process group, tensors, sizes) and
return values: no group, no parameter, no module.
"""
