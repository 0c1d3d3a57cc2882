"""``get_pending_gradients`` / ``synchronize_gradients`` (torch main's API, its upstream
``test_fully_shard_pending_grad.py`` ported to gloo), against a replica trained on the whole
batch (gradients within ``TOL``).

* FSDP, 2 ranks: a synced backward leaves nothing pending (and ``get_pending_gradients``
  communicates nothing); no-sync backwards leave ``(unreduced, None)`` per parameter, the
  rank's own summed gradient, the same object after another backward (in ``reduce_dtype``
  under a bf16/fp32 policy), while ``.grad`` keeps the synced value; ``synchronize_gradients``
  reduces them into ``.grad`` (the replica's sum of the three micro-batches), leaves nothing
  pending, and a second call issues no collective. An in-place ``zero_()`` of a pending
  tensor removes its contribution; assigning into the dict changes nothing.
  ``zero_grad()`` clears the pending sums (``set_to_none=False``: zeros them).
* HSDP 2x2 (4 ranks): backwards with ``set_requires_all_reduce(False)`` leave
  ``(None, partial)``, a plain tensor shaped like the local shard; one more with sync off
  adds ``unreduced``; ``synchronize_gradients`` all-reduces and lands the sum of all three.
* Errors: inside a forward; under the deterministic reduction (no one pending tensor).
"""

from __future__ import annotations

from typing import Any

import torch
from _harness import run_on_ranks
from comm_counter import CommCounter
from helpers import TOL, hsdp_mesh, mine, world_mesh
from models import build, full_grads, local_loss, make_batch, shard_model
from torch.distributed.tensor import DTensor

import fsdp2
import fsdp2.reduction

NAME = "mlp_head"


def _replica_grads(steps: list[int]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ref = build(NAME)
    for i in steps:
        x, y = make_batch(NAME, i)
        local_loss(ref, NAME, x, y).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}


def _local_grads(steps: list[int]) -> dict[str, torch.Tensor]:
    """This rank's own (unreduced) gradient sum over ``steps`` on an unsharded copy."""
    ref = build(NAME)
    for i in steps:
        x, y = make_batch(NAME, i)
        local_loss(ref, NAME, mine(x), mine(y)).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def _micro(model: Any, i: int) -> None:
    x, y = make_batch(NAME, i)
    local_loss(model, NAME, mine(x), mine(y)).backward()


def _names(model: Any) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _check(got: dict[str, Any], want: dict[str, torch.Tensor]) -> None:
    for n, w in want.items():
        torch.testing.assert_close(got[n], w, **TOL, msg=lambda m, n=n: f"{n}: {m}")


def _fsdp(mp: bool) -> dict[str, Any]:
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = {"mp_policy": policy} if mp else {}
    model = shard_model(build(NAME), fsdp2.fully_shard, world_mesh(), **kw)
    names = _names(model)
    out: dict[str, Any] = {}
    _micro(model, 0)
    with CommCounter() as counter:
        out["after_sync"] = model.get_pending_gradients()
    out["no_comm"] = len(counter.calls) == 0
    synced = {n: g.clone() for n, g in full_grads(model).items() if g is not None}
    model.set_requires_gradient_sync(False)
    _micro(model, 1)
    first = model.get_pending_gradients()
    out["all_params"] = {names[id(p)] for p in first} == set(names.values())
    out["only_unreduced"] = all(u is not None and s is None for u, s in first.values())
    _micro(model, 2)
    with CommCounter() as counter:
        pending = model.get_pending_gradients()
    out["no_comm"] &= len(counter.calls) == 0
    out["same_objects"] = all(pending[p][0] is first[p][0] for p in first)
    want_dtype = torch.float32
    out["dtype"] = all(u.dtype == want_dtype for u, _ in pending.values())
    if not mp:  # bf16 compute: the local sums are not the fp32 replica's to TOL
        _check({names[id(p)]: u for p, (u, _) in pending.items()}, _local_grads([1, 2]))
    out["grad_kept"] = all(torch.equal(full_grads(model)[n], g) for n, g in synced.items())
    for p in list(pending):
        pending[p] = (None, None)  # changes nothing
    model.set_requires_gradient_sync(True)
    model.synchronize_gradients()
    out["empty_after"] = model.get_pending_gradients() == {}
    if not mp:
        _check(full_grads(model), _replica_grads([0, 1, 2]))
    with CommCounter() as counter:
        model.synchronize_gradients()  # nothing pending: no collective
    out["second_quiet"] = len(counter.calls) == 0

    # an in-place change is what gets reduced; zero_grad clears
    model.zero_grad()
    model.set_requires_gradient_sync(False)
    _micro(model, 0)
    _micro(model, 1)
    for u, _ in model.get_pending_gradients().values():
        u.zero_()
    _micro(model, 2)  # adds to the zeroed sums
    model.synchronize_gradients()
    if not mp:
        _check(full_grads(model), _replica_grads([2]))
    model.zero_grad()
    _micro(model, 0)
    model.zero_grad(set_to_none=False)
    zeros = model.get_pending_gradients()
    out["zeroed"] = bool(zeros) and all(float(u.abs().sum()) == 0 for u, _ in zeros.values())
    model.zero_grad()
    out["cleared"] = model.get_pending_gradients() == {}
    return out


def test_pending_fsdp() -> None:
    for mp in (False, True):
        for out in run_on_ranks(2, _fsdp, mp):
            assert out.pop("after_sync") == {}, out
            assert all(out.values()), (mp, out)


def _hsdp() -> dict[str, Any]:
    model = shard_model(build(NAME), fsdp2.fully_shard, hsdp_mesh((2, 2)))
    names = _names(model)
    model.set_requires_all_reduce(False)
    _micro(model, 0)
    _micro(model, 1)
    pending = model.get_pending_gradients()
    out = {
        "partial_only": all(u is None and isinstance(s, torch.Tensor) for u, s in pending.values()),
        "plain": all(not isinstance(s, DTensor) for _, s in pending.values()),
        "shapes": all(s.shape == p.to_local().shape for p, (_, s) in pending.items()),
        "all_params": {names[id(p)] for p in pending} == set(names.values()),
    }
    model.set_requires_gradient_sync(False)
    _micro(model, 2)
    both = model.get_pending_gradients()
    out["both"] = all(u is not None and s is not None for u, s in both.values())
    model.set_requires_gradient_sync(True)
    model.synchronize_gradients()
    out["empty"] = model.get_pending_gradients() == {}
    _check(full_grads(model), _replica_grads([0, 1, 2]))
    _micro(model, 3)  # a synced backward adds on top
    _check(full_grads(model), _replica_grads([0, 1, 2, 3]))
    return out


def test_pending_hsdp() -> None:
    for out in run_on_ranks(4, _hsdp):
        assert all(out.values()), out


def _errors() -> list[str]:
    model = shard_model(build(NAME), fsdp2.fully_shard, world_mesh())
    errors = []

    def inside(*_: Any) -> None:
        for call in (model.get_pending_gradients, model.synchronize_gradients):
            try:
                call()
            except RuntimeError as e:
                errors.append(str(e))

    handle = model.layers[0].register_forward_hook(inside)
    _micro(model, 0)
    handle.remove()
    det = shard_model(build(NAME), fsdp2.fully_shard, world_mesh())
    fsdp2.reduction.set_deterministic(det)
    det.set_requires_gradient_sync(False)
    _micro(det, 0)
    try:
        det.get_pending_gradients()
    except RuntimeError as e:
        errors.append(str(e))
    det.set_requires_gradient_sync(True)
    det.synchronize_gradients()
    errors.append(str(all(g is not None for g in full_grads(det).values())))
    return errors


def test_pending_errors() -> None:
    for errors in run_on_ranks(2, _errors):
        assert len(errors) == 4, errors
        assert all("during a forward or backward" in e for e in errors[:2]), errors
        assert "deterministic" in errors[2] and errors[3] == "True", errors
