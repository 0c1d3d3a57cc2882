"""``fsdp2._core.support.compat``: the one module that knows which torch release needs what.

* version parsing (release, local and dev builds) and the clear error of ``require_torch``;
* the collective shims call ``all_gather_single`` / ``reduce_scatter_single`` where torch has
  them (2.13+) and the older ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` where it
  does not (2.11, 2.12), looked up at call time (so ``comm_counter`` patches see them), with
  the same results, on 2 gloo ranks;
* ``pyproject.toml`` states the range ``_compat`` supports;
* the compatibility subset (``make compat``, run on torch 2.11.0 and 2.14.1 in CI) has a test
  of each of compat's switches (``compat.SWITCHES``, ``tests/compat_subset.py``), every test
  it names exists, and no fsdp2 module but compat.py checks the torch release: a new
  release-dependent path goes through compat.py and its switch gets a test in the subset.
"""

from __future__ import annotations

import os
import re
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks

from fsdp2._core.support import compat as _compat


@pytest.mark.parametrize(
    "text, want",
    [
        ("2.11.0+cu130", (2, 11)),
        ("2.13.0", (2, 13)),
        ("2.14.1+cpu", (2, 14)),
        ("2.15.0a0+git1234abc", (2, 15)),
        ("2.12.0.dev20260101", (2, 12)),
    ],
)
def test_parse_version(text: str, want: tuple[int, int]) -> None:
    assert _compat._parse(text) == want


def test_require_torch_names_the_version_and_the_feature() -> None:
    _compat.require_torch(_compat.MIN_TORCH, "anything")  # the running torch is supported
    with pytest.raises(RuntimeError, match=r"frobnicate needs torch >= 99\.1; this is torch"):
        _compat.require_torch((99, 1), "frobnicate")


def test_pyproject_states_the_supported_range() -> None:
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    with open(os.path.join(root, "pyproject.toml")) as f:
        text = f.read()
    lo, hi = _compat.MIN_TORCH, _compat.MAX_TESTED_TORCH
    want = f'"torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}"'
    assert re.search(re.escape(want), text), f"pyproject.toml should require {want}"
    assert _compat.MIN_TORCH <= _compat.TORCH_VERSION, torch.__version__


def _shims(old_names: bool) -> list[torch.Tensor]:
    rank = dist.get_rank()
    group = dist.group.WORLD
    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    hidden = ("all_gather_single", "reduce_scatter_single") if old_names else ()
    patches = [mock.patch.object(dist, name, None) for name in hidden if hasattr(dist, name)]
    for p in patches:
        p.start()
    try:
        gathered = torch.empty(8)
        _compat.all_gather_single(gathered, x, group, async_op=True).wait()
        reduced = torch.empty(2)
        _compat.reduce_scatter_single(reduced, x, dist.ReduceOp.SUM, group, async_op=True).wait()
    finally:
        for p in patches:
            p.stop()
    return [gathered, reduced]


@pytest.mark.parametrize("old_names", [False, True], ids=["current", "pre_2_13"])
def test_collective_shims(old_names: bool) -> None:
    for rank, (gathered, reduced) in enumerate(run_on_ranks(2, _shims, old_names)):
        assert gathered.tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
        assert reduced.tolist() == [[10, 12], [14, 16]][rank]


def _root() -> str:
    return os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def test_every_switch_has_a_test_in_the_compatibility_subset() -> None:
    import ast
    import subprocess
    import sys

    import compat_subset

    assert set(_compat.SWITCHES) == set(compat_subset.SWITCHES), (
        "tests/compat_subset.py's SWITCHES must name a test for each of compat.SWITCHES"
    )
    for name in _compat.SWITCHES:
        assert compat_subset.SWITCHES[name], name
        assert hasattr(_compat, name), name
    root = _root()
    for node in compat_subset.subset():
        path, _, test = node.partition("::")
        assert os.path.isfile(os.path.join(root, path)), node
        if test:
            assert f"def {test}(" in open(os.path.join(root, path)).read(), node
    make = subprocess.run(
        ["make", "-s", "-C", root, "print-compat-tests"], capture_output=True, text=True
    )
    assert make.stdout.split() == compat_subset.subset(), make.stdout + make.stderr
    # the release is read in compat.py alone
    bad = []
    for dirpath, _, files in os.walk(os.path.join(root, "fsdp2")):
        for f in files:
            path = os.path.join(dirpath, f)
            if not f.endswith(".py") or path.endswith(os.path.join("support", "compat.py")):
                continue
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.Attribute) and node.attr == "__version__":
                    if isinstance(node.value, ast.Name) and node.value.id == "torch":
                        bad.append(f"{os.path.relpath(path, root)}:{node.lineno}")
                if isinstance(node, ast.Name) and node.id == "TORCH_VERSION":
                    bad.append(f"{os.path.relpath(path, root)}:{node.lineno}")
    assert not bad, f"torch release checked outside compat.py: {bad}"
    assert sys.modules["fsdp2._core.support.compat"] is _compat
