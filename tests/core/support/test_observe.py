"""The engine's observation interface (``fsdp2._core.support.observe``: ``Observer``, ``HUB``).

On 2 ranks, an ``mlp_head`` model (3 blocks and the root's head, ``reshard_after_forward``
True) trains two steps with an observer subscribed:

* ``collective``: per step one all-gather per group in forward, one per block in backward,
  one reduce-scatter per group; each names its group (the module path), with the numels,
  dtype, process group (the mesh's) and group size the collective really has (the
  all-gather's input is the group's flat shard, of ``shard_numel`` elements);
* ``enter`` / ``exit``: balanced, every collective is announced outside any "... issue"
  region and issued inside one, and the hooks' regions name their groups;
* ``resized``: every unsharded buffer freed is one given its bytes back before, with its
  group as owner, and at the end of a step every group's buffers are freed;
* ``gradients_taken``: once per group per step, the unsharded gradients (one per parameter);
* ``step_phase``: forward (a new step), backward, final callback, time between steps;
* unsubscribing leaves ``HUB.observers`` empty, and an observer that raises in
  ``collective`` stops the collective on every rank before it is issued (no hang): the
  error reaches the caller and ``reset_iter_state`` recovers for the next step.

``fsdp2.timeline``'s ``comm_bytes`` (an observer too) equals the bytes the counter sees.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks
from comm_counter import CommCounter, shard_numel
from helpers import N_BLOCKS, NAME, mine, sharded
from models import local_loss, make_batch

import fsdp2
from fsdp2._core.runtime.state import state_of
from fsdp2._core.support.observe import HUB, Collective, Observer

GROUPS = N_BLOCKS + 1


class _Recorder(Observer):
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.depth: list[str] = []

    def enter(self, kind: str, what: str) -> None:
        self.depth.append(kind)
        self.events.append(("enter", (kind, what)))

    def exit(self, kind: str) -> None:
        assert self.depth and self.depth[-1] == kind, (self.depth, kind)
        self.depth.pop()
        self.events.append(("exit", kind))

    def collective(self, c: Collective) -> None:
        assert not any(k.endswith(" issue") for k in self.depth), "announced while issuing"
        self.events.append(("collective", c))

    def resized(self, t: torch.Tensor, owner: str) -> None:
        self.events.append(("resized", (t, t.untyped_storage().nbytes(), owner)))

    def gradients_taken(self, grads: list[torch.Tensor]) -> None:
        self.events.append(("grads", list(grads)))

    def step_phase(self, name: str, new_step: bool) -> None:
        self.events.append(("phase", (name, new_step)))

    def of(self, kind: str) -> list[Any]:
        return [e for k, e in self.events if k == kind]


def _step(model: torch.nn.Module, step: int) -> None:
    x, y = make_batch(NAME, step)
    local_loss(model, NAME, mine(x), mine(y)).backward()


def _observed_steps() -> None:
    model = sharded("fsdp2", NAME)
    groups = {id(g): g for m in model.modules() if (st := state_of(m)) for g in st.groups}
    paths = {g.path for g in groups.values()}
    assert not HUB.observers
    rec = _Recorder()
    with HUB.observing(rec):
        for step in range(2):
            _step(model, step)
    assert not HUB.observers, "unsubscribed after the block"
    assert not rec.depth, rec.depth
    paths = {g.path for g in groups.values()}  # set at lazy init

    calls = rec.of("collective")
    kinds = [c.kind for c in calls]
    assert kinds.count("all-gather") == 2 * (GROUPS + N_BLOCKS), kinds
    assert kinds.count("reduce-scatter") == 2 * GROUPS, kinds
    assert "all-reduce" not in kinds
    world = dist.get_world_size()
    by_path = {g.path: g for g in groups.values()}
    for c in calls:
        g = by_path[c.what]
        assert c.group is g.info.shard_group and c.group_size == world, c
        assert c.dtype == torch.float32
        want = shard_numel([p.sharded.full_tensor() for p in g.params], world)
        if c.kind == "all-gather":
            assert (c.input_numel, c.numel) == (want, world * want), (c, want)
        else:
            assert c.numel == c.input_numel == world * want, (c, want)
    assert {c.what for c in calls} == paths

    # every collective is issued inside its region, right after being announced
    for i, (k, e) in enumerate(rec.events):
        if k == "collective":
            issue = "all_gather issue" if e.kind == "all-gather" else "reduce_scatter"
            nxt = [x for x in rec.events[i + 1 :] if x[0] == "enter"][0][1]
            assert nxt[0].startswith(issue), (e, nxt)
    hooks = [e for e in rec.of("enter") if e[0].startswith("hook")]
    # (the root's first pre-forward runs its lazy init, which sets the paths: it names the
    # root by its class until then)
    assert paths <= {w for k, w in hooks if k == "hook pre_forward"}
    assert ("hook", "final_callback") in hooks

    # resizes: the group's own buffers, freed only after being given their bytes
    live: dict[int, str] = {}
    for t, nbytes, owner in rec.of("resized"):
        assert owner in paths, owner
        if nbytes:
            live[id(t)] = owner
        else:
            assert live.pop(id(t), owner) == owner
    assert not live, f"unsharded buffers left allocated after the step: {live}"

    taken = rec.of("grads")
    assert len(taken) == 2 * GROUPS
    assert sorted(len(g) for g in taken) == sorted(
        len(g.grad_params) for g in groups.values() for _ in range(2)
    )
    phases = rec.of("phase")
    one = [
        ("forward", True),
        ("backward", False),
        ("final callback of the backward", False),
        ("time between steps", False),
    ]
    assert phases == one * 2, phases


def test_observer_sees_each_step() -> None:
    run_on_ranks(2, _observed_steps)


class _Refuse(Observer):
    def collective(self, c: Collective) -> None:
        raise RuntimeError(f"refused: {c.kind} of {c.what}")


def _refused() -> None:
    model = sharded("fsdp2", NAME)
    _step(model, 0)
    with HUB.observing(_Refuse()):
        with pytest.raises(RuntimeError, match="refused: all-gather of "):
            _step(model, 1)
    assert not HUB.observers
    model.reset_iter_state()
    _step(model, 2)  # no collective was half-issued: the ranks still agree


def test_observer_can_stop_a_collective_before_it_is_issued() -> None:
    run_on_ranks(2, _refused, timeout=120)


def _timeline_bytes() -> None:
    model = sharded("fsdp2", NAME)
    _step(model, 0)
    with CommCounter() as counter, fsdp2.timeline(None) as tl:
        _step(model, 1)
    sent: dict[str, int] = {}
    for c in counter.calls:
        op = {"AG": "all_gather", "RS": "reduce_scatter"}[c.kind]
        sent[op] = sent.get(op, 0) + c.numel * 4  # fp32
    assert tl.comm_bytes == sent, (tl.comm_bytes, sent)


def test_timeline_counts_bytes_per_collective() -> None:
    run_on_ranks(2, _timeline_bytes)
