"""``fsdp2.profiling``: the import path of ``timeline`` before the package had folders; the
code is in ``fsdp2/planning/timeline.py``."""

from fsdp2.planning.timeline import Timeline, timeline

__all__ = ["Timeline", "timeline"]
