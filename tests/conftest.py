"""Pytest setup shared by every test: ``tests/`` on sys.path and the ``gpu`` marker's skip."""

from __future__ import annotations

import os
import sys

import pytest
import torch

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)  # test helpers (`_harness`, models) import by bare name


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The harness's own tests kill worker pools on purpose (a hang, a crash): last, so that
    # the other tests keep the pools they started instead of spawning them again.
    items.sort(key=lambda item: item.path.name == "test_harness.py")
    # gpu-marked tests run on CUDA, or on the CPU when asked to (FSDP2_TEST_DEVICE=cpu:
    # `make gpu-check DEVICE=cpu`; see tests/devices.py).
    if torch.cuda.is_available() or os.environ.get("FSDP2_TEST_DEVICE") == "cpu":
        return
    skip = pytest.mark.skip(reason="needs CUDA; torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
