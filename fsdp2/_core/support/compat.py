"""What differs between the torch releases fsdp2 supports, in one place.

fsdp2 supports torch ``MIN_TORCH`` (2.11) through ``MAX_TESTED_TORCH`` (2.14); CI runs the
whole suite on 2.13 and a compatibility subset on 2.11 and 2.14 (docs/architecture.md,
"Supported torch releases"). Every version-dependent line of fsdp2 goes through here, so a new
torch release is checked in one file:

=============================  ==========  ==============================================
what                           needs       before that
=============================  ==========  ==============================================
``dist.all_gather_single``     2.13        ``dist.all_gather_into_tensor`` (same call)
``dist.reduce_scatter_single`` 2.13        ``dist.reduce_scatter_tensor`` (same call)
a DTensor subclass's own       2.13        DTensor's C++ dispatch skips it: ``PieceGrad``
``__torch_dispatch__`` runs                checks the torch functions on it instead
``Tensor.grad_dtype``          2.13 (?)    gradients in their parameter's dtype only; a
                                           ``grad_dtype`` policy raises at ``fully_shard``
=============================  ==========  ==============================================

The collective wrappers look the torch function up at call time, so a test that patches
``torch.distributed.all_gather_single`` (or the older name) sees fsdp2's calls.

No fsdp2 feature needs a newer torch than ``MIN_TORCH`` today: its ``FSDPModule`` setters are
its own, not torch's (torch's FSDP2 gained some only in 2.13, e.g.
``set_reduce_scatter_unused_params``; fsdp2 has them on every supported torch). A feature
that comes to need one checks with ``require_torch`` before any collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "AG_API",
    "DTENSOR_SUBCLASS_DISPATCH",
    "GRAD_DTYPE",
    "SWITCHES",
    "TORCH_RELEASE",
    "MAX_TESTED_TORCH",
    "MIN_TORCH",
    "RS_API",
    "TORCH_VERSION",
    "all_gather_single",
    "reduce_scatter_single",
    "require_torch",
]

MIN_TORCH = (2, 11)
MAX_TESTED_TORCH = (2, 14)


def _parse(version: str) -> tuple[int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11)``; a dev build ``"2.15.0a0+git..."`` -> ``(2, 15)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


TORCH_VERSION = _parse(torch.__version__)

if TORCH_VERSION < MIN_TORCH:
    raise ImportError(
        f"fsdp2 needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, found torch {torch.__version__}; "
        f"upgrade torch (pip install 'torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}')"
    )


def require_torch(version: tuple[int, int], what: str) -> None:
    """Raise a ``RuntimeError`` naming ``what`` and the release it needs when the running
    torch is older than ``version``; called before any collective."""
    if TORCH_VERSION < version:
        raise RuntimeError(
            f"{what} needs torch >= {version[0]}.{version[1]}; this is torch "
            f"{torch.__version__}. Upgrade torch or do without it."
        )


# Whether a DTensor subclass's own ``__torch_dispatch__`` runs (torch 2.13+): before, DTensor's
# C++ dispatch handled subclasses as plain DTensors. ``fsdp2.replica_optim``'s ``PieceGrad``
# checks the ops on it there; before 2.13 it checks the torch functions instead
# (``__torch_function__``; [Note: pieces as .grad] in fsdp2/_core/replicas/piece_grad.py).
DTENSOR_SUBCLASS_DISPATCH = TORCH_VERSION >= (2, 13)

# Whether tensors have ``grad_dtype`` (a gradient dtype of their own; 2.13 has it, 2.11 and
# 2.12 are unchecked): without it a gradient lands in its parameter's dtype, and a
# ``grad_dtype`` policy (``MixedPrecisionPolicy.grad_dtype``) is refused at ``fully_shard``
# ([Note: gradient dtypes] in fsdp2/_core/params/dtypes.py).
GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")

# The names of the single-tensor collectives this torch has (what observers are told).
# (Every name in SWITCHES below differs between the supported releases: `make compat` runs a
# test of each on 2.11 and 2.14, tests/compat_subset.py; tests/core/support/test_compat.py
# fails for a switch with no test there, and for a version check outside this module.)
AG_API = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
RS_API = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> Any:
    """``dist.all_gather_single`` (torch >= 2.13) or ``dist.all_gather_into_tensor``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor, input: torch.Tensor, op: Any, group: dist.ProcessGroup, async_op: bool
) -> Any:
    """``dist.reduce_scatter_single`` (torch >= 2.13) or ``dist.reduce_scatter_tensor``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


# What switches between the supported releases (the module docstring's table); each has a
# test in `make compat`'s subset (tests/compat_subset.py).
SWITCHES = ("AG_API", "RS_API", "DTENSOR_SUBCLASS_DISPATCH", "GRAD_DTYPE")

# the running release, for messages
TORCH_RELEASE = torch.__version__
