"""``FSDPModule.reset_iter_state``: after an exception in forward, in backward or in a
no-sync microbatch, the root resets and the next steps train as if the failed attempt had
never happened; on a non-root module it raises.

Each step compares, as in the other lever tests (``helpers.check_grads`` / ``check_params``),
the sharded models (on their rank's slice) with a replicated reference (on the whole global
batch) that skips the failed attempt, and counts each step's collectives with
``comm_counter.CommCounter``: a retry all-gathers and reduce-scatters like any step. The model
is ``MLPStack((7, 5, 3, 1), head_dim=2)`` (4 groups) whose block 1 raises on demand; cases run
on 2 and 4 gloo ranks, the non-root error once per engine on 2.

torch 2.13 is compared only for a failure in forward: its ``reset_iter_state`` keeps the
unsharded gradients computed before the failure (the root's after a failed backward, the
accumulated ones after a failed no-sync microbatch), which the retry then adds to.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from comm_counter import CommCounter, count_calls
from helpers import (
    ENGINES,
    GROUPS,
    N_BLOCKS,
    NAME,
    WORLD_SIZES,
    assert_all_dtensors,
    check_grads,
    check_params,
    check_same,
    engines_with,
    expect_raises,
    grads_of,
    mine,
    sharded,
    world_mesh,
)
from models import MLPBlock, build, local_loss, make_batch, make_optimizer, shard_model


class _Boom(RuntimeError):
    pass


class _FailingBlock(MLPBlock):
    """An ``MLPBlock`` that raises in its forward or its backward while ``fail`` is set."""

    fail: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.fail == "forward":
            raise _Boom("forward")
        if self.fail == "backward":
            y.register_hook(_raise_boom)
        return F.relu(y) if self.relu else y


def _raise_boom(grad: torch.Tensor) -> None:
    raise _Boom("backward")


def _failing_model() -> nn.Module:
    model = build(NAME)
    model.layers[1].__class__ = _FailingBlock
    return model


def _reset_iter_state(where: str) -> None:
    mesh = world_mesh()
    ref = build(NAME)
    # torch is compared only for a failure in forward (see the module docstring).
    # torch < 2.13 has no reset_iter_state (helpers.engines_with).
    engines = (
        engines_with("reset_iter_state") if where == "forward" else {"fsdp2": ENGINES["fsdp2"]}
    )
    models = {
        e: shard_model(_failing_model(), fn, mesh, root_kwargs={}) for e, fn in engines.items()
    }
    ref_opt = make_optimizer("adamw", ref.parameters())
    opts = {e: make_optimizer("adamw", m.parameters()) for e, m in models.items()}
    want_step = {("step", "AG"): GROUPS + N_BLOCKS, ("step", "RS"): GROUPS}
    with CommCounter() as counter:
        for step in range(3):
            x, y = make_batch(NAME, step)
            if step == 1:  # the failed attempt: the reference skips it
                for engine, model in models.items():
                    if where == "no_sync":  # one microbatch accumulates, the next one fails
                        model.set_requires_gradient_sync(False)
                        xm, ym = mine(x).chunk(2), mine(y).chunk(2)
                        local_loss(model, NAME, xm[0], ym[0]).backward()
                    model.layers[1].fail = "forward" if where == "no_sync" else where
                    with expect_raises(engine, _Boom):
                        local_loss(model, NAME, mine(x), mine(y)).backward()
                    model.layers[1].fail = None
                    model.reset_iter_state()
                    model.set_requires_gradient_sync(True)
                    opts[engine].zero_grad()
                    assert_all_dtensors(model, f"{engine} after reset_iter_state")
                counter.take()
            local_loss(ref, NAME, x, y).backward()
            for engine, model in models.items():
                counter.phase = "step"
                local_loss(model, NAME, mine(x), mine(y)).backward()
                counter.phase = "?"
                got = count_calls(counter.take_calls(), "phase", "kind")
                assert got == want_step, f"{engine} step {step}: got {got}, want {want_step}"
            seen = check_grads(models, grads_of(ref), f"step {step}")
            if "torch" in seen:
                check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
            for opt in (ref_opt, *opts.values()):
                opt.step()
                opt.zero_grad()
            check_params(models, ref, f"step {step}")
            for engine, model in models.items():
                assert_all_dtensors(model, f"{engine} step {step}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("where", ["forward", "backward", "no_sync"])
def test_reset_iter_state_after_exception(world_size: int, where: str) -> None:
    run_on_ranks(world_size, _reset_iter_state, where)


def _reset_on_non_root(engine: str) -> None:
    model = sharded(engine, NAME)
    x, y = make_batch(NAME, 0)
    local_loss(model, NAME, mine(x), mine(y)).backward()
    with pytest.raises(RuntimeError, match="root"):
        model.layers[0].reset_iter_state()
    model.reset_iter_state()  # the root: fine between steps too


@pytest.mark.parametrize("engine", list(engines_with("reset_iter_state")))
def test_reset_iter_state_on_non_root_raises(engine: str) -> None:
    run_on_ranks(2, _reset_on_non_root, engine)
