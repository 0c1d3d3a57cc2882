"""What a ``fully_shard`` mesh means: FSDP (1D) or HSDP (2D), its groups, its device."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard


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

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: gradients are averaged over these."""
        return self.shard_size * self.replicate_size

    def placements(self, shard_dim: int | None) -> tuple[Placement, ...]:
        """DTensor placements of a parameter sharded on ``shard_dim`` (``None``:
        replicated, used for 0-dim parameters)."""
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
    device_type = "cpu"
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is not None and dist.get_backend() != "gloo":
        device_type = acc.type
    return init_device_mesh(device_type, (dist.get_world_size(),))


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


def post_forward_group(info: MeshInfo, reshard_size: int) -> tuple[dist.ProcessGroup, int]:
    """The group of ``reshard_size`` consecutive shard ranks this rank belongs to
    (for ``reshard_after_forward=int``), and this rank's index in it.

    Creating groups is collective: every rank creates every block's group in
    the same order, so all ranks must call this with the same arguments. The
    groups are cached on the mesh object, so they live and die with it.
    """
    cache: dict[int, list[tuple[tuple[int, ...], dist.ProcessGroup]]]
    cache = info.mesh.__dict__.setdefault("_fsdp2_block_groups", {})
    if reshard_size not in cache:
        rows = info.mesh.mesh.reshape(-1, info.shard_size).tolist()
        cache[reshard_size] = [
            (tuple(row[i : i + reshard_size]), dist.new_group(row[i : i + reshard_size]))
            for row in rows
            for i in range(0, len(row), reshard_size)
        ]
    rank = dist.get_rank()
    for ranks, group in cache[reshard_size]:
        if rank in ranks:
            return group, ranks.index(rank)
    raise AssertionError(f"rank {rank} is not in mesh {info.mesh}")


def separate_shard_group(info: MeshInfo) -> dist.ProcessGroup:
    """A second process group over this rank's shard ranks (for reduce-scatters
    that should not queue behind all-gathers). Collective over all ranks;
    cached on the mesh like ``post_forward_group``."""
    cache: dict[str, dist.ProcessGroup] = info.mesh.__dict__.setdefault(
        "_fsdp2_separate_groups", {}
    )
    if "shard" not in cache:
        mine = None
        for row in info.mesh.mesh.reshape(-1, info.shard_size).tolist():
            group = dist.new_group(row)
            if dist.get_rank() in row:
                mine = group
        assert mine is not None
        cache["shard"] = mine
    return cache["shard"]
