"""Pipeline-parallel training for the tests: a stack of tanh-linear blocks split into stages,
each stage sharded over the data-parallel submesh, run by a ``torch.distributed.pipelining``
schedule, beside an unsharded replica.

The mesh is ``(pp, dp)`` (``pp`` stages, ``dp`` data-parallel ranks per stage). Every rank
builds the whole model under the same seed and keeps the blocks of its stages; stage ``s`` owns
``BLOCKS // num_stages`` consecutive blocks. Single-stage schedules give rank ``r`` of the pp
group stage ``r``; looped schedules stages ``r, r + pp, ...``; V-shaped ones (ZBV, DualPipeV)
stages ``r`` and ``2 pp - 1 - r``. The global batch is split over the dp ranks (each its
slice), then into micro-batches by the schedule; the loss of a micro-batch is the MSE over its
rows, so with ``scale_grads`` (the schedules' default) and the data-parallel average the
gradients are those of the MSE over the global batch: the replica's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

DIM = 8
BLOCKS = 8
ROWS = 8  # global batch rows per data-parallel rank... per step: ROWS * dp

SCHEDULES: dict[str, tuple[type, str]] = {
    # name: (class, stage placement: "single", "loop" or "v")
    "GPipe": (ScheduleGPipe, "single"),
    "1F1B": (Schedule1F1B, "single"),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, "loop"),
    "LoopedBFS": (ScheduleLoopedBFS, "loop"),
    "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, "loop"),
    "ZBVZeroBubble": (ScheduleZBVZeroBubble, "v"),
    "DualPipeV": (ScheduleDualPipeV, "v"),
}


class Block(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def build_full(seed: int = 0, dim: int = DIM, blocks: int = BLOCKS) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(Block(dim) for _ in range(blocks)))


def pp_dp_mesh(pp: int) -> DeviceMesh:
    return init_device_mesh("cpu", (pp, dist.get_world_size() // pp), mesh_dim_names=("pp", "dp"))


def dp_mesh_of(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel mesh the stages are sharded over: ``dp`` (FSDP), or ``(rep, shard)``
    (HSDP)."""
    names = mesh.mesh_dim_names or ()
    return mesh["dp"] if "dp" in names else mesh["rep", "shard"]


def dp_coords(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's data-parallel rank and the data-parallel size (ranks that see other data:
    tensor-parallel ranks share their data)."""
    dp = dp_mesh_of(mesh)
    if dp.ndim == 1:
        return dp.get_local_rank(), dp.size()
    r, s = dp.get_local_rank(0), dp.get_local_rank(1)
    return r * dp.size(1) + s, dp.size()


def stage_indices(placement: str, pp_rank: int, pp: int) -> list[int]:
    if placement == "single":
        return [pp_rank]
    if placement == "loop":
        return [pp_rank, pp_rank + pp]
    return [pp_rank, 2 * pp - 1 - pp_rank]


def batch(step: int, rows: int, dim: int = DIM) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def build_stages(
    schedule: str,
    shard: Callable[..., Any] | None,
    mesh: DeviceMesh,
    *,
    n_microbatches: int,
    dim: int = DIM,
    blocks: int = BLOCKS,
    shard_kwargs: dict[str, Any] | None = None,
    schedule_kwargs: dict[str, Any] | None = None,
    static_rows: int | None = None,
    parallelize: Callable[[nn.Module], None] | None = None,
) -> tuple[Any, list[nn.Module]]:
    """This rank's stage modules (sharded with ``shard`` over ``mesh["dp"]``, block by block
    then the stage root) and the schedule running them. ``static_rows``: give the stages
    their micro-batch shapes (``(static_rows, dim)`` in and out), so no metadata inference
    runs. ``parallelize(stage_module)`` (tensor parallelism, say) runs before sharding."""
    cls, placement = SCHEDULES[schedule]
    pp = mesh["pp"].size()
    pp_rank = mesh["pp"].get_local_rank()
    indices = stage_indices(placement, pp_rank, pp)
    num_stages = pp * len(indices)
    per_stage = blocks // num_stages
    full = build_full(dim=dim, blocks=blocks)
    modules, stages = [], []
    for s in indices:
        part = nn.Sequential(*full[s * per_stage : (s + 1) * per_stage])
        if parallelize is not None:
            parallelize(part)
        if shard is not None:
            dp = dp_mesh_of(mesh)
            for b in part:
                shard(b, mesh=dp, **(shard_kwargs or {}))
            shard(part, mesh=dp, **(shard_kwargs or {}))
        modules.append(part)
        shapes: dict[str, Any] = {}
        if static_rows is not None:
            shapes = {
                "input_args": torch.empty(static_rows, dim),
                "output_args": torch.empty(static_rows, dim),
            }
        stages.append(
            PipelineStage(
                part, s, num_stages, torch.device("cpu"), group=mesh["pp"].get_group(), **shapes
            )
        )
    kwargs = {"loss_fn": mse, **(schedule_kwargs or {})}
    sched = cls(stages[0] if placement == "single" else stages, n_microbatches, **kwargs)
    return sched, modules


def stage_blocks(schedule: str, mesh: DeviceMesh, blocks: int = BLOCKS) -> list[list[int]]:
    """The global block indices of each of this rank's stage modules."""
    _, placement = SCHEDULES[schedule]
    pp = mesh["pp"].size()
    indices = stage_indices(placement, mesh["pp"].get_local_rank(), pp)
    per_stage = blocks // (pp * len(indices))
    return [list(range(s * per_stage, (s + 1) * per_stage)) for s in indices]


def run_step(
    sched: Any, mesh: DeviceMesh, step: int, rows: int, dim: int = DIM
) -> torch.Tensor | None:
    """One schedule step on this rank's data-parallel slice; the mean micro-batch loss on
    the last stage's ranks (``None`` elsewhere)."""
    dp_rank, dp = dp_coords(mesh)
    x, y = batch(step, rows * dp, dim)
    x, y = x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]
    losses: list[torch.Tensor] = []
    stages = [sched._stage] if hasattr(sched, "_stage") else sched._stages
    args = (x,) if any(st.is_first for st in stages) else ()  # (torch 2.11 refuses others)
    target = y if any(st.is_last for st in stages) else None
    sched.step(*args, target=target, losses=losses)
    if not losses:
        return None
    return torch.stack([loss.detach() for loss in losses]).mean()
