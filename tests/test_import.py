"""``import fsdp2`` loads what training needs and no more (docs/benchmarks.md, "Import time").

Its cost is held at or below ``import torch.distributed.fsdp`` (measured, not timed here):
``torch._dynamo`` (about 0.5 s) is imported at the first hook call under ``torch.compile``
or otherwise, not with fsdp2 (the hooks use ``torch._disable_dynamo``), and the checkpoint
and planning modules load at first use (PEP 562). The lazy names behave as plain ones.
"""

from __future__ import annotations

import subprocess
import sys

import fsdp2

LAZY = ("checkpoint", "MemoryEstimate", "estimate_memory", "Timeline", "timeline")


def test_import_loads_no_more_than_training_needs() -> None:
    code = "import sys, fsdp2\nprint(' '.join(sorted(sys.modules)))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    for heavy in (
        "torch._dynamo",
        "torch._inductor",
        "fsdp2.checkpoint",
        "fsdp2.planning",
        "fsdp2.fsdp1",
        "fsdp2.integrations",
        "safetensors",
        "transformers",
    ):
        assert heavy not in out, f"import fsdp2 imports {heavy}"


def test_lazy_names_resolve() -> None:
    from fsdp2.checkpoint import save_full_checkpoint
    from fsdp2.planning.estimate import MemoryEstimate, estimate_memory
    from fsdp2.planning.timeline import Timeline, timeline

    assert fsdp2.checkpoint.save_full_checkpoint is save_full_checkpoint
    assert fsdp2.estimate_memory is estimate_memory and fsdp2.MemoryEstimate is MemoryEstimate
    assert fsdp2.timeline is timeline and fsdp2.Timeline is Timeline
    assert set(LAZY) <= set(dir(fsdp2)) and set(LAZY) <= set(fsdp2.__all__)
    try:
        fsdp2.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("fsdp2.no_such_name did not raise AttributeError")
