"""Communication of ``fully_shard`` training: how many collectives, on which group, in what order.

Inside the rank function, ``comm_counter.CommCounter`` records each collective's kind, group
size and input numel (``torch.distributed``'s functions patched for the ``with`` block only;
see ``comm_counter.py``), and markers for when a block computes.

The model is ``MLPStack((7, 5, 3, 1))``: 3 blocks sharded with the case's
``reshard_after_forward``, then the root with the default (``None``: the root keeps its
parameters from forward through backward). ``root_params=False``: the root holds no
parameters, so 3 groups have parameters; ``root_params=True``: the root holds a
``head = Linear(1, 2)``, so 4 groups do. Per training step (forward + backward) we expect:

* forward: one all-gather per group with parameters, over the whole shard group;
* backward: one all-gather per block group with ``reshard_after_forward=True`` (whole group),
  none with ``False``, one over the 2-rank group with ``2`` (on 4 ranks); never for the root;
* backward: one reduce-scatter per group whose parameters require grad; no all-reduce (1D mesh).

Every test runs against ``fsdp2.fully_shard`` and ``torch.distributed.fsdp.fully_shard`` (the
``engine`` parameter), so a failure on ``fsdp2`` alone is a difference from torch's FSDP2.
torch only prefetches forward all-gathers when told to (``set_modules_to_forward_prefetch``),
so the forward-order test gives it the explicit list; fsdp2 prefetches implicitly (in the
order of the previous step's forward) and is tested both ways.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from comm_counter import Call, CommCounter, count_calls, prefetch_order, shard_numel
from helpers import ENGINES, N_BLOCKS, mine, world_mesh
from models import build, full_grads, local_loss, make_batch, shard_model
from torch.distributed.tensor import DTensor

from fsdp2._core.runtime.state import state_of


def _summary(calls: list[Call]) -> dict[tuple[str, str, int], int]:
    """``(phase, kind, group size) -> count``."""
    return count_calls(calls, "phase", "kind", "group_size")


def _expected_step(
    world_size: int, raf: bool | int, root_params: bool, frozen: tuple[int, ...] = ()
) -> dict[tuple[str, str, int], int]:
    groups = N_BLOCKS + int(root_params)  # groups with parameters
    want = {("forward", "AG", world_size): groups}
    if raf is True:
        want[("backward", "AG", world_size)] = N_BLOCKS
    elif raf is not False:
        want[("backward", "AG", raf)] = N_BLOCKS
    want[("backward", "RS", world_size)] = groups - len(frozen)
    return want


def _sharded_mlp(engine: str, raf: bool | int, root_params: bool) -> nn.Module:
    model = build("mlp_head" if root_params else "mlp")
    return shard_model(
        model, ENGINES[engine], world_mesh(), root_kwargs={}, reshard_after_forward=raf
    )


def _train_step(model: nn.Module, name: str, step: int, counter: CommCounter) -> None:
    x, y = make_batch(name, step)
    counter.phase = "forward"
    loss = local_loss(model, name, mine(x), mine(y))
    counter.phase = "backward"
    loss.backward()
    counter.phase = "?"


# ---------------------------------------------------------------------------------------------
# Collectives per training step


def _count_training_steps(engine: str, raf: bool | int, root_params: bool) -> None:
    world_size = dist.get_world_size()
    name = "mlp_head" if root_params else "mlp"
    model = _sharded_mlp(engine, raf, root_params)
    want = _expected_step(world_size, raf, root_params)
    per_step = []
    with CommCounter() as counter:
        for step in range(3):
            model.zero_grad()  # no optimizer step: every step has the same data flow
            _train_step(model, name, step, counter)
            per_step.append(counter.take())
    for step, events in enumerate(per_step):
        calls = [e for e in events if isinstance(e, Call)]
        # (whether the groups are live is test_int_reshard_uses_live_groups_after_teardown's job)
        assert _summary(calls) == want, f"step {step}: got {_summary(calls)}, want {want}"
    assert per_step[1] == per_step[2], (
        f"steps 2 and 3 issue different collectives:\n{per_step[1]}\n{per_step[2]}"
    )
    grads = full_grads(model)
    assert all(g is not None for g in grads.values()), f"missing grads: {grads}"
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), f"{n} not sharded"


def _step_cases() -> list:
    cases = []
    for world_size in (2, 4):
        for raf in (True, False, *((2,) if world_size == 4 else ())):
            for root_params in (False, True):
                ids = f"ws{world_size}-raf{raf}-root_params{root_params}"
                cases.append(pytest.param(world_size, raf, root_params, id=ids))
    return cases


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("world_size, raf, root_params", _step_cases())
def test_collectives_per_training_step(
    engine: str, world_size: int, raf: bool | int, root_params: bool
) -> None:
    run_on_ranks(world_size, _count_training_steps, engine, raf, root_params)


# ---------------------------------------------------------------------------------------------
# Evaluation forward under no_grad


def _count_eval_forward(engine: str, raf: bool, root_params: bool, expect_resharded: bool) -> None:
    world_size = dist.get_world_size()
    name = "mlp_head" if root_params else "mlp"
    model = _sharded_mlp(engine, raf, root_params)
    with CommCounter() as counter:
        _train_step(model, name, 0, counter)  # a training step first, as in a real loop
        counter.take()
        x, _ = make_batch(name, 1)
        counter.phase = "eval"
        with torch.no_grad():
            model(mine(x))
        calls = counter.calls
    want = {("eval", "AG", world_size): N_BLOCKS + int(root_params)}
    assert _summary(calls) == want, f"eval forward: got {_summary(calls)}, want {want}"
    if expect_resharded:
        for n, p in model.named_parameters():
            assert isinstance(p, DTensor), f"{n} is {type(p).__name__} after an eval forward"
        registered = [p for m in model.modules() for p in m._parameters.values() if p is not None]
        assert all(isinstance(p, DTensor) for p in registered), "an unsharded param is registered"


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("raf", [True, False], ids=["rafTrue", "rafFalse"])
@pytest.mark.parametrize("root_params", [False, True], ids=["root_noparams", "root_params"])
def test_eval_forward_gathers_once_and_reshards(engine: str, raf: bool, root_params: bool) -> None:
    # Both engines keep the groups that do not reshard after forward (the root by default,
    # all with raf=False) unsharded after a no_grad forward, until the next reshard (what
    # torch's FSDP2 registers then: tests/core/front/test_registration.py); only the all-gather
    # count is held there.
    expect_resharded = raf and not root_params
    run_on_ranks(2, _count_eval_forward, engine, raf, root_params, expect_resharded)


# ---------------------------------------------------------------------------------------------
# A frozen group


def _count_frozen(engine: str, raf: bool, frozen: int) -> None:
    world_size = dist.get_world_size()
    model = build("mlp")
    model.layers[frozen].requires_grad_(False)
    shard_model(model, ENGINES[engine], world_mesh(), root_kwargs={}, reshard_after_forward=raf)
    with CommCounter() as counter:
        for step in range(2):
            _train_step(model, "mlp", step, counter)
            calls = counter.take_calls()
            want = _expected_step(world_size, raf, False, frozen=(frozen,))
            got = _summary(calls)
            if frozen == 0 and raf:
                # Block 0's backward never runs (its input and params need no grad), but block
                # 1's pre-backward may prefetch it (torch does): 2 or 3 backward all-gathers.
                key = ("backward", "AG", world_size)
                assert got.pop(key, 0) in (N_BLOCKS - 1, N_BLOCKS), f"step {step}: {calls}"
                want.pop(key)
            assert got == want, f"step {step}: got {got}, want {want}"
    frozen_numel = shard_numel(list(model.layers[frozen].parameters()), world_size)
    rs_numels = [c.numel for c in calls if c.kind == "RS"]
    assert frozen_numel * world_size not in rs_numels, f"frozen group reduced: {rs_numels}"
    grads = full_grads(model)
    for n, g in grads.items():
        if n.startswith(f"layers.{frozen}."):
            assert g is None, f"frozen {n} has a gradient"
        else:
            assert g is not None, f"{n} has no gradient"


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("raf", [True, False], ids=["rafTrue", "rafFalse"])
@pytest.mark.parametrize("frozen", [0, 1], ids=["frozen_block0", "frozen_block1"])
def test_frozen_group_is_not_reduced(engine: str, raf: bool, frozen: int) -> None:
    # Block 1's backward still runs (block 0 needs its input gradient), so it is all-gathered
    # like the others but has nothing to reduce. Block 0's backward does not run at all.
    run_on_ranks(2, _count_frozen, engine, raf, frozen)


# ---------------------------------------------------------------------------------------------
# Prefetch order


def _record_order(
    engine: str, prefetch: str, root_params: bool, root: str = "trainable"
) -> tuple[list[str], list[str]]:
    world_size = dist.get_world_size()
    name = "mlp_head" if root_params else "mlp"
    model = build(name)
    if root == "frozen":
        model.head.requires_grad_(False)
    model = shard_model(model, ENGINES[engine], world_mesh(), root_kwargs={})
    layers = list(model.layers)
    if prefetch == "explicit":
        chain = ([model] if root_params else []) + layers
        for cur, nxt in zip(chain[:-1], chain[1:], strict=True):
            cur.set_modules_to_forward_prefetch([nxt])
    if root == "explicit":
        model.set_modules_to_backward_prefetch([layers[-1]])
    groups = {f"B{i}": list(b.parameters()) for i, b in enumerate(layers)}
    if root_params:
        groups["R"] = list(model.head.parameters())
    by_numel = {shard_numel(ps, world_size): g for g, ps in groups.items()}
    assert len(by_numel) == len(groups), f"ambiguous group sizes: {by_numel}"
    with CommCounter() as counter:
        computes = [(f"B{i}", b.lin) for i, b in enumerate(layers)]
        if root_params:
            computes.append(("R", model.head))
        counter.mark_computes(computes)
        _train_step(model, name, 0, counter)
        counter.take()
        _train_step(model, name, 1, counter)  # implicit prefetch knows the order from step 1
        events = counter.take()
    if engine == "fsdp2" and root_params:  # the deferred prefetch's hooks are gone
        group = state_of(model).groups[0]
        assert all(not p.unsharded._backward_hooks for p in group.params), "hooks left"
    return prefetch_order(events, "forward", by_numel), prefetch_order(events, "backward", by_numel)


def _order_cases() -> list:
    return [
        pytest.param("fsdp2", "implicit", id="fsdp2-implicit"),
        pytest.param("fsdp2", "explicit", id="fsdp2-explicit"),
        pytest.param("torch", "explicit", id="torch-explicit"),
    ]


@pytest.mark.parametrize("root_params", [False, True], ids=["root_noparams", "root_params"])
@pytest.mark.parametrize("engine, prefetch", _order_cases())
def test_forward_prefetch_order(engine: str, prefetch: str, root_params: bool) -> None:
    results = run_on_ranks(2, _record_order, engine, prefetch, root_params)
    assert results[0] == results[1], f"ranks disagree: {results}"
    forward, _ = results[0]
    want = ["AG(B0)", "AG(B1)", "C(B0)", "AG(B2)", "C(B1)", "C(B2)"]
    if root_params:  # the root's own all-gather comes first and prefetches block 0's
        want = ["AG(R)", *want, "C(R)"]
    assert forward == want, f"forward order {forward}, want {want}"


@pytest.mark.parametrize("root_params", [False, True], ids=["root_noparams", "root_params"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_backward_prefetch_order(engine: str, root_params: bool) -> None:
    # Blocks reshard after forward, the root does not: backward gathers blocks 2, 1, 0, each
    # block's pre-backward prefetching the block that runs backward next.
    results = run_on_ranks(2, _record_order, engine, "implicit", root_params)
    assert results[0] == results[1], f"ranks disagree: {results}"
    _, backward = results[0]
    want = ["AG(B2)", "AG(B1)", "Cb(B2)", "AG(B0)", "Cb(B1)", "Cb(B0)"]
    if root_params and engine == "torch":  # the root's pre-backward prefetches block 2
        want = ["AG(B2)", "Cb(R)", *want[1:]]
    elif root_params:  # fsdp2: once the head has its gradient ([Note: root prefetch])
        want = ["Cb(R)", *want]
    assert backward == want, f"backward order {backward}, want {want}"


@pytest.mark.parametrize("root", ["frozen", "explicit"])
def test_root_backward_prefetch_at_once(root: str) -> None:
    # fsdp2 defers the root's implicit backward prefetch until one of its parameters has a
    # gradient ([Note: root prefetch]); a frozen root, or an explicit list, prefetches at
    # the root's pre-backward as torch's FSDP2 does.
    results = run_on_ranks(2, _record_order, "fsdp2", "implicit", True, root)
    assert results[0] == results[1], f"ranks disagree: {results}"
    _, backward = results[0]
    want = ["AG(B2)", "Cb(R)", "AG(B1)", "Cb(B2)", "AG(B0)", "Cb(B1)", "Cb(B0)"]
    assert backward == want, f"backward order {backward}, want {want}"


# ---------------------------------------------------------------------------------------------
# reshard_after_forward=int after process groups were torn down


def _count_after_teardown(engine: str) -> None:
    world_size = dist.get_world_size()
    first = _sharded_mlp(engine, 2, False)
    with CommCounter() as counter:
        _train_step(first, "mlp", 0, counter)
    del first
    # What a program does between two jobs (and the test harness between two tests): destroy
    # every process group but the default one. A model built afterwards must not use them.
    world = dist.GroupMember.WORLD
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)
    second = _sharded_mlp(engine, 2, False)
    with CommCounter() as counter:
        _train_step(second, "mlp", 0, counter)
        calls = counter.calls
    want = _expected_step(world_size, 2, False)
    assert _summary(calls) == want, f"got {_summary(calls)}, want {want}"
    dead = [c for c in calls if not c.live_group]
    assert not dead, f"collectives on destroyed process groups: {dead}"


@pytest.mark.parametrize("engine", list(ENGINES))
def test_int_reshard_uses_live_groups_after_teardown(engine: str) -> None:
    run_on_ranks(4, _count_after_teardown, engine)
