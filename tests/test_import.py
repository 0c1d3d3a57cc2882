"""``import fsdp2`` loads what training needs and no more (docs/benchmarks.md, "Import time").

Its cost is held at or below ``import torch.distributed.fsdp`` (measured, not timed here):
``torch._dynamo`` (about 0.5 s) is imported at the first hook call under ``torch.compile``
or otherwise, not with fsdp2 (the hooks use ``torch._disable_dynamo``), and the checkpoint
and planning modules load at first use (PEP 562). The lazy names behave as plain ones.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import fsdp2

LAZY = ("checkpoint", "MemoryEstimate", "estimate_memory", "Timeline", "timeline")


# One fresh process for both checks: it lists what ``import fsdp2`` loaded, then (as a script
# that calls only estimate_memory) estimates.
_FRESH = (
    "import sys, fsdp2\n"
    "print(' '.join(sorted(sys.modules)))\n"
    "import torch, torch.nn as nn\n"
    "with torch.device('meta'):\n"
    "    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))\n"
    "est = fsdp2.estimate_memory(m, torch.empty(4, 64, device='meta'), mesh_shape=2,\n"
    "    device='cpu', shard=nn.Linear, step_fn=lambda m, b: m(b).sum())\n"
    "assert est.world_size == 2 and est.peak_bytes > 0, est\n"
    "print('ok', flush=True)\n"
    "import gc; gc.freeze()  # exit without the last collections over torch's objects\n"
)


@pytest.fixture(scope="module")
def fresh() -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True)


def test_import_loads_no_more_than_training_needs(
    fresh: subprocess.CompletedProcess[str],
) -> None:
    out = fresh.stdout.splitlines()[0].split() if fresh.stdout else []
    assert out, fresh.stderr[-2000:]
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


def test_estimate_memory_in_a_fresh_process(fresh: subprocess.CompletedProcess[str]) -> None:
    # Regression: torch's "fake" process-group backend is registered by an import that
    # torch._dynamo used to make for us; once `import fsdp2` stopped importing dynamo, a
    # script calling only estimate_memory failed with "Unknown c10d backend type FAKE".
    lines = fresh.stdout.splitlines()
    assert fresh.returncode == 0 and lines[1:] == ["ok"], fresh.stderr[-2000:]
