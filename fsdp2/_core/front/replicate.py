"""``replicate``: DDP's communication behind ``fully_shard``'s API, on the same engine.

``replicate(module, mesh=mesh)`` keeps every parameter whole on every rank: a
``Replicate()`` DTensor on ``mesh`` (see [Note: replicated groups] in mesh.py). Forward
needs no all-gather and reads the parameters in place; backward all-reduces the gradients
of each ``replicate`` call in one collective, issued as the call's backward ends, so it
overlaps with the rest of backward as fully_shard's reduce-scatters do. It composes with
``fully_shard`` in one model: shard the large blocks, replicate the small modules whose
all-gather latency costs more than their memory.
"""

from __future__ import annotations

from typing import Any, overload

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp2._core.front.module import FSDPModule, _no_deepcopy
from fsdp2._core.front.sharding import check_modules, shard_modules
from fsdp2._core.support.mesh import default_mesh, replicate_mesh_info, spmd_mesh_info
from fsdp2.api import DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["ReplicateModule", "replicate"]


class ReplicateModule(FSDPModule):
    """Mixin added to every module passed to :func:`replicate` (a subclass of
    :class:`FSDPModule`, as in torch: the same methods, and ``isinstance(m, FSDPModule)``
    holds)."""

    _fsdp2_api = "replicate"


_REPLICATE_CLASSES: dict[type, type] = {}


def _replicate_class(cls: type) -> type:
    """``Replicate<cls>``: ReplicateModule first in the MRO, one class per original class."""
    rep_cls = _REPLICATE_CLASSES.get(cls)
    if rep_cls is None:
        rep_cls = type(
            f"Replicate{cls.__name__}", (ReplicateModule, cls), {"__deepcopy__": _no_deepcopy}
        )
        _REPLICATE_CLASSES[cls] = rep_cls
    return rep_cls


@overload
def replicate(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
) -> ReplicateModule: ...


@overload
def replicate(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
) -> list[ReplicateModule]: ...


def replicate(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> Any:
    """Replicate ``module``'s parameters over ``mesh`` and train it data-parallel, as DDP
    does, with :func:`fully_shard`'s API (torch's ``replicate`` from
    ``torch.distributed._composable.replicate_with_fsdp``, same signature).

    Call it like ``fully_shard``: bottom-up, on blocks and then the root, alone or mixed
    with ``fully_shard`` on other modules of the model. One call makes one parameter group:
    the parameters of ``module``'s subtree minus those of submodules already sharded or
    replicated. Each parameter becomes an ``nn.Parameter`` wrapping a
    :class:`~torch.distributed.tensor.DTensor` with ``Replicate()`` on ``mesh`` (whole on
    every rank). Forward reads them in place: no all-gather and no second copy (unless
    ``mp_policy.param_dtype`` or CPU offload needs a cast or a move, kept from forward to
    the end of backward). After the group's backward its gradients are all-reduced
    (averaged over the mesh's ranks) in one collective, asynchronously, and land as
    ``Replicate()`` DTensor gradients. ``set_requires_gradient_sync(False)`` accumulates
    without communication, and the hooks and setters of :class:`FSDPModule` apply
    (``set_all_reduce_hook``, ``set_gradient_divide_factor``, ``set_bucket_bytes``, ...).

    The module's class becomes ``Replicate<Class>``, a subclass of :class:`ReplicateModule`
    (itself a :class:`FSDPModule`) and of the original class.

    Args:
        module: a module, or a list of modules replicated as one group.
        mesh: a 1D mesh of the ranks to replicate over; ``None`` builds one over the
            default process group. With ``dp_mesh_dims``, the full SPMD mesh.
        mp_policy: mixed precision, see :class:`MixedPrecisionPolicy` (``reduce_dtype``
            is the all-reduce's dtype).
        offload_policy: see :class:`OffloadPolicy` / :class:`CPUOffloadPolicy`.
        ignored_params: parameters left as they are (not replicated, gradients not
            reduced).
        dp_mesh_dims: a :class:`DataParallelMeshDims` with ``replicate`` only: the
            parameters are DTensors on the full mesh ``mesh`` (e.g. tensor parallel on
            ``"tp"``) with ``Replicate()`` on those dims, and their gradients are
            all-reduced over them.

    Returns:
        ``module`` (or the list), now :class:`ReplicateModule` instances.

    Raises:
        TypeError / ValueError: bad arguments, a 2D mesh without ``dp_mesh_dims``, a
            ``dp_mesh_dims`` with shard dims, modules already sharded or replicated.
    """
    modules = check_modules(module, "replicate")
    if dp_mesh_dims is not None:
        if mesh is None:
            raise ValueError(
                "replicate(dp_mesh_dims=...) needs mesh=, the full mesh with named dims that "
                "the parameters are DTensors on"
            )
        if getattr(dp_mesh_dims, "shard", None) is not None:
            raise ValueError(
                f"replicate() with dp_mesh_dims requires replicate-only dims, got shard="
                f"{dp_mesh_dims.shard!r}; use fully_shard() to shard over them"
            )
        info = spmd_mesh_info(mesh, dp_mesh_dims)
    else:
        mesh = default_mesh() if mesh is None else mesh
        if isinstance(mesh, DeviceMesh) and mesh.ndim != 1:
            raise ValueError(
                f"replicate expects a 1D DeviceMesh, got a {mesh.ndim}D mesh of shape "
                f"{tuple(mesh.shape)}; slice the dim to replicate over (mesh['dp']) or pass "
                "dp_mesh_dims=DataParallelMeshDims(replicate=...) with the full mesh"
            )
        info = replicate_mesh_info(mesh)
    shard_modules(
        modules,
        info,
        mesh=mesh,
        dp_mesh_dims=dp_mesh_dims,
        reshard_after_forward=False,  # nothing to free: the parameters are whole
        shard_placement_fn=None,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        make_class=_replicate_class,
    )
    return module
