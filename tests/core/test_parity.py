"""Numerical parity of ``fsdp2.fully_shard`` training with a replicated run and torch's FSDP2.

Each case builds three copies of a model under the same seed on every rank:

* ``reference``: unsharded, trained on the whole global batch on every rank (the mean loss
  over the global batch, so its gradient equals the average of the ranks' gradients);
* ``fsdp2``: ``fsdp2.fully_shard`` on every block and the root;
* ``torch``: ``torch.distributed.fsdp.fully_shard``, sharded the same way;

and trains them for a few steps, the sharded ones on their rank's slice of the same global
batch. Every step it compares the rank-averaged loss with the reference loss and the full
gradients (``p.grad.full_tensor()``, after backward, before the optimizer step) with the
reference gradients; after every optimizer step it compares the full parameters. The same
quantities of ``fsdp2`` and ``torch`` must also be bitwise equal (same-seed equality with torch
guards refactors; ``helpers.train_and_compare`` runs the loop).
Parametrized over world size, model (an uneven MLP whose root holds no parameters; a tiny
transformer with a tied embedding/head on the root), optimizer and ``reshard_after_forward``
(``2`` only on 4 ranks, where it is a proper divisor of the shard world size).
"""

from __future__ import annotations

import pytest
from _harness import run_on_ranks
from helpers import ENGINES, train_and_compare, world_mesh
from models import build, local_loss, make_batch, make_optimizer, shard_model
from torch.distributed.tensor import DTensor

STEPS = 4


def _train_and_compare(model_name: str, optim_name: str, reshard_after_forward: bool | int):
    mesh = world_mesh()
    ref = build(model_name)
    raf = reshard_after_forward
    models = {
        engine: shard_model(build(model_name), fn, mesh, reshard_after_forward=raf)
        for engine, fn in ENGINES.items()
    }
    for engine, model in models.items():
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), f"{engine}: {name} is not a DTensor after sharding"
    train_and_compare(
        ref,
        models,
        batch=lambda step: make_batch(model_name, step),
        loss=lambda model, x, y: local_loss(model, model_name, x, y),
        steps=STEPS,
        optimizer=lambda params: make_optimizer(optim_name, params),
        check_init=True,
    )


def _cases() -> list:
    cases = []
    for world_size in (2, 4):
        for model in ("mlp", "transformer"):
            # SGD's update is the gradient itself: one model suffices to cover it.
            for optim in ("adamw", "sgd") if model == "mlp" else ("adamw",):
                # An int must divide the shard world size and lie strictly between 1 and it
                # (2 on 2 ranks is the same as True).
                for raf in (True, False, *((2,) if world_size == 4 else ())):
                    case_id = f"ws{world_size}-{model}-{optim}-raf{raf}"
                    cases.append(pytest.param(world_size, model, optim, raf, id=case_id))
    return cases


@pytest.mark.parametrize("world_size, model_name, optim_name, reshard_after_forward", _cases())
def test_parity_with_reference_and_torch(
    world_size: int, model_name: str, optim_name: str, reshard_after_forward: bool | int
) -> None:
    run_on_ranks(world_size, _train_and_compare, model_name, optim_name, reshard_after_forward)
