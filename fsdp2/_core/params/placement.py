"""Where each parameter of a ``fully_shard`` call goes: its shard dim and its mesh, from
``shard_placement_fn`` (per-parameter meshes, and ``Replicate()`` for parameters kept whole
on every rank), grouped into the call's parameter groups. Raises before any collective
that creates no process group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from fsdp2._core.support.mesh import MeshInfo, mesh_info, replicate_mesh_info, spmd_mesh_info
from fsdp2.api import DataParallelMeshDims, ShardPlacementResult

__all__ = ["mesh_tag", "place"]


# [Note: per-parameter meshes]
# ``shard_placement_fn(param)`` may return a ``ShardPlacementResult`` (ours, or torch's,
# read by attribute) naming the mesh a parameter shards over. The call's parameters are
# then grouped by ``(shard process group, replicate process group)``, in the order they
# were found, and each group becomes a ``ParamGroup`` of its own with its own collectives
# (the state's ``Slot`` holds them all; see [Note: several groups] in step.py). A mesh is
# known by its object (with its ``dp_mesh_dims``): two mesh objects over the same process
# groups are an error (which one's placements would the group's DTensors carry?), as in
# torch. The call's own mesh is one of them, for parameters the function returns ``None``
# or a ``Shard`` for.
#
# [Note: per-parameter Replicate]
# ``shard_placement_fn`` may also return ``Replicate()`` (or a ``ShardPlacementResult`` with
# ``placement=Replicate()`` and a mesh): the parameter stays whole on every rank of the
# call's mesh (of the named mesh), in a replicated group of the call ([Note: replicated
# groups] in mesh.py): no all-gather, its gradient all-reduced with the group's others in
# one collective. On an HSDP mesh it replicates over both dims; with ``dp_mesh_dims`` over
# every data-parallel dim (keeping its other placements). For small parameters (norms,
# biases) whose all-gather costs latency more than their memory saves.

_Entry = tuple[str, nn.Parameter, list[tuple[nn.Module, str]], int]


def place(
    found: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
    info: MeshInfo,
    mesh: DeviceMesh | None,
    dims: DataParallelMeshDims | None,
    name: str,
    fn: Callable[[nn.Parameter], Any] | None,
) -> dict[tuple[Any, ...], tuple[MeshInfo, list[_Entry]]]:
    """Each parameter's shard dim and mesh, grouped by process groups (see
    [Note: per-parameter meshes]). Raises before any collective."""
    if fn is None:  # every parameter on the call's mesh, dim 0
        entries = [(fqn, p, owners, 0) for fqn, p, owners in found]
        return {(info.shard_group, info.replicate_group): (info, entries)} if entries else {}
    infos: dict[tuple[int, Any], MeshInfo] = {}
    if mesh is not None:
        infos[(id(mesh), _dims_key(dims))] = info
    by_pgs: dict[tuple[Any, ...], tuple[MeshInfo, list[_Entry]]] = {}
    for fqn, p, owners in found:
        result = fn(p) if fn is not None else None
        placement, p_info = result, info
        if isinstance(result, Replicate):
            placement, p_info = None, _replicated(infos, info, mesh, dims, fqn, name)
        elif result is not None and not isinstance(result, Shard):
            placement, p_mesh, p_dims = _result_fields(result, fqn, name)
            if isinstance(placement, Replicate):
                p_info = _replicated(infos, None, p_mesh, p_dims, fqn, name)
                placement = None
            else:
                key = (id(p_mesh), _dims_key(p_dims))
                known = infos.get(key)
                if known is None:
                    known = infos[key] = _mesh_info_of(p_mesh, p_dims, fqn, name)
                p_info = known
        dim = _shard_dim(placement, p, fqn, p_info, name)
        pgs = (p_info.shard_group, p_info.replicate_group)
        entry = by_pgs.get(pgs)
        if entry is None:
            by_pgs[pgs] = (p_info, [(fqn, p, owners, dim)])
        elif entry[0] is not p_info:
            raise ValueError(
                f"fully_shard({name}): {fqn} shards over mesh {p_info.mesh}, a different mesh "
                f"object than {entry[0].mesh} over the same process groups (used by "
                f"{entry[1][0][0]}); return the same mesh object for every parameter of a "
                "process group"
            )
        else:
            entry[1].append((fqn, p, owners, dim))
    return by_pgs


def _replicated(
    infos: dict[tuple[Any, ...], MeshInfo],
    call: MeshInfo | None,
    mesh: DeviceMesh | None,
    dims: Any,
    fqn: str,
    name: str,
) -> MeshInfo:
    """The replicated group's mesh info for a parameter placed ``Replicate()`` over the
    call's mesh (``call``) or over ``mesh`` (see [Note: per-parameter Replicate])."""
    if call is not None and call.spmd is not None:
        mesh = call.spmd.mesh
        names = mesh.mesh_dim_names
        assert names is not None
        dims = DataParallelMeshDims(replicate=tuple(names[i] for i in sorted(call.spmd.dp_dims)))
    elif call is not None:
        mesh = call.mesh
    assert mesh is not None
    key = ("replicate", id(mesh), _dims_key(dims))
    known = infos.get(key)
    if known is None:
        if dims is not None:  # every data-parallel dim replicates, in the mesh's order
            order = mesh.mesh_dim_names or ()
            parts = (getattr(dims, "shard", None), getattr(dims, "replicate", None))
            dp = [n for part in parts if part for n in ((part,) if isinstance(part, str) else part)]
            dp.sort(key=lambda n: order.index(n) if n in order else -1)
            known = _mesh_info_of(mesh, DataParallelMeshDims(replicate=tuple(dp)), fqn, name)
        else:
            _mesh_info_of(mesh, None, fqn, name)  # validates it (this rank in it, 1D/2D)
            known = replicate_mesh_info(mesh, f"fully_shard({name})")
        infos[key] = known
    return known


def _dims_key(dims: Any) -> tuple[Any, ...] | None:
    """``dp_mesh_dims`` as a dict key (torch's ``DataParallelMeshDims`` is not hashable)."""
    if dims is None:
        return None
    return (getattr(dims, "shard", None), getattr(dims, "replicate", None))


def _result_fields(result: object, fqn: str, name: str) -> tuple[Any, DeviceMesh, Any]:
    """``(placement, mesh, dp_mesh_dims)`` of a ``ShardPlacementResult``: ours, or torch's
    (``placement`` and ``mesh_info``: its ``mesh``, or with ``dp_mesh_dims`` its
    ``spmd_mesh``)."""
    if isinstance(result, ShardPlacementResult):
        return result.placement, result.mesh, result.dp_mesh_dims
    mi = getattr(result, "mesh_info", None)
    if mi is None or not hasattr(result, "placement"):
        raise TypeError(
            f"fully_shard({name}): shard_placement_fn returned {result!r} for {fqn}; "
            "return None, a Shard(dim), Replicate() or a "
            "fsdp2.ShardPlacementResult(placement, mesh)"
        )
    dims = getattr(mi, "dp_mesh_dims", None)
    if dims is not None:
        return result.placement, mi.spmd_mesh, dims
    p_mesh = mi.mesh
    shard, rep = getattr(mi, "shard_mesh_dim", None), getattr(mi, "replicate_mesh_dim", None)
    expected = (0, None) if p_mesh.ndim == 1 else (1, 0)
    if (shard, rep) != expected:
        raise ValueError(
            f"fully_shard({name}): shard_placement_fn returned a mesh info with "
            f"shard_mesh_dim={shard}, replicate_mesh_dim={rep} on a {p_mesh.ndim}D mesh for "
            f"{fqn}; fsdp2 shards over the last dim and replicates over dim 0 of a 2D mesh "
            "(FSDPMeshInfo(mesh, shard_mesh_dim=0) on a 1D mesh, HSDPMeshInfo(mesh, "
            "shard_mesh_dim=1, replicate_mesh_dim=0) on a 2D one)"
        )
    return result.placement, p_mesh, None


def _mesh_info_of(mesh: object, dims: Any, fqn: str, name: str) -> MeshInfo:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard({name}): the ShardPlacementResult for {fqn} names "
            f"{type(mesh).__name__} as its mesh; pass a DeviceMesh"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"fully_shard({name}): {fqn} shards over mesh {mesh}, which does not include "
            f"this rank ({dist.get_rank()}); every rank must name a mesh it belongs to "
            "(e.g. its row of the expert mesh)"
        )
    if dims is not None:
        return spmd_mesh_info(mesh, dims)
    return mesh_info(mesh)


def mesh_tag(info: MeshInfo) -> str:
    """How messages and timeline lanes name one of a call's groups: by its mesh dims
    (``" (replicated)"`` for the group of parameters ``shard_placement_fn`` replicated)."""
    if info.shard_size == 1 and info.replicate_group is not None:
        return " (replicated)"
    mesh = info.spmd.mesh if info.spmd is not None else info.mesh
    names = mesh.mesh_dim_names
    if info.spmd is not None and names is not None:
        names = tuple(names[i] for i in info.spmd.shard_dims + info.spmd.replicate_dims)
    if names:
        return f" (mesh {'/'.join(names)})"
    return f" (mesh {'x'.join(str(n) for n in mesh.shape)})"


def _shard_dim(placement: Any, p: nn.Parameter, fqn: str, info: MeshInfo, name: str) -> int:
    if placement is None or p.dim() == 0:
        return 0
    if not isinstance(placement, Shard):
        raise TypeError(
            f"fully_shard({name}): shard_placement_fn returned {placement!r} for {fqn}; "
            "return a Shard(dim), Replicate() or None"
        )
    d = placement.dim + p.dim() if placement.dim < 0 else placement.dim
    if not 0 <= d < p.dim():
        raise ValueError(
            f"fully_shard({name}): Shard({placement.dim}) is out of range for {fqn} of shape "
            f"{tuple(p.shape)}"
        )
    if d != 0 and p.shape[d] % info.shard_size:
        raise ValueError(
            f"fully_shard({name}): {fqn} has size {p.shape[d]} on dim {d}, not divisible by "
            f"the shard world size {info.shard_size}; sharding on a dim other than 0 must be "
            "even (shard it on dim 0 instead, or pad the parameter)"
        )
    return d
