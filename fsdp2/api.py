"""Policies: the small frozen configuration objects users hand to ``fully_shard``.

Field names and defaults match torch's FSDP2 (2.13) so code written
for torch's FSDP2 switches by changing one import.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = [
    "AllGather",
    "CPUOffloadPolicy",
    "Comm",
    "DataParallelMeshDims",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReduceScatter",
    "ShardPlacementResult",
    "cpu_offload_by_budget",
]


def _check_dtype(name: str, value: object) -> None:
    if value is not None and not isinstance(value, torch.dtype):
        raise TypeError(f"MixedPrecisionPolicy.{name} must be a torch.dtype or None, got {value!r}")
    if isinstance(value, torch.dtype) and not value.is_floating_point:
        raise ValueError(f"MixedPrecisionPolicy.{name} must be a floating-point dtype, got {value}")


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision for one ``fully_shard`` group.

    The sharded parameters (and so the optimizer) keep their original dtype;
    only the all-gathered, unsharded parameters used by forward and backward
    are in ``param_dtype``. Casts happen at module boundaries, not per op.

    Attributes:
        param_dtype: dtype of the unsharded parameters, hence of the
            all-gather and of forward/backward compute. ``None`` keeps the
            original dtype.
        reduce_dtype: dtype of gradient reduction (reduce-scatter and, for
            HSDP, all-reduce). ``None`` reduces in the dtype of the gradients:
            the compute dtype, unless a ``grad_dtype`` says otherwise (see below).
            When gradient sync is disabled, unsharded gradients accumulate in this
            dtype. Equal to ``param_dtype`` means the same as ``None`` for
            parameters without an explicit ``grad_dtype``.
        output_dtype: dtype that floating-point forward outputs are cast to;
            ``None`` leaves outputs alone.
        cast_forward_inputs: whether floating-point forward inputs are cast to
            ``param_dtype`` before this module's forward.
        grad_dtype: the dtype of the group's floating-point parameters' gradients
            (``param.grad``, what the optimizer reads), as if each parameter's
            ``Tensor.grad_dtype`` were set to it before ``fully_shard`` (torch main, pytorch
            PR 197368): e.g. fp32 gradients of bf16 parameters. With ``reduce_dtype``
            ``None`` backward accumulates and reduces them in ``grad_dtype`` too. ``None``
            (default): each parameter's own ``grad_dtype`` (by default its dtype).
            Parameter storage and the all-gather are unchanged. Needs torch's
            ``Tensor.grad_dtype`` (2.13+).

    ``reduce_dtype=None`` follows each parameter's explicit ``grad_dtype`` (set before
    ``fully_shard``) and, in a group whose gradients have several dtypes, reduces in their
    promoted dtype (docs/mixed_precision.md, "Gradient dtypes").
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    grad_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_dtype(name, getattr(self, name))
        grad = self.grad_dtype
        if grad is not None and not (isinstance(grad, torch.dtype) and grad.is_floating_point):
            raise ValueError(  # ValueError for a string too, as torch main's
                f"MixedPrecisionPolicy.grad_dtype must be a floating-point dtype or None, "
                f"got {grad!r}"
            )
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                "MixedPrecisionPolicy.cast_forward_inputs must be a bool, "
                f"got {self.cast_forward_inputs!r}"
            )


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay
    on the mesh's device. The default ``offload_policy`` of ``fully_shard``."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, their gradients and (so) the optimizer state on
    the CPU; copy shards host-to-device before each all-gather and gradients
    device-to-host after each reduce-scatter. The optimizer step runs on CPU.

    The two phase flags (torch main, pytorch PR 192441) say where the sharded
    parameters (and their gradients) are between the phases of a step; both
    ``True`` (the default) is the behaviour above, both ``False`` no offloading.

    Attributes:
        pin_memory: pin the CPU shards and gradients so the copies can be
            asynchronous and overlap compute. Set ``False`` when pinned host
            memory is scarce.
        offload_after_forward: from the end of a forward with grad enabled to
            the group's backward (the activation peak), the sharded parameters
            are on the CPU. ``False`` with ``offload_after_backward=True``:
            they are brought to the device by the forward and stay there until
            the group's backward is done (no host-to-device copy in backward).
        offload_after_backward: after the group's backward and at rest, the
            sharded parameters and gradients are on the CPU, so the optimizer
            step runs there. ``False``: they rest on the device (the optimizer
            and its state are on the device; a device-side fused optimizer
            works), and ``offload_after_forward=True`` moves them to the CPU
            from the end of forward to the group's backward only.
    """

    pin_memory: bool = True
    offload_after_forward: bool = True
    offload_after_backward: bool = True

    def __post_init__(self) -> None:
        for name in ("pin_memory", "offload_after_forward", "offload_after_backward"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"CPUOffloadPolicy.{name} must be a bool, got {value!r}")


def _select_largest_first(fqn_numbytes: list[tuple[str, int]], budget_bytes: int) -> list[str]:
    """The names to offload under ``budget_bytes``: sorted by size, largest first (equal
    sizes by name), the longest prefix of that order whose sizes add up to at most the
    budget. It stops at the first entry that does not fit, even if a smaller one after it
    would (a prefix, not a knapsack: with sizes 400, 200, 40 a budget of 399 selects
    nothing), so the result never exceeds the budget, does not depend on the input order,
    and grows (as a superset) when the budget does. Plain Python data, no torch."""
    selected: list[str] = []
    used = 0
    for fqn, numbytes in sorted(fqn_numbytes, key=lambda item: (-item[1], item[0])):
        used += numbytes
        if used > budget_bytes:
            break
        selected.append(fqn)
    return selected


def cpu_offload_by_budget(
    module: nn.Module, budget_bytes: int, *, pin_memory: bool = True
) -> dict[str, OffloadPolicy]:
    """A per-parameter offload map for ``fully_shard(module, offload_policy=...)``:
    ``module``'s parameters (``named_parameters()`` names, tied ones once), largest
    first, until ``budget_bytes`` of (full, unsharded) parameter bytes are on the CPU.
    Each selected name maps to ``CPUOffloadPolicy(pin_memory=pin_memory)``; the others
    are left out of the map (they stay on the device). A budget of 0 offloads nothing; one
    at or above the total offloads everything (as ``CPUOffloadPolicy()`` does).

    The selection is the longest largest-first prefix that fits (``_select_largest_first``):
    it stops at the first parameter over the remaining budget, even if smaller ones would
    still fit, so raising the budget only ever adds parameters.

    Names are relative to ``module``: pass the map to the ``fully_shard`` call of that
    very module (parameters of submodules sharded by their own ``fully_shard`` call are not
    managed by it: build their maps from those submodules).

    Raises:
        TypeError: ``budget_bytes`` is not a number, ``module`` not an ``nn.Module``.
        ValueError: ``budget_bytes`` is negative.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"cpu_offload_by_budget takes an nn.Module, got {type(module).__name__}")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)):
        raise TypeError(
            f"cpu_offload_by_budget: budget_bytes must be a number of bytes, got {budget_bytes!r}"
        )
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be non-negative, but got {budget_bytes}")
    sizes = [(n, p.numel() * p.element_size()) for n, p in module.named_parameters()]
    policy = CPUOffloadPolicy(pin_memory=pin_memory)
    return {fqn: policy for fqn in _select_largest_first(sizes, budget_bytes)}


def _dim_names(field: str, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(
        f"DataParallelMeshDims.{field} must be None, a mesh dim name or a non-empty tuple of "
        f"mesh dim names, got {value!r}"
    )


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Which dims of a full SPMD mesh are data parallel, for
    ``fully_shard(module, mesh=full_mesh, dp_mesh_dims=...)`` on parameters
    that are already DTensors on ``full_mesh`` (``Replicate()`` on these dims).

    Attributes:
        shard: mesh dim name(s) FSDP shards parameters over; several names
            are flattened into one shard dim.
        replicate: mesh dim name(s) parameters stay replicated over (HSDP
            with ``shard``, DDP-like without it); several names are flattened.

    At least one of the two must be set.
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "At least one of shard or replicate must be set in DataParallelMeshDims"
            )
        _dim_names("shard", self.shard)
        _dim_names("replicate", self.replicate)

    @property
    def shard_names(self) -> tuple[str, ...]:
        """``shard`` as a tuple of names (empty if ``None``)."""
        return _dim_names("shard", self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        """``replicate`` as a tuple of names (empty if ``None``)."""
        return _dim_names("replicate", self.replicate)


@dataclass(frozen=True, eq=False)
class ShardPlacementResult:
    """What ``shard_placement_fn`` may return to shard one parameter over a mesh of its
    own (per-parameter meshes, e.g. mixture-of-experts weights over an expert-FSDP mesh
    while the dense weights use the call's mesh).

    One ``fully_shard`` call then holds one parameter group per process group: each
    group has its own all-gather and reduce-scatter (and, for HSDP, all-reduce). Return
    the same ``mesh`` object for every parameter of a group: two mesh objects with the
    same process groups are an error.

    Attributes:
        placement: ``Shard(d)`` to shard on dim ``d``, ``None`` for dim 0.
        mesh: a 1D mesh (FSDP), a 2D mesh (HSDP: replicate x shard), or with
            ``dp_mesh_dims`` the full SPMD mesh the parameter is a DTensor on.
        dp_mesh_dims: which dims of ``mesh`` are data parallel (as the ``fully_shard``
            argument of the same name), or ``None``.

    torch's own ``ShardPlacementResult(placement, mesh_info)`` objects are accepted too
    (read by attribute), so code written for torch's ``fully_shard`` keeps working.
    """

    placement: Any  # torch.distributed.tensor.Shard | None
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    dp_mesh_dims: DataParallelMeshDims | None = None


class Comm(ABC):
    """A user-provided collective: decides where its buffers live and how it runs.

    Set with ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``.
    """

    @abstractmethod
    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Return an uninitialized tensor of ``size`` for the collective's buffers
        (e.g. from a registered memory pool). ``torch.empty`` is a valid choice."""


class AllGather(Comm):
    """Custom all-gather: ``output`` (flat, ``world * input.numel()``) receives
    every rank's ``input`` in rank order."""

    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Run the all-gather; return a ``Work`` when ``async_op`` (fsdp2 always
        passes ``True``), or ``None`` if it completed synchronously."""


class ReduceScatter(Comm):
    """Custom reduce-scatter: ``output`` receives this rank's ``1 / world`` of the
    reduction of the flat ``input`` over ``group``."""

    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Run the reduce-scatter with reduce ``op``; return a ``Work`` (or ``None``
        if it completed synchronously)."""


def _class_names(obj: object) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


def as_mixed_precision_policy(policy: object) -> MixedPrecisionPolicy:
    """``policy`` as fsdp2's :class:`MixedPrecisionPolicy`: itself, or a copy read by
    field of another ``MixedPrecisionPolicy`` (torch's, built e.g. by accelerate's plugin).

    Raises:
        TypeError: ``policy`` is neither.
    """
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if "MixedPrecisionPolicy" in _class_names(policy) and all(hasattr(policy, f) for f in fields):
        kw = {f: getattr(policy, f) for f in fields}
        return MixedPrecisionPolicy(**kw, grad_dtype=getattr(policy, "grad_dtype", None))
    raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(policy).__name__}")


def as_offload_policy(policy: object) -> OffloadPolicy:
    """``policy`` as fsdp2's :class:`OffloadPolicy` / :class:`CPUOffloadPolicy`: itself,
    or a copy read by field of torch's ``OffloadPolicy`` / ``CPUOffloadPolicy``.

    Raises:
        TypeError: ``policy`` is none of these (another offload policy is refused, not
            silently treated as no offloading).
    """
    if isinstance(policy, OffloadPolicy):
        return policy
    names = _class_names(policy)
    if "CPUOffloadPolicy" in names and hasattr(policy, "pin_memory"):
        return CPUOffloadPolicy(  # torch main's phase flags too, where its policy has them
            pin_memory=policy.pin_memory,
            offload_after_forward=getattr(policy, "offload_after_forward", True),
            offload_after_backward=getattr(policy, "offload_after_backward", True),
        )
    if type(policy).__name__ == "OffloadPolicy":
        return OffloadPolicy()
    hint = (
        " (fsdp2 offloads with OffloadPolicy or CPUOffloadPolicy)"
        if "OffloadPolicy" in names
        else ""
    )
    raise TypeError(f"offload_policy must be an OffloadPolicy, got {type(policy).__name__}{hint}")
