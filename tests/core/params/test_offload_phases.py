"""CPU offload by phase: ``CPUOffloadPolicy(pin_memory, offload_after_forward,
offload_after_backward)`` (torch main, pytorch PR 192441; [Note: offload by phase] in
fsdp2/_core/params/residence.py).

On a CPU mesh the host and the device are one memory, so where the sharded state is comes
from fsdp2's own state and the moves it makes (each a copy into a new buffer, announced to
observers as "offload to host" / "offload to device"):

* every flag combination trains like a replicated reference and, bitwise, like torch's FSDP2
  with ``CPUOffloadPolicy`` (the moves copy values, they change none), also with bf16
  compute; through every step the parameter objects the optimizer holds stay the model's and
  each sharded parameter views its group's current flat buffer;
* the moves: none for both flags equal; for differing flags one to the forward's side after
  each forward with grad (none without grad) and one back: ``offload_after_backward=False``
  comes back inside the block's backward all-gather (its ``copy_in``) or, for the root that
  gathers nothing in backward, at its post-backward; ``offload_after_forward=False`` moves to
  the device in the post-forward and back at the post-backward; after a forward the
  ``state_dict`` values view the moved buffer (it reports where the state is); gradients
  kept across steps (no ``zero_grad``) move along and accumulate as the reference's; a
  forward with grad whose backward never comes changes nothing of the next step;
* bad input: non-bool flags (``TypeError``), torch's policy read with its flags, and a
  parameter with storage of its own (frozen, another dtype) in a group that moves
  (``NotImplementedError``, naming it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from helpers import NAME, check_close, expect_raises, mine, train_and_compare, world_mesh
from models import build, full_grads, local_loss, make_batch, shard_model
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp2
from fsdp2._core.runtime.state import state_of
from fsdp2._core.support.observe import HUB, Observer
from fsdp2.api import as_offload_policy

FLAGS = {  # (offload_after_forward, offload_after_backward)
    "both": (True, True),
    "fwd_only": (True, False),
    "bwd_only": (False, True),
    "none": (False, False),
}
BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


def _groups(model: nn.Module) -> dict[str, Any]:
    """``path -> group`` of every fsdp2 group in ``model`` (after its first forward)."""
    return {g.path: g for m in model.modules() if (st := state_of(m)) for g in st.groups}


def _in_flat(model: nn.Module, what: str) -> None:
    """Every sharded parameter views its group's current flat buffer (moved in place)."""
    for g in _groups(model).values():
        flat = g.sharded_flat.untyped_storage().data_ptr()
        for p in g.flat_params:
            local = p.sharded._local_tensor
            assert local.untyped_storage().data_ptr() == flat, f"{what}: {p.fqn} left its buffer"
            assert p.sharded.device == local.device, f"{what}: {p.fqn} wrapper on another device"


def _parity(flags: tuple[bool, bool], mp: dict[str, Any]) -> None:
    fwd, bwd = flags
    ours = fsdp2.CPUOffloadPolicy(
        pin_memory=False, offload_after_forward=fwd, offload_after_backward=bwd
    )
    mesh = world_mesh()
    fsdp2_model = shard_model(
        build(NAME),
        fsdp2.fully_shard,
        mesh,
        offload_policy=ours,
        mp_policy=fsdp2.MixedPrecisionPolicy(**mp),
    )
    torch_model = shard_model(
        build(NAME),
        torch_fully_shard,
        mesh,
        offload_policy=TorchCPUOffloadPolicy(pin_memory=False),
        mp_policy=TorchMixedPrecisionPolicy(**mp),
    )
    held = [id(p) for p in fsdp2_model.parameters()]

    def invariant(key: str, model: nn.Module, params: list[nn.Parameter]) -> None:
        if key != "fsdp2":
            return
        assert [id(p) for p in model.parameters()] == held == [id(p) for p in params]
        if _groups(model):  # (after the first forward)
            _in_flat(model, "fsdp2")
            assert not any(g.parked for g in _groups(model).values()), "not at rest"

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return make_batch(NAME, step)

    tol = {"atol": 2e-2, "rtol": 2e-2} if mp else {"atol": 1e-5, "rtol": 1e-5}
    train_and_compare(
        build(NAME),
        {"fsdp2": fsdp2_model, "torch": torch_model},
        batch=batch,
        loss=lambda m, x, y: local_loss(m, NAME, x, y),
        invariant=invariant,
        tol=tol,
    )


# bf16 only where the state moves (both flags equal: test_offload.py's bf16 cases)
CASES = [(f, "fp32") for f in FLAGS] + [("fwd_only", "bf16"), ("bwd_only", "bf16")]


@pytest.mark.parametrize("flags,mp", CASES, ids=[f"{f}-{mp}" for f, mp in CASES])
def test_phase_flags_train_like_torch_offload(flags: str, mp: str) -> None:
    run_on_ranks(2, _parity, FLAGS[flags], BF16 if mp == "bf16" else {})


class _Moves(Observer):
    """The regions entered, with the regions open around each."""

    def __init__(self) -> None:
        self.open: list[tuple[str, str]] = []
        self.events: list[tuple[str, str, tuple[tuple[str, str], ...]]] = []

    def enter(self, kind: str, what: str) -> None:
        self.events.append((kind, what, tuple(self.open)))
        self.open.append((kind, what))

    def exit(self, kind: str) -> None:
        self.open.pop()

    def moves(self) -> list[tuple[str, str, tuple[tuple[str, str], ...]]]:
        return [e for e in self.events if e[0].startswith("offload to ")]


def _step(model: nn.Module, step: int) -> torch.Tensor:
    x, y = make_batch(NAME, step)
    loss = local_loss(model, NAME, mine(x), mine(y))
    loss.backward()
    return loss


def _observe(flags: tuple[bool, bool]) -> None:
    fwd, bwd = flags
    policy = fsdp2.CPUOffloadPolicy(
        pin_memory=False, offload_after_forward=fwd, offload_after_backward=bwd
    )
    model = shard_model(build(NAME), fsdp2.fully_shard, world_mesh(), offload_policy=policy)
    ref = build(NAME)
    _step(model, 0)  # lazy init; the root keeps its parameters from now on
    groups = _groups(model)
    moves = fwd != bwd
    # a forward without grad moves nothing
    with HUB.observing(_Moves()) as seen, torch.no_grad():
        model(mine(make_batch(NAME, 1)[0]))
    assert seen.moves() == [] and not any(g.parked for g in groups.values())
    # a forward with grad parks every group; state_dict reports where the state is now
    before = {path: g.sharded_flat for path, g in groups.items()}
    x, y = make_batch(NAME, 1)
    with HUB.observing(_Moves()) as seen:
        loss = local_loss(model, NAME, mine(x), mine(y))
    to = "offload to host" if fwd else "offload to device"
    want = sorted((to, p) for p in groups) if moves else []
    assert sorted((k, w) for k, w, _ in seen.moves()) == want, seen.moves()
    for kind, path, around in seen.moves():
        assert ("hook post_forward", path) in around, f"{path}: {kind} outside its post-forward"
    for path, g in groups.items():
        assert g.parked is moves, path
        assert (g.sharded_flat is before[path]) is not moves, f"{path}: moved {moves}?"
    _in_flat(model, "after forward")
    # the backward brings the state back: where depends on the side it rests on
    with HUB.observing(_Moves()) as seen:
        loss.backward()
    back = "offload to device" if fwd else "offload to host"
    assert sorted(w for k, w, _ in seen.moves() if k == back) == (sorted(groups) if moves else [])
    assert len(seen.moves()) == (len(groups) if moves else 0)
    for _, path, around in seen.moves():
        kinds = {k for k, w in around if w == path}
        # a block resharded after forward gathers in backward: the input goes back to the
        # device in its copy_in; the root (no backward all-gather) and a host rest: at the
        # post-backward
        gathered = fwd and not bwd and "layers." in path
        want = "copy_in" if gathered else "hook post_backward"
        assert want in kinds, f"{path}: moved back inside {kinds}, want {want}"
    assert not any(g.parked for g in groups.values())
    _in_flat(model, "after backward")
    # gradients kept across steps (no zero_grad) moved along and accumulated
    for step in (0, 1):
        x, y = make_batch(NAME, step)
        local_loss(ref, NAME, x, y).backward()
    _step(model, 2)
    local_loss(ref, NAME, *make_batch(NAME, 2)).backward()
    for name, got in full_grads(model).items():
        check_close(got, ref.get_parameter(name).grad, f"accumulated grad of {name}")
    # a forward with grad whose backward never comes: the next step is as without it
    twin = shard_model(build(NAME), fsdp2.fully_shard, world_mesh(), offload_policy=policy)
    for m in (model, twin):
        m.zero_grad()
    local_loss(model, NAME, mine(x), mine(y))  # dropped
    assert all(g.parked is moves for g in groups.values())
    flats = {g.sharded_flat.untyped_storage().data_ptr() for g in groups.values()}
    for name, value in model.state_dict().items():  # where the state is now
        assert value.to_local().untyped_storage().data_ptr() in flats, name
    _step(twin, 0)
    for m in (model, twin):
        m.zero_grad()
        _step(m, 3)
    assert not any(g.parked for g in groups.values())
    for (name, a), b in zip(full_grads(model).items(), full_grads(twin).values(), strict=True):
        assert torch.equal(a, b), f"{name}: a dropped forward changed the next step's gradient"


@pytest.mark.parametrize("flags", list(FLAGS))
def test_phase_moves(flags: str) -> None:
    run_on_ranks(2, _observe, FLAGS[flags])


def _bad_input() -> None:
    for field in ("offload_after_forward", "offload_after_backward", "pin_memory"):
        with expect_raises(field, TypeError, match=field):
            fsdp2.CPUOffloadPolicy(**{field: 1})
    # torch main's policy (its flags) read by field; torch 2.13's (no flags): the defaults
    fields = {"pin_memory": False, "offload_after_forward": True, "offload_after_backward": False}
    main = type("CPUOffloadPolicy", (), fields)()  # torch main's class, by its name and fields
    assert as_offload_policy(main) == fsdp2.CPUOffloadPolicy(False, True, False)
    assert as_offload_policy(TorchCPUOffloadPolicy()) == fsdp2.CPUOffloadPolicy()
    # a frozen parameter of another dtype keeps storage of its own: not moved, refused
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].to(torch.bfloat16).requires_grad_(False)
    policy = fsdp2.CPUOffloadPolicy(pin_memory=False, offload_after_backward=False)
    with expect_raises("storage of its own", NotImplementedError, match="1.weight"):
        fsdp2.fully_shard(model, mesh=world_mesh(), offload_policy=policy)
    assert not isinstance(model, fsdp2.FSDPModule)
    fsdp2.fully_shard(model, mesh=world_mesh(), offload_policy=fsdp2.CPUOffloadPolicy())
    dist.barrier()


def test_bad_input() -> None:
    run_on_ranks(2, _bad_input)
