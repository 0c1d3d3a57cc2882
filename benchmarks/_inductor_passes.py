"""Inductor's collective passes, by the names the benchmarks' ``--inductor-pass`` takes
(``traced.py``, ``overhead.py``): the ``torch.compile(options=...)`` each sets, and which
do not run on CPU (torch 2.13's ``torch/_inductor/config.py``)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["GPU_ONLY", "PASSES", "passes_of", "warm_inductor"]

# inductor config (torch/_inductor/config.py) per pass name: what ``traced+NAME`` sets
PASSES: dict[str, dict[str, Any]] = {
    # the FX passes: one all-gather / reduce-scatter per bucket of independent ones
    "bucket-ag": {"bucket_all_gathers_fx": "all"},
    "bucket-rs": {"bucket_reduce_scatters_fx": "all"},
    "bucket": {"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all"},
    # the scheduler's compute/communication reordering, with config.py's recommended passes
    "reorder": {
        "reorder_for_compute_comm_overlap": True,
        "reorder_for_compute_comm_overlap_passes": [
            "reorder_communication_preserving_peak_memory",
            "sink_waits_iterative",
            "reorder_communication_preserving_peak_memory",
        ],
    },
}
# passes that do not run on CPU in torch 2.13, and why (``--inductor-pass`` refuses them)
GPU_ONLY = {
    "overlap": "aten_distributed_optimizations.enable_overlap_scheduling: its cost model "
    "(estimate_roofline_runtime_ms) asks triton for the GPU's DRAM bandwidth even with "
    "compute_estimator='analytical' and enable_fusion_regions=False (ModuleNotFoundError: "
    "triton on a CPU build)",
}


def passes_of(impl: str) -> dict[str, Any]:
    """The inductor options of ``traced+A+B``: A's and B's settings together."""
    options: dict[str, Any] = {}
    for name in impl.split("+")[1:]:
        options.update(PASSES[name])
    return options


def warm_inductor() -> None:
    """Compile and run a tiny function, so the one-time costs of inductor's first compile
    in a process (its compile workers, the C++ toolchain checks) land on no implementation."""
    torch.compile(lambda x: (x.sin() + 1).sum())(torch.randn(8))
