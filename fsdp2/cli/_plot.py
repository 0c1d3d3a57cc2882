"""``fsdp2 estimate --plot``: a PNG of the estimated peak per world size, stacked by part."""

from __future__ import annotations

import os
from typing import Any

from fsdp2.cli._checkpoint import InputError as _InputError

# The bars of --plot: the estimate's parts, summed into what a person plans for.
_BARS = {
    "parameters": ("parameters (sharded)", "parameters (unsharded)"),
    "gradients": ("gradients (sharded)", "gradients (unsharded)"),
    "optimizer state": ("optimizer state",),
    "activations": ("activations",),
    "buffers": ("communication buffers", "other"),
}


def check(path: str) -> None:
    """Refuse ``--plot path`` before any simulation (a sweep of a large model takes minutes):
    matplotlib missing, or no folder to write the PNG into."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise _InputError(f"--plot needs matplotlib (pip install matplotlib): {e}") from e
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise _InputError(f"--plot {path}: cannot write it: no folder {folder}")
    if not os.access(folder, os.W_OK):
        raise _InputError(f"--plot {path}: cannot write it: {folder} is not writable")


def plot(path: str, title: str, results: list[Any], budget: int | None) -> None:
    """A PNG of the peak per world size, stacked by part (matplotlib, imported here)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise _InputError(f"--plot needs matplotlib (pip install matplotlib): {e}") from e
    over = " over replicas"
    labels = [
        "x".join(map(str, est.mesh_shape)) + (over if "shard_over_replicas" in est.settings else "")
        for est in results
    ]
    fig, ax = plt.subplots(figsize=(3.2 + 1.0 * len(results), 4.2))
    bottom = [0.0] * len(results)
    for bar, parts in _BARS.items():
        heights = [sum(est.parts[p] for p in parts) / 2**30 for est in results]
        ax.bar(labels, heights, bottom=bottom, label=bar, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    if budget is not None:
        ax.axhline(budget / 2**30, color="black", linestyle="--", linewidth=1)
        ax.text(-0.45, budget / 2**30, "device memory", va="bottom", ha="left", fontsize=8)
    ax.set_xlabel("ranks (mesh)")
    ax.set_ylabel("peak per rank (GiB)")
    ax.set_title(title, fontsize=9)
    handles, names = ax.get_legend_handles_labels()  # top part on top, as stacked
    ax.legend(handles[::-1], names[::-1], fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise _InputError(f"--plot {path}: cannot write it: {e}") from e
    finally:
        plt.close(fig)
