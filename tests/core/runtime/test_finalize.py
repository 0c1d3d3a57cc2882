"""``set_manual_backward_finalization`` / ``finalize_backward`` (torch main's API), on 2 gloo
ranks, without pipelining (tests/integrations/test_pipelining.py covers the schedules).

* Three micro-batches with gradient sync on and manual finalization: the groups whose
  post-backward fires still reduce-scatter in each backward (the settings hold), the rest
  (the root's, reduced by the final callback otherwise) accumulate until
  ``finalize_backward()``, which leaves the gradients of an ordinary synced run (up to the
  rounding of summing before reducing);
* the same with sync off for all three (accumulating unsharded) and on for the finalization:
  one reduce-scatter per group, in ``finalize_backward()``, the same gradients up to rounding
  as the replica's;
* without the mode, ``finalize_backward()`` after an ordinary backward does nothing (no
  collective); the errors: either call inside a forward or backward;
* ``finalize_backward(async_op=True)`` (torch main's, pytorch PR 196724): it issues the same
  reduce-scatters and returns a ``GradientReductionHandle``; ``wait()`` lands the gradients
  of the synchronous call (bitwise: the same reductions in the same order) and is
  idempotent; while it is outstanding the next forward, ``unshard()``, ``zero_grad()``,
  ``reset_iter_state()`` and another ``finalize_backward()`` raise, before any collective
  and changing nothing (the step then ends and the next trains as usual); before any
  forward the handle is empty.
"""

from __future__ import annotations

from typing import Any

import torch
from _harness import run_on_ranks
from comm_counter import CommCounter
from helpers import check_close, mine, world_mesh
from models import build, full_grads, local_loss, make_batch, shard_model
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2 import GradientReductionHandle

NAME = "mlp_head"


def _model() -> Any:
    return shard_model(build(NAME), fsdp2.fully_shard, world_mesh())


def _micro(model: Any, i: int) -> None:
    x, y = make_batch(NAME, i)
    (local_loss(model, NAME, mine(x), mine(y)) / 3).backward()


def _synced_manual() -> dict[str, Any]:
    plain, manual = _model(), _model()
    manual.set_manual_backward_finalization(True)
    for i in range(3):
        _micro(plain, i)
    with CommCounter() as counter:
        for i in range(3):
            _micro(manual, i)
        in_backward = len([c for c in counter.calls if c.kind == "RS"])
        manual.finalize_backward()
        in_finalize = len([c for c in counter.calls if c.kind == "RS"]) - in_backward
    want, got = full_grads(plain), full_grads(manual)
    for n, g in want.items():
        check_close(got[n], g, n)
    return {"in_backward": in_backward, "in_finalize": in_finalize}


def test_manual_finalization_synced() -> None:
    for out in run_on_ranks(2, _synced_manual):
        assert out["in_backward"] > 0 and out["in_finalize"] > 0, out


def _accumulate_then_finalize() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = build(NAME)
    model = _model()
    model.set_manual_backward_finalization(True)
    model.set_requires_gradient_sync(False)
    with CommCounter() as counter:
        for i in range(3):
            _micro(model, i)
        during = [c.kind for c in counter.calls if c.kind == "RS"]
        model.set_requires_gradient_sync(True)
        model.finalize_backward()
        total = [c.kind for c in counter.calls if c.kind == "RS"]
    for i in range(3):
        x, y = make_batch(NAME, i)
        (local_loss(ref, NAME, x, y) / 3).backward()
    got = full_grads(model)
    for n, p in ref.named_parameters():
        check_close(got[n], p.grad, n)
    registered_sharded = all(isinstance(p, DTensor) for p in model.parameters())
    return {"during": len(during), "total": len(total), "resharded": registered_sharded}


def test_accumulate_without_sync_then_finalize() -> None:
    for out in run_on_ranks(2, _accumulate_then_finalize):
        assert out == {"during": 0, "total": 4, "resharded": True}, out


def _noop_and_errors() -> dict[str, Any]:
    model = _model()
    model.finalize_backward()  # before any forward: nothing to do
    _micro(model, 0)
    with CommCounter() as counter:
        model.finalize_backward()  # after an ordinary backward: nothing left
    errors = []
    x, y = make_batch(NAME, 1)

    def inside(*_: Any) -> None:
        for call in (model.finalize_backward, lambda: model.set_manual_backward_finalization(True)):
            try:
                call()
            except RuntimeError as e:
                errors.append(str(e))

    handle = model.layers[0].register_forward_hook(inside)
    local_loss(model, NAME, mine(x), mine(y)).backward()
    handle.remove()
    return {"collectives": len(counter.calls), "errors": errors}


def test_finalize_noop_and_errors() -> None:
    for out in run_on_ranks(2, _noop_and_errors):
        assert out["collectives"] == 0, out
        assert len(out["errors"]) == 2, out
        assert all("during a forward or backward" in e for e in out["errors"]), out


def _async_finalize() -> dict[str, Any]:
    sync, asyn = _model(), _model()
    empty = asyn.finalize_backward(async_op=True)  # before any forward
    assert isinstance(empty, GradientReductionHandle)
    empty.wait()
    for m in (sync, asyn):
        m.set_manual_backward_finalization(True)
        for i in range(3):
            _micro(m, i)
    sync.finalize_backward()
    with CommCounter() as counter:
        handle = asyn.finalize_backward(async_op=True)
        issued = len([c for c in counter.calls if c.kind == "RS"])
        before_refusals = len(counter.calls)
        assert isinstance(handle, GradientReductionHandle)
        x, y = make_batch(NAME, 3)
        refused = []
        for call in (
            lambda: asyn(mine(x)),
            asyn.layers[0].unshard,
            asyn.zero_grad,
            asyn.reset_iter_state,
            asyn.finalize_backward,
        ):
            try:
                call()
            except RuntimeError as e:
                refused.append("GradientReductionHandle" in str(e))
        after_refusals = len(counter.calls)
        handle.wait()
        handle.wait()  # idempotent
    want, got = full_grads(sync), full_grads(asyn)
    same = all(torch.equal(got[n], g) for n, g in want.items())
    resharded = all(isinstance(p, DTensor) for p in asyn.parameters())
    asyn.zero_grad()  # the step is closed: the next one trains
    _micro(asyn, 3)
    asyn.finalize_backward()
    return {
        "issued": issued,
        "refused": refused,
        "quiet": after_refusals == before_refusals,
        "same": same,
        "resharded": resharded,
        "trains": all(p.grad is not None for p in asyn.parameters()),
    }


def test_finalize_async_handle() -> None:
    for out in run_on_ranks(2, _async_finalize):
        assert out["issued"] > 0, out
        assert out["refused"] == [True] * 5, out
        assert out["quiet"] and out["same"] and out["resharded"] and out["trains"], out
