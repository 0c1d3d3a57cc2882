"""CPU offload by parameter name and by budget (torch main, pytorch PR 188120):
``fully_shard(offload_policy={name: policy})`` ([Note: offload by name] in
fsdp2/_core/front/offload.py) and ``fsdp2.cpu_offload_by_budget``.

* torch's ``test_fully_shard_offload_selector.py`` (all 8 test functions, pure CPU, no
  process group), ported to pytest with fsdp2's imports: the largest-first prefix selection
  (boundaries, tie-break by name, never over budget, monotonic, deterministic) and the
  budget map (names, ``CPUOffloadPolicy`` values, ``pin_memory`` passed on, a negative budget
  refused). The selection is a prefix, not a knapsack (399 bytes for 400/200/40: nothing).
* A mapping given to ``fully_shard``: names absent stay on the device, the call's
  parameters are grouped by policy (one all-gather and one reduce-scatter per policy), a
  call mixing offloaded, phase-offloaded and on-device parameters trains like the
  replicated reference, and a mapping offloading all (none) of a call's parameters trains
  bitwise like torch's FSDP2 with ``CPUOffloadPolicy`` (``OffloadPolicy``) for that call; a
  budget map per block; a list of modules (names relative to each module). The seam's
  ``unit_settings`` reports each call's one policy, or every name's policy where a mapping
  split them (given back to ``fully_shard``: the same groups).
* Bad input, raised before any collective and leaving the module as it was: a name that is
  no parameter of the call (unknown, a submodule's already sharded, in ``ignored_params``, a
  tied parameter's second name: ``ValueError`` naming it and why), a key that is no string
  or a value that is no offload policy (``TypeError``), a budget that is negative
  (``ValueError``, "non-negative") or no number (``TypeError``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from comm_counter import CommCounter
from helpers import NAME, expect_raises, mine, train_and_compare, world_mesh
from models import build, local_loss, make_batch
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp2
from fsdp2 import CPUOffloadPolicy, cpu_offload_by_budget
from fsdp2._core.front.seam import unit_settings
from fsdp2._core.runtime.state import state_of
from fsdp2.api import _select_largest_first

# ---------------------------------------------------------------------------------------------
# torch's test_fully_shard_offload_selector.py (TestOffloadSelector), ported


class _ThreeParam(nn.Module):
    # float32 byte sizes: big=400, mid=200, small=40 (total 640)
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.zeros(100))
        self.mid = nn.Parameter(torch.zeros(50))
        self.small = nn.Parameter(torch.zeros(10))


def _items() -> list[tuple[str, int]]:
    return [("a", 40), ("b", 100), ("c", 30), ("d", 100)]


def test_boundaries() -> None:
    items = _items()
    total = sum(nbytes for _, nbytes in items)
    assert _select_largest_first(items, 0) == []
    assert set(_select_largest_first(items, total)) == {"a", "b", "c", "d"}
    assert set(_select_largest_first(items, total + 1000)) == {"a", "b", "c", "d"}


def test_largest_first_with_tie_break() -> None:
    # b and d tie at 100; the tie breaks on the name, so b precedes d.
    assert _select_largest_first(_items(), 100) == ["b"]
    assert _select_largest_first(_items(), 200) == ["b", "d"]
    # a (40) is larger than c (30) and is taken first among the remainder.
    assert _select_largest_first(_items(), 240) == ["b", "d", "a"]


def test_never_overshoots() -> None:
    items = _items()
    for budget in range(0, sum(n for _, n in items) + 5):
        selected = set(_select_largest_first(items, budget))
        used = sum(n for fqn, n in items if fqn in selected)
        assert used <= budget


def test_monotonic_superset() -> None:
    items = _items()
    prev: set[str] = set()
    for budget in range(0, sum(n for _, n in items) + 5):
        cur = set(_select_largest_first(items, budget))
        assert prev.issubset(cur)
        prev = cur


def test_deterministic() -> None:
    items = _items()
    first = _select_largest_first(items, 170)
    for _ in range(5):
        assert _select_largest_first(items, 170) == first
    # Input order must not change the result.
    assert _select_largest_first(list(reversed(items)), 170) == first


@pytest.mark.parametrize(
    "budget,expected",
    [
        (0, set()),
        (399, set()),
        (400, {"big"}),
        (600, {"big", "mid"}),
        (640, {"big", "mid", "small"}),
        (10**9, {"big", "mid", "small"}),
    ],
)
def test_cpu_offload_by_budget_map(budget: int, expected: set[str]) -> None:
    offload_map = cpu_offload_by_budget(_ThreeParam(), budget)
    assert set(offload_map) == expected
    assert "missing" not in offload_map
    for policy in offload_map.values():
        assert isinstance(policy, CPUOffloadPolicy)
        assert policy.pin_memory


def test_cpu_offload_by_budget_pin_memory() -> None:
    offload_map = cpu_offload_by_budget(_ThreeParam(), 10**9, pin_memory=False)
    assert all(not p.pin_memory for p in offload_map.values())


def test_cpu_offload_by_budget_rejects_negative() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        cpu_offload_by_budget(_ThreeParam(), -1)


# ---------------------------------------------------------------------------------------------
# fsdp2's own: the budget map's edges


def test_budget_is_a_prefix_not_a_knapsack() -> None:
    # 399 bytes would hold mid + small (240), but the largest (400) does not fit: nothing.
    assert cpu_offload_by_budget(_ThreeParam(), 399) == {}
    assert set(cpu_offload_by_budget(_ThreeParam(), 639)) == {"big", "mid"}
    tied = nn.Module()
    tied.a = nn.Linear(4, 4, bias=False)
    tied.b = nn.Linear(4, 4, bias=False)
    tied.b.weight = tied.a.weight  # one parameter, one name (named_parameters' first)
    assert list(cpu_offload_by_budget(tied, 64)) == ["a.weight"]
    assert cpu_offload_by_budget(_ThreeParam(), 400.5) == {"big": CPUOffloadPolicy()}


@pytest.mark.parametrize("budget", [True, "400", None])
def test_budget_must_be_a_number(budget: Any) -> None:
    with pytest.raises(TypeError, match="budget_bytes must be a number"):
        cpu_offload_by_budget(_ThreeParam(), budget)


def test_budget_takes_a_module() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        cpu_offload_by_budget([nn.Linear(2, 2)], 10)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# The mapping given to fully_shard

OFF = CPUOffloadPolicy(pin_memory=False)
FWD_ONLY = CPUOffloadPolicy(pin_memory=False, offload_after_backward=False)


def _policies(model: nn.Module) -> dict[str, Any]:
    """``parameter name -> offload policy`` of the group holding it, for every parameter."""
    owner = {}
    for m in model.modules():
        st = state_of(m)
        for g in st.groups if st is not None else ():
            for p in g.params:
                owner[id(p.sharded)] = g.offload_policy
    return {n: owner[id(p)] for n, p in model.named_parameters()}


def _shard_mixed(model: nn.Module, mesh: Any) -> nn.Module:
    """Block 0 offloads its weight only, block 1 its bias with the state on the device at
    rest, block 2 nothing; the root (its head) offloads both of its parameters."""
    maps = [{"lin.weight": OFF}, {"lin.bias": FWD_ONLY}, {}]
    for block, offload in zip(model.layers, maps, strict=True):
        fsdp2.fully_shard(block, mesh=mesh, offload_policy=offload)
    fsdp2.fully_shard(model, mesh=mesh, offload_policy={"head.weight": OFF, "head.bias": OFF})
    return model


def _mixed() -> None:
    mesh = world_mesh()
    ours = _shard_mixed(build(NAME), mesh)
    on_device = fsdp2.OffloadPolicy()
    assert _policies(ours) == {
        "layers.0.lin.weight": OFF,
        "layers.0.lin.bias": on_device,  # absent from the map: on the device
        "layers.1.lin.weight": on_device,
        "layers.1.lin.bias": FWD_ONLY,
        "layers.2.lin.weight": on_device,
        "layers.2.lin.bias": on_device,
        "head.weight": OFF,
        "head.bias": OFF,
    }
    # what the seam reports: each call's one policy, or every name's where a mapping split
    # them; given back to fully_shard, the same groups
    settings = {m: s.offload_policy for m, s in unit_settings(ours).items()}
    assert settings[ours.layers[0]] == {"lin.weight": OFF, "lin.bias": on_device}
    assert settings[ours.layers[1]] == {"lin.weight": on_device, "lin.bias": FWD_ONLY}
    assert (settings[ours.layers[2]], settings[ours]) == (on_device, OFF)
    again = build(NAME)
    for block, old in zip(again.layers, ours.layers, strict=True):
        fsdp2.fully_shard(block, mesh=mesh, offload_policy=settings[old])
    fsdp2.fully_shard(again, mesh=mesh, offload_policy=settings[ours])
    assert _policies(again) == _policies(ours)
    # a group per policy: 6 groups, so 6 all-gathers in forward (the root's kept for
    # backward: 5 in backward) and 6 reduce-scatters
    x, y = make_batch(NAME, 0)
    with CommCounter() as calls:
        local_loss(ours, NAME, mine(x), mine(y)).backward()
    kinds = [c.kind for c in calls.calls]
    assert kinds.count("AG") == 6 + 5 and kinds.count("RS") == 6, kinds
    # trains like the replica; a call offloading all (none) of its parameters like torch's
    # FSDP2 with CPUOffloadPolicy (OffloadPolicy) on it
    ours = _shard_mixed(build(NAME), mesh)
    all_or_none = build(NAME)
    for i, block in enumerate(all_or_none.layers):
        policy = {"lin.weight": OFF, "lin.bias": OFF} if i == 0 else {}
        fsdp2.fully_shard(block, mesh=mesh, offload_policy=policy)
    fsdp2.fully_shard(all_or_none, mesh=mesh, offload_policy={"head.weight": OFF, "head.bias": OFF})
    theirs = build(NAME)
    for i, block in enumerate(theirs.layers):
        policy = TorchCPUOffloadPolicy(pin_memory=False) if i == 0 else TorchOffloadPolicy()
        torch_fully_shard(block, mesh=mesh, offload_policy=policy)
    torch_fully_shard(theirs, mesh=mesh, offload_policy=TorchCPUOffloadPolicy(pin_memory=False))
    train_and_compare(
        build(NAME),
        {"mixed": ours, "fsdp2": all_or_none, "torch": theirs},
        batch=lambda step: make_batch(NAME, step),
        loss=lambda m, x, y: local_loss(m, NAME, x, y),
    )


def test_mapping_mixes_offloaded_and_device_parameters() -> None:
    run_on_ranks(2, _mixed)


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _by_budget_and_lists() -> None:
    mesh = world_mesh()
    # a budget map per block: the largest parameters of each block offloaded
    model = build(NAME)
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh, offload_policy=cpu_offload_by_budget(block, 60))
    fsdp2.fully_shard(model, mesh=mesh)
    got = {n for n, p in _policies(model).items() if isinstance(p, CPUOffloadPolicy)}
    # weights 5x7, 3x5, 1x3 fp32: 140, 60, 12 bytes; biases 20, 12, 4
    assert got == {"layers.1.lin.weight", "layers.2.lin.weight", "layers.2.lin.bias"}, got
    assert _policies(model)["layers.2.lin.weight"] == CPUOffloadPolicy()  # pinned by default
    x, y = make_batch(NAME, 0)
    local_loss(model, NAME, mine(x), mine(y)).backward()
    # a list of modules: a name is relative to each module of the list
    pair = _Pair()
    fsdp2.fully_shard([pair.a, pair.b], mesh=mesh, offload_policy={"weight": OFF})
    want = {"a.weight": OFF, "a.bias": fsdp2.OffloadPolicy()}
    want |= {"b.weight": OFF, "b.bias": fsdp2.OffloadPolicy()}
    assert _policies(pair) == want
    reported = unit_settings(pair)  # named as the list's mapping keys them
    assert reported[pair.a].offload_policy == {"weight": OFF, "bias": fsdp2.OffloadPolicy()}
    assert reported[pair.b] == reported[pair.a]
    pair(torch.randn(2, 4)).sum().backward()
    dist.barrier()


def test_budget_map_per_block_and_module_lists() -> None:
    run_on_ranks(2, _by_budget_and_lists)


def _refused(model: nn.Module, offload: Any, exc: type[Exception], match: str, **kw: Any) -> None:
    with CommCounter() as calls, expect_raises(match, exc, match=match):
        fsdp2.fully_shard(model, mesh=kw.pop("mesh"), offload_policy=offload, **kw)
    assert calls.calls == [], f"{match}: collectives before the error"
    assert state_of(model) is None and not isinstance(model, fsdp2.FSDPModule), match


def _bad_mapping() -> None:
    mesh = world_mesh()
    model = build(NAME)
    fsdp2.fully_shard(model.layers[0], mesh=mesh)
    ignored = {model.head.bias}
    for key, why in (
        ("head.weigth", "no parameter by that name"),
        ("layers.0.lin.weight", r"managed by fully_shard\(MLPBlock\)"),
        ("head.bias", "in ignored_params"),
    ):
        _refused(
            model, {key: OFF}, ValueError, f"'{key}'.*{why}", mesh=mesh, ignored_params=ignored
        )
    _refused(model, {0: OFF}, TypeError, "keys must be parameter names", mesh=mesh)
    _refused(model, {"head.weight": True}, TypeError, r"offload_policy\['head.weight'\]", mesh=mesh)
    tied = _Pair()
    tied.b.weight = tied.a.weight
    _refused(tied, {"b.weight": OFF}, ValueError, "named 'a.weight' \\(tied\\)", mesh=mesh)
    # the same mapping, fixed, is taken
    fsdp2.fully_shard(model, mesh=mesh, offload_policy={"head.weight": OFF}, ignored_params=ignored)
    fsdp2.fully_shard(tied, mesh=mesh, offload_policy={"a.weight": OFF})
    assert _policies(tied)["a.weight"] == OFF and tied.b.weight is tied.a.weight
    dist.barrier()


def test_bad_mapping_refused_before_any_collective() -> None:
    run_on_ranks(2, _bad_mapping)
