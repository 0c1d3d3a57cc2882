"""Property: in any order of the calls a training script makes, a sharded model trains like an
unsharded replica, or raises the documented error on every rank.

A hypothesis state machine (``_orders.CallOrders``) drives an fsdp2 model and its replica
through random sequences of forward + backward, forwards alone (with and without grad, in
eval mode, several before one backward), ``backward(retain_graph=True)`` twice, gradient
penalties (double backward), ``requires_grad_`` on random submodules, optimizers (re)built at
random points (right after a forward included), optimizer steps, ``zero_grad``,
``clip_grad_norm_``, state-dict and DCP round trips, explicit ``unshard()`` / ``reshard()``,
no-sync micro-steps, ``set_reshard_after_forward`` changes and a forward that raises followed
by ``reset_iter_state()``, with mixed precision drawn per run, on 1-4 ranks. After every rule
the parameters (and, where defined, the gradients) must equal the replica's.

Each world size is spawned once and runs its state machines inside the ranks: every rank
draws the same rules (same seed), and the ranks agree on each outcome before one raises.
Profiles (``_profiles.py``): ``ci`` (fixed seed, sized to the main suite's budget) and
``long`` (``HYPOTHESIS_PROFILE=long``, seed from ``FSDP2_PROPERTY_SEED`` or random, printed).
A failure prints the rules that led to it: turn them into a test in
``test_call_order_regressions.py``. See docs/property_tests.md.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch.distributed as dist
from _harness import run_on_ranks
from _orders import CallOrders
from _profiles import ORDER_RUNS, ORDER_STEPS, SEED_ENV, profile, profile_name
from hypothesis import seed as hypothesis_seed
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from torch.distributed.device_mesh import init_device_mesh

WORLD_SIZES = [1, 2, 3, 4]


def _orders(
    world_size: int, name: str, runs: int, steps: int, seed: int | None
) -> dict[str, float]:
    """Rank function: the state machine runs; returns counts (the same on every rank)."""
    stats: dict[str, float] = {}

    class Machine(CallOrders):
        mesh = init_device_mesh("cpu", (world_size,))

    Machine.stats = stats
    if seed is not None:
        Machine = hypothesis_seed(seed)(Machine)  # type: ignore[misc]
    start = time.perf_counter()
    run_state_machine_as_test(
        Machine, settings=settings(profile(name, runs), stateful_step_count=steps)
    )
    stats["seconds"] = round(time.perf_counter() - start, 1)
    dist.barrier()
    return stats


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_call_orders_match_replica(world_size: int) -> None:
    name = profile_name()
    seed = None
    if name != "ci":
        seed = int(os.environ.get(SEED_ENV) or random.randrange(2**32))
        print(f"{SEED_ENV}={seed} HYPOTHESIS_PROFILE={name}")
    runs, steps = ORDER_RUNS[name][world_size], ORDER_STEPS[name]
    results = run_on_ranks(
        world_size,
        _orders,
        world_size,
        name,
        runs,
        steps,
        seed,
        timeout=300.0 + 4.0 * runs * steps / 10,
    )
    print(f"world size {world_size}: {results[0]}")
    assert all(r["rules"] == results[0]["rules"] for r in results), results
    assert results[0]["runs"] >= runs, results[0]
