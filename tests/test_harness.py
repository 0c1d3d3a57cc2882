"""Checks the multi-process test harness (`_harness.run_on_ranks`) itself.

Collectives reach every rank, results come back in rank order, a raising rank is reported
with its traceback, a hang is reported within the timeout with the stuck ranks named and the
next call works on a fresh pool, and a healthy pool is reused across calls.
"""

from __future__ import annotations

import os
import signal
import sys

import _harness
import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks

WORLD_SIZES = [2, 4]


def _all_reduce_rank() -> float:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _rank_and_tensor() -> tuple[int, int, torch.Tensor]:
    rank = dist.get_rank()
    return rank, dist.get_world_size(), torch.full((2,), float(rank))


def _raise_on_rank(bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}")


def _hang_on_rank_zero() -> None:
    # Only rank 0 enters the collective; it waits for peers that never come.
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))


def _pid() -> int:
    return os.getpid()


def _make_subgroup_and_count_groups() -> int:
    group = dist.new_group(list(range(dist.get_world_size())))
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    assert t.item() == dist.get_world_size()
    return len(dist.distributed_c10d._world.pg_map)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_sums_on_every_rank(world_size: int) -> None:
    expected = world_size * (world_size + 1) / 2
    assert run_on_ranks(world_size, _all_reduce_rank) == [expected] * world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_results_come_back_in_rank_order(world_size: int) -> None:
    results = run_on_ranks(world_size, _rank_and_tensor)
    for rank, (got_rank, got_world_size, tensor) in enumerate(results):
        assert (got_rank, got_world_size) == (rank, world_size)
        torch.testing.assert_close(tensor, torch.full((2,), float(rank)))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_raising_rank_is_reported_with_traceback(world_size: int) -> None:
    bad_rank = world_size - 1
    with pytest.raises(AssertionError) as info:
        run_on_ranks(world_size, _raise_on_rank, bad_rank)
    message = str(info.value)
    assert f"rank {bad_rank} failed:\nTraceback" in message
    assert f"ValueError: boom from rank {bad_rank}" in message
    assert "in _raise_on_rank" in message
    assert "rank 0 failed" not in message
    # The failed pool was discarded; the next call gets a working one.
    assert run_on_ranks(world_size, _all_reduce_rank) == [world_size * (world_size + 1) / 2] * (
        world_size
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_hang_is_reported_and_pool_recreated(world_size: int) -> None:
    pids_before = run_on_ranks(world_size, _pid)
    with pytest.raises(AssertionError) as info:  # (the other ranks reply in milliseconds)
        run_on_ranks(world_size, _hang_on_rank_zero, timeout=1.5)
    message = str(info.value)
    assert "ranks [0] did not finish within the timeout of 1.5 s" in message
    assert "rank 0 Python stacks:" in message
    assert "_hang_on_rank_zero" in message  # the dumped stack shows where rank 0 is stuck
    pids_after = run_on_ranks(world_size, _pid)
    assert set(pids_after).isdisjoint(pids_before)
    assert run_on_ranks(world_size, _all_reduce_rank) == [world_size * (world_size + 1) / 2] * (
        world_size
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_pool_is_reused(world_size: int) -> None:
    first = run_on_ranks(world_size, _pid)
    second = run_on_ranks(world_size, _pid)
    assert first == second
    assert len(set(first)) == world_size
    assert os.getpid() not in first


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_subgroups_do_not_leak_across_tasks(world_size: int) -> None:
    first = run_on_ranks(world_size, _make_subgroup_and_count_groups)
    second = run_on_ranks(world_size, _make_subgroup_and_count_groups)
    assert first == second == [2] * world_size  # the default group plus this task's one


def test_unpicklable_fn_is_rejected_in_the_parent() -> None:
    with pytest.raises(TypeError, match="module-level function"):
        run_on_ranks(2, lambda: None)


def _raise_while_others_wait() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 gives up before the collective")
    dist.all_reduce(torch.ones(1))  # the other ranks wait here for rank 1


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_failure_reports_ranks_blocked_by_it(world_size: int, monkeypatch) -> None:
    # the blocked ranks never reply: a shorter grace after rank 1's failure reports the same
    monkeypatch.setattr(_harness, "_FAILURE_GRACE_S", 0.5)
    with pytest.raises(AssertionError) as info:
        run_on_ranks(world_size, _raise_while_others_wait)
    message = str(info.value)
    assert "rank 1 failed:\nTraceback" in message
    assert "RuntimeError: rank 1 gives up before the collective" in message
    blocked = [rank for rank in range(world_size) if rank != 1]
    assert f"ranks {blocked} did not finish after another rank failed" in message
    assert "in _raise_while_others_wait" in message.split("rank 0 Python stacks:")[1]


def _segfault_rank_one(marker: str) -> int:
    """Rank 1 dies of SIGSEGV unless ``marker`` exists (it creates it first); a crashed
    rank's peers may be waiting in a collective: they must be cleaned up too."""
    if dist.get_rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()
    return dist.get_rank()


def test_crashed_worker_is_retried_once_with_a_warning(tmp_path) -> None:
    marker = str(tmp_path / "crashed-once")
    with pytest.warns(RuntimeWarning, match=r"ranks \[1\] crashed .*reran the task"):
        assert run_on_ranks(2, _segfault_rank_one, marker) == [0, 1]


def _always_segfault_rank_one() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


def test_worker_crashing_twice_fails() -> None:
    with pytest.warns(RuntimeWarning), pytest.raises(AssertionError) as info:
        run_on_ranks(2, _always_segfault_rank_one, timeout=60)
    assert "rank 1 failed:\nworker died (exit code -11)" in str(info.value)
    assert run_on_ranks(2, _all_reduce_rank) == [3.0, 3.0]


def _gloo_threads() -> int:
    tasks = os.listdir("/proc/self/task")
    return sum(open(f"/proc/self/task/{t}/comm").read().startswith("pt_gloo") for t in tasks)


def _import_then_shard_on_a_new_mesh(module_dir: str, module: str) -> None:
    """Imports a module no task imported before (so the worker freezes what is alive after
    it), then trains an fsdp2 model on a 2D mesh whose groups are this task's own."""
    import importlib

    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2 import fully_shard

    sys.path.insert(0, module_dir)
    try:
        importlib.import_module(module)
    finally:
        sys.path.remove(module_dir)
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("r", "s"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.ones(2, 4)).sum().backward()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_groups_of_a_task_that_imported_are_freed(tmp_path) -> None:
    """[Note: worker threads]: a task that imported a module left its groups' threads behind
    for the rest of the worker's life; now the next task starts with none of them."""
    counts = []
    for i in range(3):
        (tmp_path / f"fresh_module_{i}.py").write_text("X = 1\n")
        run_on_ranks(2, _import_then_shard_on_a_new_mesh, str(tmp_path), f"fresh_module_{i}")
        counts.append(run_on_ranks(2, _gloo_threads))
    assert counts[0] == counts[1] == counts[2], counts
