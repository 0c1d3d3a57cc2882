"""Where collectives run: set_separate_reduce_scatter_group gives reduce-scatters a
process group of their own (numbers unchanged), and the NCCL-only buffer options are
accepted as no-ops on a CPU mesh."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from comm_counter import spy_all_gathers, spy_reduce_scatters
from torch.distributed.device_mesh import init_device_mesh

from fsdp2 import fully_shard


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 1))


def _train(separate: bool, option: str) -> list[torch.Tensor]:
    ws, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (ws,))
    model = _model()
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    if separate:
        model.set_separate_reduce_scatter_group(True)
    if option == "pg_alloc":
        for m in model.modules():
            if hasattr(m, "set_allocate_memory_from_process_group_for_comm"):
                m.set_allocate_memory_from_process_group_for_comm(True)
    elif option == "symm_mem":
        model.set_symm_mem_for_comm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    groups = {"ag": set(), "rs": set()}
    for step in range(3):
        torch.manual_seed(step)
        x = torch.randn(4 * ws, 6)[rank * 4 : (rank + 1) * 4]
        with (
            spy_all_gathers(lambda t, group: groups["ag"].add(id(group))),
            spy_reduce_scatters(lambda t, op, group: groups["rs"].add(id(group))),
        ):
            model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert groups["rs"].isdisjoint(groups["ag"]) == separate, groups
    return [p.full_tensor() for p in model.parameters()]


def _compare(option: str) -> None:
    base = _train(False, "none")
    other = _train(True, option)
    for a, b in zip(base, other, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("option", ["none", "pg_alloc", "symm_mem"])
def test_separate_reduce_scatter_group(world_size: int, option: str) -> None:
    run_on_ranks(world_size, _compare, option)
