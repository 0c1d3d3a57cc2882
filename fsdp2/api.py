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

__all__ = [
    "AllGather",
    "CPUOffloadPolicy",
    "Comm",
    "DataParallelMeshDims",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReduceScatter",
    "ShardPlacementResult",
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
            HSDP, all-reduce). ``None`` reduces in the compute dtype. When
            gradient sync is disabled, unsharded gradients accumulate in this
            dtype. Equal to ``param_dtype`` means the same as ``None``.
        output_dtype: dtype that floating-point forward outputs are cast to;
            ``None`` leaves outputs alone.
        cast_forward_inputs: whether floating-point forward inputs are cast to
            ``param_dtype`` before this module's forward.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_dtype(name, getattr(self, name))
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

    Attributes:
        pin_memory: pin the CPU shards and gradients so the copies can be
            asynchronous and overlap compute. Set ``False`` when pinned host
            memory is scarce.
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"CPUOffloadPolicy.pin_memory must be a bool, got {self.pin_memory!r}")


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
        return MixedPrecisionPolicy(**{f: getattr(policy, f) for f in fields})
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
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if type(policy).__name__ == "OffloadPolicy":
        return OffloadPolicy()
    hint = (
        " (fsdp2 offloads with OffloadPolicy or CPUOffloadPolicy)"
        if "OffloadPolicy" in names
        else ""
    )
    raise TypeError(f"offload_policy must be an OffloadPolicy, got {type(policy).__name__}{hint}")
