"""What a ``fully_shard`` mesh means: FSDP (1D) or HSDP (2D), its groups, its device."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp2.api import DataParallelMeshDims


@dataclass(frozen=True)
class MeshInfo:
    """The data-parallel layout of one parameter group.

    Parameters are sharded over ``shard_group`` and, for HSDP, replicated over
    ``replicate_group`` (``None`` for a 1D mesh).
    """

    mesh: DeviceMesh
    device: torch.device
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int
    spmd: SPMDMesh | None = None  # set by fully_shard(..., dp_mesh_dims=...)
    # replicate(), or Replicate() from shard_placement_fn: whole parameters on every rank
    # of ``mesh``, which all replicate (see [Note: replicated groups])
    replicated: bool = False

    def placements(self, shard_dim: int | None) -> tuple[Placement, ...]:
        """DTensor placements of a parameter sharded on ``shard_dim`` (``None``:
        replicated, used for 0-dim parameters)."""
        if self.replicated:
            return (Replicate(),) * self.mesh.ndim
        inner: Placement = Replicate() if shard_dim is None else Shard(shard_dim)
        return (inner,) if self.replicate_group is None else (Replicate(), inner)


def device_of(mesh: DeviceMesh) -> torch.device:
    """The device a mesh computes on: the current accelerator for accelerator meshes."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def default_mesh() -> DeviceMesh:
    """A 1D mesh over the default process group, on the current accelerator if
    the process group can talk to it, else on CPU."""
    if not dist.is_initialized():
        raise ValueError(
            "fully_shard(mesh=None) needs torch.distributed to be initialized: call "
            "torch.distributed.init_process_group() first or pass mesh=init_device_mesh(...)"
        )
    return init_device_mesh(comm_device_type(), (dist.get_world_size(),))


def comm_device_type() -> str:
    """The device type the default process group communicates on: the current
    accelerator's, unless there is none or the backend is gloo (then ``"cpu"``)."""
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc.type if acc is not None and dist.get_backend() != "gloo" else "cpu"


def dp_tp_mesh(dp_mesh: DeviceMesh, param: Any, fqn: str) -> DeviceMesh:
    """The (dp..., tp...) mesh a tensor-parallel DTensor ``param`` is sharded on; a
    ``ValueError`` naming it if its mesh is no other dimension of ``dp_mesh``'s root or it
    is ``Partial``. Reads the meshes' real rank tensors (also under estimate_memory's fake mode)."""
    tp_mesh = param.device_mesh
    try:
        with unset_fake_temporarily():
            cat = DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except Exception as e:  # noqa: BLE001 - any failure means the meshes do not compose
        raise ValueError(
            f"parameter {fqn} is a DTensor on mesh {tp_mesh}, which is not another "
            f"dimension of the data-parallel mesh {dp_mesh} (both must be slices of "
            "one root mesh, e.g. mesh['dp'] and mesh['tp'])"
        ) from e
    if any(p.is_partial() for p in param.placements):
        raise ValueError(f"parameter {fqn} has Partial placements {param.placements}")
    return cat


def mesh_info(mesh: DeviceMesh) -> MeshInfo:
    """Validate ``mesh`` and describe it; 1D is FSDP, 2D is HSDP (replicate, shard)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard expects mesh to be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1D mesh (FSDP) or a 2D mesh (HSDP: replicate x shard), "
            f"got a {mesh.ndim}D mesh of shape {tuple(mesh.shape)}; for TP/EP slice the "
            "data-parallel dims first, e.g. mesh['dp'] or mesh['replicate', 'shard']"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        # see [Note: unnamed 2D meshes]
        raise ValueError(
            f"fully_shard got a 2D mesh of shape {tuple(mesh.shape)} without mesh_dim_names; "
            "a 2D mesh means HSDP (dim 0 replicates, dim 1 shards), and like torch's "
            "fully_shard fsdp2 wants that said: init_device_mesh(..., "
            "mesh_dim_names=('replicate', 'shard')). For tensor parallelism slice the "
            "data-parallel dims first (mesh['dp']) or pass dp_mesh_dims="
        )
    shard_dim = mesh.ndim - 1
    replicate = mesh.get_group(0) if mesh.ndim == 2 else None
    return MeshInfo(
        mesh=mesh,
        device=device_of(mesh),
        shard_group=mesh.get_group(shard_dim),
        shard_size=mesh.size(shard_dim),
        shard_rank=mesh.get_local_rank(shard_dim),
        replicate_group=replicate,
        replicate_size=mesh.size(0) if mesh.ndim == 2 else 1,
    )


# [Note: replicated groups]
# ``replicate(module, mesh=mesh)`` and a ``Replicate()`` returned by ``shard_placement_fn``
# make a group whose parameters are whole on every rank: DTensors with ``Replicate()`` on
# every dim of ``mesh``. The engine runs it as HSDP with a shard dim of one rank
# (``shard_size`` 1): the "all-gather" is no collective, the gradients are packed and
# all-reduced over ``replicate_group`` (every rank of ``mesh``; the dims flattened into one
# group for a 2D mesh), as DDP does. With one shard rank the flat sharded buffer holds each
# parameter whole, so the unsharded parameters are views of it (``GroupLayout.aliased``):
# no copy, no second copy of the weights, unless mixed precision or CPU offload needs one.
# The shard group is a process group of this rank alone, created without a collective.


def replicate_mesh_info(mesh: DeviceMesh, what: str = "replicate") -> MeshInfo:
    """Describe a replicated group on ``mesh`` (see [Note: replicated groups])."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what} expects mesh to be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        group = mesh.get_group(0)
    else:
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError(
                f"{what} got a {mesh.ndim}D mesh of shape {tuple(mesh.shape)} without "
                "mesh_dim_names; name its dims (init_device_mesh(..., mesh_dim_names=...))"
            )
        group = mesh._flatten("_".join(names)).get_group(0)
    return MeshInfo(
        mesh=mesh,
        device=device_of(mesh),
        shard_group=self_group(mesh),
        shard_size=1,
        shard_rank=0,
        replicate_group=group,
        replicate_size=mesh.size(),
        replicated=True,
    )


def self_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """A process group of this rank alone (the shard group of a replicated group), made
    without a collective and cached on ``mesh``."""
    cache = mesh_cache(mesh)
    group = _registered(cache.self_group)
    if group is None:
        group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        cache.self_group = group.group_name
    return group


# [Note: unnamed 2D meshes]
# A 2D mesh is read by position: dim 0 replicates, dim 1 shards. With no names nothing in the
# user's code says so: init_device_mesh("cpu", (2, 4)) meant as 2 shards x 4 replicas would
# train without an error (the numbers are the same) with another memory per rank and other
# traffic than intended. torch's fully_shard refuses an unnamed 2D mesh (an assertion);
# fsdp2 refuses it too, with a ValueError naming the fix, before any collective, so code
# moves between the two engines unchanged. The names themselves are not checked (torch does
# not either). A 1D mesh needs no names: it can only mean FSDP.


# [Note: dp_mesh_dims]
# ``fully_shard(m, mesh=full, dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...))``
# takes parameters that are DTensors on the full SPMD mesh with ``Replicate()`` on the data
# parallel dims. It maps onto the tensor-parallel path ([Note: tensor parallel] in param.py):
# the data-parallel mesh is sliced out of ``full`` (one shard dim, ``(replicate, shard)`` for
# HSDP, ``(replicate, 1)`` for replicate only; several names are flattened into one dim) and
# drives the collectives as for ``fully_shard(m, mesh=full["dp"])``; each parameter's
# full-mesh layout plays the part of the TP layout, so the unsharded parameter is the user's
# DTensor on ``full`` and the sharded one a DTensor on ``full`` whose shard dim's placement
# becomes ``Shard(d)`` (``_StridedShard`` when a non-DP dim to its right also shards ``d``).


@dataclass(frozen=True, eq=False)
class SPMDMesh:
    """``dp_mesh_dims`` resolved on the full mesh ``mesh`` (see [Note: dp_mesh_dims])."""

    mesh: DeviceMesh
    shard_dims: tuple[int, ...]
    replicate_dims: tuple[int, ...]
    # The sharded parameters' mesh: ``mesh``, except that several shard dims are replaced
    # by the flattened data-parallel mesh (with its replicate dim, for HSDP), as torch does.
    spec_mesh: DeviceMesh

    @property
    def dp_dims(self) -> frozenset[int]:
        return frozenset(self.shard_dims + self.replicate_dims)

    def sharded_layout(
        self,
        placements: tuple[Placement, ...],
        dp_placements: tuple[Placement, ...],
        shard_dim: int,
    ) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        """Mesh and placements of the FSDP-sharded parameter whose unsharded
        placements on ``mesh`` are ``placements``; ``dp_placements`` are its
        placements on the data-parallel mesh alone."""
        if not self.shard_dims:  # replicate only: parameters keep their layout
            return self.mesh, placements
        inner = dp_placements[-1]
        first = self.shard_dims[0]
        split = 1
        for j in range(first + 1, self.mesh.ndim):
            p = placements[j]
            if j not in self.dp_dims and isinstance(p, (Shard, _StridedShard)):
                if p.dim == shard_dim:
                    split *= self.mesh.size(j)
        if split > 1 and isinstance(inner, Shard):
            inner = _StridedShard(shard_dim, split_factor=split)
        new = list(placements)
        for i in self.shard_dims:
            new[i] = inner
        if len(self.shard_dims) == 1:
            return self.mesh, tuple(new)
        out: list[Placement] = []
        for i in range(self.mesh.ndim):
            if i == first:
                out.extend((*dp_placements[:-1], inner))
            elif i in self.dp_dims:  # in the data-parallel mesh placed at ``first``
                continue
            else:
                out.append(new[i])
        return self.spec_mesh, tuple(out)


def spmd_mesh_info(mesh: DeviceMesh, dims: object) -> MeshInfo:
    """Validate ``dp_mesh_dims`` against the full mesh ``mesh`` and describe the
    data-parallel part of it (see [Note: dp_mesh_dims])."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard expects mesh to be a DeviceMesh, got {type(mesh).__name__}")
    if not isinstance(dims, DataParallelMeshDims):
        if not (hasattr(dims, "shard") and hasattr(dims, "replicate")):
            raise TypeError(
                "dp_mesh_dims must be a DataParallelMeshDims, got " + type(dims).__name__
            )
        dims = DataParallelMeshDims(shard=dims.shard, replicate=dims.replicate)  # e.g. torch's
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "fully_shard(dp_mesh_dims=...) needs a mesh with mesh_dim_names, e.g. "
            "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
        )
    shard, rep = dims.shard_names, dims.replicate_names
    for name in shard + rep:
        if name not in names:
            raise ValueError(
                f"dp_mesh_dims names mesh dim '{name}', which is not in the mesh's dim names "
                f"{names}"
            )
    if len(set(shard + rep)) != len(shard + rep):
        raise ValueError(
            f"dp_mesh_dims names a mesh dim twice: shard={shard}, replicate={rep}; each dim "
            "is either sharded or replicated over"
        )

    def sub(group: tuple[str, ...]) -> DeviceMesh:
        # Several dims act as one: flatten them (cached on the root mesh by name).
        return mesh[group[0]] if len(group) == 1 else mesh[group]._flatten("_".join(group))

    if not shard:  # replicate only: HSDP with a shard dim of size 1
        rep_mesh = sub(rep)
        cache = mesh_cache(mesh).unflattened
        if rep not in cache:
            rep_name = "_".join(rep)
            cache[rep] = rep_mesh._unflatten(
                0, (rep_mesh.size(), 1), (rep_name, f"{rep_name}_noshard")
            )
        dp_mesh = cache[rep]
    elif not rep:
        dp_mesh = sub(shard)
    else:
        dp_mesh = DeviceMesh._concatenate([sub(rep), sub(shard)])
    info = mesh_info(dp_mesh)
    index = {n: i for i, n in enumerate(names)}
    shard_dims = tuple(sorted(index[n] for n in shard))
    replicate_dims = tuple(sorted(index[n] for n in rep))
    spec_mesh = mesh
    if len(shard_dims) > 1:
        parts = []
        for i, name in enumerate(names):
            if i == shard_dims[0]:
                parts.append(dp_mesh)
            elif i not in shard_dims and i not in replicate_dims:
                parts.append(mesh[name])
        spec_mesh = DeviceMesh._concatenate(parts)
    spmd = SPMDMesh(mesh, shard_dims, replicate_dims, spec_mesh)
    return replace(info, spmd=spmd)


def shard_mesh(info: MeshInfo) -> DeviceMesh:
    """The 1D mesh of the shard dim (the mesh itself for FSDP; for HSDP its last dim)."""
    mesh = info.mesh
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if names is not None:
        return mesh[names[-1]]
    return DeviceMesh.from_group(info.shard_group, mesh.device_type)


def _shard_rows(info: MeshInfo) -> list[list[int]]:
    """The mesh's ranks, one list per shard group. The mesh's rank tensor is a real
    tensor: read it outside ``fsdp2.estimate_memory``'s fake mode (where torch ops on it
    would make fake tensors without values)."""
    with unset_fake_temporarily():
        rows: list[list[int]] = info.mesh.mesh.reshape(-1, info.shard_size).tolist()
    return rows


def post_forward_mesh(info: MeshInfo, reshard_size: int) -> DeviceMesh:
    """The 2D mesh whose rows are blocks of ``reshard_size`` consecutive shard ranks (for
    ``reshard_after_forward=int``): its dim 1 is the group the backward all-gathers over,
    and the parameters registered between forward and backward are DTensors on it
    (``(Replicate(), Shard(d))``, as torch's FSDP2 registers them).

    Creating it is collective (its process groups): every rank must call this with the same
    arguments. Cached per mesh (``mesh_cache``), so it lives and dies with ``info.mesh``.
    """
    cache = mesh_cache(info.mesh).block_meshes
    mesh = cache.get(reshard_size)
    if mesh is None:
        blocks = [
            row[i : i + reshard_size]
            for row in _shard_rows(info)
            for i in range(0, len(row), reshard_size)
        ]
        with unset_fake_temporarily():  # real tensors (fsdp2.estimate_memory's fake mode)
            ranks = torch.tensor(blocks, dtype=torch.int)
            mesh = cache[reshard_size] = DeviceMesh(info.mesh.device_type, ranks)
    return mesh


def separate_shard_group(info: MeshInfo) -> dist.ProcessGroup:
    """A second process group over this rank's shard ranks (for reduce-scatters
    that should not queue behind all-gathers). Collective over all ranks;
    cached on the mesh like ``post_forward_group``."""
    cache = mesh_cache(info.mesh)
    mine = _registered(cache.separate_group)
    if mine is None:
        for row in _shard_rows(info):
            group = dist.new_group(row)
            if dist.get_rank() in row:
                mine = group
        assert mine is not None
        cache.separate_group = mine.group_name
    return mine


def _registered(name: str | None) -> dist.ProcessGroup | None:
    """The process group named ``name`` while it is registered (not destroyed)."""
    if name is None:
        return None
    try:
        return _resolve_process_group(name)  # type: ignore[arg-type]
    except (RuntimeError, ValueError):  # destroyed since
        return None


@dataclass
class MeshCache:
    """What fsdp2 derives from a ``DeviceMesh`` once and reuses: DTensor specs shared by
    every parameter of one layout (building one per parameter would dominate
    ``fully_shard``'s time), process groups and meshes (creating them is collective)."""

    specs: dict[tuple[Any, ...], DTensorSpec] = field(default_factory=dict)
    unflattened: dict[tuple[str, ...], DeviceMesh] = field(default_factory=dict)
    block_meshes: dict[int, DeviceMesh] = field(default_factory=dict)
    # Process groups by name, not the objects ([Note: mesh caches]).
    separate_group: str | None = None
    self_group: str | None = None
    flat: DeviceMesh | None = None  # the mesh flattened to one dim ([Note: pieces as .grad])
    placeholders: dict[tuple[torch.dtype, torch.device], torch.Tensor] = field(default_factory=dict)

    def placeholder(self, like: torch.Tensor) -> torch.Tensor:
        """An empty tensor of ``like``'s dtype and device (see ``param._wrap``)."""
        key = (like.dtype, like.device)
        t = self.placeholders.get(key)
        if t is None:
            t = self.placeholders[key] = torch.empty(0, dtype=like.dtype, device=like.device)
        return t

    def __reduce__(self) -> tuple[type[MeshCache], tuple[()]]:
        # A pickled or deep-copied mesh (torch.save of a DTensor, copy.deepcopy of a model)
        # gets an empty cache: process groups do not pickle, and a copy is another mesh.
        return (MeshCache, ())


# [Note: mesh caches]
# A mesh's cache is an attribute of the mesh itself, so it lives and dies with the mesh: a
# global map by id(mesh) would hold the cached DTensorSpecs, which hold the mesh, so no
# mesh (nor its specs, placeholder tensors and process groups) would ever be freed: a
# model rebuilt 50 times on fresh meshes kept 50 caches (tests/reliability/
# test_long_runs.py). By mesh identity: an equal mesh object gets its own groups, as its
# user would expect. The process groups fsdp2 makes for a mesh are cached by name, not as
# objects, as torch's DeviceMesh keeps its own: torch (2.13) keeps every mesh a DTensor was
# redistributed on (``_redistribute._planner_cache``, ``_gen_transform_infos``) for the
# process's life, and a group object held there outlives ``destroy_process_group``: its
# threads (gloo) or communicator stay, for every model built and dropped (the test harness's
# workers gathered hundreds of threads). A destroyed group is made again on next use.
_CACHE_ATTR = "_fsdp2_mesh_cache"


def mesh_cache(mesh: DeviceMesh) -> MeshCache:
    """``mesh``'s cache (created on first use; lives as long as ``mesh``; see
    [Note: mesh caches])."""
    cache: MeshCache | None = mesh.__dict__.get(_CACHE_ATTR)
    if cache is None:
        cache = MeshCache()
        setattr(mesh, _CACHE_ATTR, cache)
    return cache
