"""The device the ``gpu``-marked tests run on, and the checks ``make gpu-check`` sets.

``gpu``-marked tests run on CUDA when it is available and are skipped otherwise, except under
``FSDP2_TEST_DEVICE=cpu`` (``make gpu-check DEVICE=cpu``, what CI runs): then they run on the
CPU with gloo, so the tests and the harness are themselves tested where no GPU is, and only the
parts that need CUDA (pinned memory, streams and events, CUDA memory statistics) skip, through
``require_cuda``, with a reason. ``FSDP2_GPU_REPEATS`` (``make gpu-check``: 3) repeats each
training run: a race between streams shows only sometimes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["REPEATS", "TEST_DEVICE", "cpu_mode", "one_rank_mesh", "require_cuda"]


def _device() -> str:
    wanted = os.environ.get("FSDP2_TEST_DEVICE", "")
    if wanted not in ("", "cpu", "cuda"):
        raise ValueError(f"FSDP2_TEST_DEVICE must be 'cpu' or 'cuda', got {wanted!r}")
    return wanted or ("cuda" if torch.cuda.is_available() else "cpu")


TEST_DEVICE = _device()
REPEATS = max(1, int(os.environ.get("FSDP2_GPU_REPEATS", "1")))


def cpu_mode() -> bool:
    """Whether ``gpu``-marked tests were asked to run on the CPU (``FSDP2_TEST_DEVICE=cpu``)."""
    return os.environ.get("FSDP2_TEST_DEVICE") == "cpu"


def require_cuda(what: str) -> None:
    """Skip the calling test when it runs on the CPU: ``what`` needs CUDA."""
    if TEST_DEVICE != "cuda":
        pytest.skip(f"{what} needs CUDA (running on {TEST_DEVICE})")


def one_rank_mesh() -> DeviceMesh:
    """A 1-rank mesh on the test device, inside a 1-rank harness worker: NCCL on ``cuda:0``,
    else the worker's gloo group on the CPU."""
    if TEST_DEVICE == "cuda":
        torch.cuda.set_device(0)
        group = dist.new_group(ranks=[0], backend="nccl")
        return DeviceMesh.from_group(group, "cuda")
    return DeviceMesh.from_group(dist.group.WORLD, "cpu")
