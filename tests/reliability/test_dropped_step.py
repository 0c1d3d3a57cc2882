"""A model dropped in the middle of a failed backward leaves the process group usable.

A user whose backward raised (an out-of-memory error, a bad batch) may drop the model and
build a new one without ``reset_iter_state``, while the failed step's collectives are still
in flight. On gloo, fsdp2 all-gathers and reduce-scatters by sends and receives. Destroying
an unwaited send or receive made a later collective hang: in CI, a test whose recompute
raised was followed by the ``reset_iter_state`` test in the same workers, and that test's
first all-gather hung 4 times in about 11 runs. Once the works were kept alive it passed
18 runs in 18. fsdp2 now keeps such works (and their tensors) and waits for them at its
next exchange ([Note: dropped exchanges] in fsdp2/_core/comm/gloo.py).

* ``test_dropped_exchange_is_kept_and_waited`` checks the mechanism: a 2-rank
  reduce-scatter by exchange, dropped unwaited, keeps its works in ``gloo._DROPPED``. The
  next exchange waits for them, and its result is right.
* ``test_model_dropped_mid_backward_leaves_group_usable`` checks the user's case:
  - fsdp2's and torch's FSDP2 models raise in backward, once the last blocks'
    reduce-scatters and the first block's prefetched all-gather are posted. Rank 1 is
    slowed, so rank 0 drops its model before rank 1 posts its half.
  - Fresh models of both engines then train against a replicated reference: gradients and
    parameters every step, fsdp2 == torch bitwise.
  - Before the fix this case hung 3 times in 3: the next collective (torch's all-gather,
    a gloo collective on the same group) never finished on either rank.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from helpers import ENGINES, check_grads, check_params, check_same, grads_of, mine, world_mesh
from models import MLPStack, make_optimizer, shard_model

from fsdp2._core.comm import gloo

_DIMS = (48, 48, 48, 48, 48)


class _Boom(RuntimeError):
    pass


def _build() -> nn.Module:
    torch.manual_seed(0)
    return MLPStack(_DIMS, head_dim=4)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(8, _DIMS[0], generator=g), torch.randn(8, 4, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def _raise_in_backward(grad: torch.Tensor) -> None:
    raise _Boom("backward")


def _sleep_in_backward(grad: torch.Tensor) -> None:
    time.sleep(0.3)


def _arm(module: nn.Module, args: object, out: torch.Tensor) -> None:
    out.register_hook(_raise_in_backward)


def _slow(module: nn.Module, args: object, out: torch.Tensor) -> None:
    out.register_hook(_sleep_in_backward)


def _drop(rounds: int) -> None:
    mesh = world_mesh()
    for r in range(rounds):
        for fn in ENGINES.values():
            model = shard_model(_build(), fn, mesh, root_kwargs={})
            # block 0's output: its gradient is ready once blocks 3..1 ran backward
            model.layers[0].register_forward_hook(_arm)
            if dist.get_rank() == 1:  # rank 0 drops its model before rank 1 posts block 1's
                model.layers[1].register_forward_hook(_slow)
            x, y = _batch(r)
            with pytest.raises(_Boom):
                _loss(model, mine(x), mine(y)).backward()
            del model
            gc.collect()


def _train() -> None:
    mesh = world_mesh()
    ref = _build()
    models = {e: shard_model(_build(), fn, mesh, root_kwargs={}) for e, fn in ENGINES.items()}
    opts = {e: make_optimizer("sgd", m.parameters()) for e, m in models.items()}
    ref_opt = make_optimizer("sgd", ref.parameters())
    for step in range(3):
        x, y = _batch(100 + step)
        _loss(ref, x, y).backward()
        for model in models.values():
            _loss(model, mine(x), mine(y)).backward()
        seen = check_grads(models, grads_of(ref), f"step {step}")
        check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch", bitwise=True)
        for opt in (ref_opt, *opts.values()):
            opt.step()
            opt.zero_grad()
        check_params(models, ref, f"step {step}")


def test_model_dropped_mid_backward_leaves_group_usable() -> None:
    # separate tasks, as in the CI run that hung: the dropped model dies with its task
    run_on_ranks(2, _drop, 2, timeout=60)
    run_on_ranks(2, _train, timeout=60)


def _dropped_exchange() -> None:
    group = dist.group.WORLD
    assert group is not None
    me = dist.get_rank()
    gloo._wait_dropped()  # what earlier tasks in these workers dropped
    pending = gloo.reduce_scatter_by_exchange(
        torch.full((2, 3), float(me + 1)), dist.ReduceOp.SUM, group
    )
    del pending  # unwaited
    gc.collect()
    assert len(gloo._DROPPED) == 1, gloo._DROPPED
    [works] = gloo._DROPPED
    assert len(works) == 2, works  # its send and its receive, alive until waited
    again = gloo.reduce_scatter_by_exchange(
        torch.full((2, 3), 10.0 * (me + 1)), dist.ReduceOp.SUM, group
    )
    assert not gloo._DROPPED, "the dropped exchange was not waited by the next one"
    torch.testing.assert_close(again.wait(), torch.full((3,), 30.0), rtol=0, atol=0)


def test_dropped_exchange_is_kept_and_waited() -> None:
    run_on_ranks(2, _dropped_exchange, timeout=60)
