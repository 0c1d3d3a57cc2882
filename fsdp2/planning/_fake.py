"""The fake world :func:`fsdp2.estimate_memory` simulates rank 0 in: torch's fake process
group (collectives return at once), the mesh over it, and the batch as fake tensors."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

# Registers torch's "fake" process-group backend. `torch._dynamo` imports it too, which is
# how it used to be there; since `import fsdp2` no longer imports dynamo, a fresh script
# that only calls estimate_memory needs this import of its own.
import torch.testing._internal.distributed.fake_pg  # noqa: F401
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_map


def mesh(device: str, shape: tuple[int, ...]) -> DeviceMesh:
    """The mesh of ``shape`` over the fake world: ``dp_shard``, or HSDP's
    ``(dp_replicate, dp_shard)``."""
    ranks = torch.arange(math.prod(shape)).view(shape)
    names = ("dp_shard",) if len(shape) == 1 else ("dp_replicate", "dp_shard")
    return DeviceMesh(device, ranks, mesh_dim_names=names)


@contextmanager
def world(world_size: int) -> Iterator[None]:
    """Rank 0 of a fake process group of ``world_size`` ranks (one already initialized is
    used as it is; any other raises ``RuntimeError``)."""
    if dist.is_initialized():
        backend = dist.get_backend()
        if backend != "fake" or dist.get_world_size() != world_size or dist.get_rank() != 0:
            raise RuntimeError(
                "estimate_memory simulates rank 0 of a fake process group of "
                f"{world_size} ranks and sets it up itself, but a process group "
                f"({backend}, {dist.get_world_size()} ranks) is already initialized: call "
                "it before init_process_group (e.g. in a planning script), or initialize "
                f'init_process_group("fake", store=dist.HashStore(), rank=0, '
                f"world_size={world_size}) yourself"
            )
        yield
        return
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("fake", store=store, rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def batch(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor replaced by an empty one of its shape and dtype on
    ``device`` (fake under the simulation's fake mode)."""

    def fake(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty(x.shape, dtype=x.dtype, device=device)
        return x

    return tree_map(fake, batch)
