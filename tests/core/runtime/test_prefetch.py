"""When ``FSDPModule`` groups are all-gathered, as the user steers it: explicit prefetch lists
(``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``),
``unshard(async_op=True)`` waited by forward, ``set_unshard_in_backward`` and
``set_reshard_after_forward`` changed at run time.

Each rank function builds, under one seed, a replicated reference trained on the whole global
batch and the model sharded by ``fsdp2.fully_shard`` and by ``torch.distributed.fsdp.
fully_shard`` (the prefetch-order test runs each engine on its own, the ``engine`` parameter,
against a model without the lists); the sharded models train on their rank's slice. Full
gradients (after backward) and, where the optimizer steps, parameters must match the reference
in fp32 and each other (``helpers.check_grads`` / ``check_params`` / ``check_same``).
Collectives, and where the order matters the modules' computes between them, are recorded with
``comm_counter.CommCounter``.

The default model is ``MLPStack((7, 5, 3, 1), head_dim=2)``: 3 blocks and a root holding a
head, so 4 groups whose per-rank all-gather sizes differ (a recorded collective names its
group by its size). Cases run on 2 and 4 gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from comm_counter import CommCounter, count_calls, prefetch_order, shard_numel
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
    expect_raises,
    grads_of,
    mine,
    sharded,
    world_mesh,
)
from models import MLPBlock, MLPStack, build, local_loss, make_batch, make_optimizer, shard_model
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle

import fsdp2

# ---------------------------------------------------------------------------------------------
# Explicit prefetch lists


def _prefetch_model() -> nn.Module:
    # Per-rank group sizes differ on 2 and 4 ranks: B0 24/16, B1 14/7, B2 10/5, B3 4/4, R 3/3.
    torch.manual_seed(0)
    return MLPStack((7, 6, 4, 3, 2), head_dim=1)


def _record_prefetch(engine: str) -> None:
    ws = dist.get_world_size()
    mesh = world_mesh()
    ref = _prefetch_model()
    fn = ENGINES[engine]
    models = {
        "explicit": shard_model(_prefetch_model(), fn, mesh, root_kwargs={}),
        "default": shard_model(_prefetch_model(), fn, mesh, root_kwargs={}),
    }
    model = models["explicit"]
    b = list(model.layers)
    model.set_modules_to_forward_prefetch([b[0], b[1]])
    b[1].set_modules_to_forward_prefetch([b[2], b[3]])
    model.set_modules_to_backward_prefetch([b[3], b[2]])
    b[2].set_modules_to_backward_prefetch([b[1], b[0]])
    groups = {f"B{i}": list(blk.parameters()) for i, blk in enumerate(b)}
    groups["R"] = list(model.head.parameters())
    by_numel = {shard_numel(ps, ws): g for g, ps in groups.items()}
    assert len(by_numel) == len(groups), f"ambiguous group sizes: {by_numel}"
    with CommCounter() as counter:
        counter.mark_computes([(f"B{i}", blk.lin) for i, blk in enumerate(b)] + [("R", model.head)])
        for step in range(2):
            x, y = make_batch("mlp", step)
            local_loss(ref, "mlp", x, y).backward()
            counter.phase = "forward"
            loss = local_loss(model, "mlp", mine(x), mine(y))
            counter.phase = "backward"
            loss.backward()
            counter.phase = "?"
            events = counter.take()
            local_loss(models["default"], "mlp", mine(x), mine(y)).backward()
            counter.take()
            fwd = ["AG(R)", "AG(B0)", "AG(B1)", "C(B0)", "AG(B2)", "AG(B3)"]
            fwd += ["C(B1)", "C(B2)", "C(B3)", "C(R)"]
            bwd = ["AG(B3)", "AG(B2)", "Cb(R)", "Cb(B3)", "AG(B1)", "AG(B0)"]
            bwd += ["Cb(B2)", "Cb(B1)", "Cb(B0)"]
            got_fwd = prefetch_order(events, "forward", by_numel)
            got_bwd = prefetch_order(events, "backward", by_numel)
            assert got_fwd == fwd, f"{engine} step {step} forward: {got_fwd}"
            assert got_bwd == bwd, f"{engine} step {step} backward: {got_bwd}"
            seen = check_grads(models, grads_of(ref), f"{engine} step {step}")
            check_same(
                seen["explicit"], seen["default"], f"{engine} step {step} vs default", bitwise=True
            )
            for m in (ref, *models.values()):
                m.zero_grad()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_explicit_prefetch_lists(world_size: int, engine: str) -> None:
    run_on_ranks(world_size, _record_prefetch, engine)


# ---------------------------------------------------------------------------------------------
# unshard(async_op=True)


def _async_unshard(wait_after_step: bool) -> None:
    ref = build(NAME)
    models = {engine: sharded(engine, NAME) for engine in ENGINES}
    handle_types = {"fsdp2": fsdp2.UnshardHandle, "torch": TorchUnshardHandle}
    with CommCounter() as counter:
        for step in range(2):
            x, y = make_batch(NAME, step)
            local_loss(ref, NAME, x, y).backward()
            for engine, model in models.items():
                counter.phase = "forward"
                handles = [blk.unshard(async_op=True) for blk in model.layers]
                assert all(isinstance(h, handle_types[engine]) for h in handles), (
                    f"{engine}: {handles}"
                )
                handles[0].wait()
                handles[0].wait()  # idempotent
                loss = local_loss(model, NAME, mine(x), mine(y))  # waits for the others
                counter.phase = "backward"
                loss.backward()
                if wait_after_step:  # already waited by forward: nothing left to do
                    counter.phase = "after"
                    for h in handles:
                        h.wait()
                counter.phase = "?"
                got = count_calls(counter.take_calls(), "phase", "kind")
                want = {("forward", "AG"): GROUPS, ("backward", "AG"): N_BLOCKS}
                want[("backward", "RS")] = GROUPS
                assert got == want, f"{engine} step {step}: got {got}, want {want}"
                assert_all_dtensors(model, f"{engine} step {step}")
            seen = check_grads(models, grads_of(ref), f"step {step}")
            check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
            for m in (ref, *models.values()):
                m.zero_grad()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("wait_after_step", [False, True], ids=["forward_waits", "wait_after_step"])
def test_async_unshard_waited_by_forward(world_size: int, wait_after_step: bool) -> None:
    # wait_after_step: a handle that forward already waited is done; torch's wait() is then
    # a no-op, and fsdp2's docstring calls waiting optional.
    run_on_ranks(world_size, _async_unshard, wait_after_step)


# ---------------------------------------------------------------------------------------------
# set_unshard_in_backward


class _EmbNet(nn.Module):
    """Token embedding (own group; its backward needs only the ids), 2 blocks, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        self.layers = nn.ModuleList([MLPBlock(6, 5), MLPBlock(5, 3)])
        self.head = nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).flatten(0, 1)  # (batch * seq, dim): no output is a view
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _emb_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, 13, (8, 4), generator=g), torch.randn(8, 4, generator=g)


def _unshard_in_backward(flag: bool) -> None:
    mesh = world_mesh()
    torch.manual_seed(0)
    ref = _EmbNet()
    models = {}
    for engine, fn in ENGINES.items():
        torch.manual_seed(0)
        model = _EmbNet()
        fn(model.emb, mesh=mesh, reshard_after_forward=True)
        models[engine] = shard_model(model, fn, mesh, root_kwargs={})
        model.emb.set_unshard_in_backward(flag)
    emb_numel = shard_numel([ref.emb.weight], dist.get_world_size())
    opts = {e: make_optimizer("adamw", m.parameters()) for e, m in models.items()}
    ref_opt = make_optimizer("adamw", ref.parameters())
    with CommCounter() as counter:
        for step in range(2):
            x, y = _emb_batch(step)
            F.mse_loss(ref(x), y.view(-1, 1)).backward()
            for engine, model in models.items():
                counter.phase = "forward"
                loss = F.mse_loss(model(mine(x)), mine(y).reshape(-1, 1))
                counter.phase = "backward"
                loss.backward()
                counter.phase = "?"
                calls = counter.take_calls()
                bwd = [c.numel for c in calls if c.phase == "backward" and c.kind == "AG"]
                n_emb = bwd.count(emb_numel)
                assert n_emb == int(flag), (
                    f"{engine} step {step}: {n_emb} backward all-gathers of the embedding "
                    f"(unshard_in_backward={flag}); backward all-gather sizes {bwd}"
                )
                assert len(bwd) == 2 + int(flag), f"{engine} step {step}: {bwd}"
            seen = check_grads(models, grads_of(ref), f"step {step}")
            check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
            for opt in (ref_opt, *opts.values()):
                opt.step()
                opt.zero_grad()
            check_params(models, ref, f"step {step}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("flag", [False, True], ids=["no_unshard", "unshard"])
def test_unshard_in_backward(world_size: int, flag: bool) -> None:
    run_on_ranks(world_size, _unshard_in_backward, flag)


# ---------------------------------------------------------------------------------------------
# set_reshard_after_forward at run time

_RAF_CASES = {
    # case: (how to change it, backward all-gathers per step afterwards)
    "all_false": (lambda m: m.set_reshard_after_forward(False), 0),
    "root_true_not_recursive": (
        lambda m: m.set_reshard_after_forward(True, recurse=False),
        N_BLOCKS + 1,
    ),
    "block_false_not_recursive": (
        lambda m: m.layers[0].set_reshard_after_forward(False, recurse=False),
        N_BLOCKS - 1,
    ),
}


def _runtime_reshard(case: str) -> None:
    change, bwd_ag = _RAF_CASES[case]
    ref = build(NAME)
    models = {engine: sharded(engine, NAME) for engine in ENGINES}
    with CommCounter() as counter:
        for step in range(3):
            if step == 1:  # step 0 runs with the construction-time settings
                for model in models.values():
                    change(model)
            x, y = make_batch(NAME, step)
            local_loss(ref, NAME, x, y).backward()
            for engine, model in models.items():
                model.set_is_last_backward(True)
                counter.phase = "forward"
                loss = local_loss(model, NAME, mine(x), mine(y))
                counter.phase = "backward"
                loss.backward()
                counter.phase = "?"
                got = count_calls(counter.take_calls(), "phase", "kind")
                want = {("forward", "AG"): GROUPS, ("backward", "RS"): GROUPS}
                n = N_BLOCKS if step == 0 else bwd_ag
                if n:
                    want[("backward", "AG")] = n
                assert got == want, f"{engine} step {step}: got {got}, want {want}"
            seen = check_grads(models, grads_of(ref), f"step {step}")
            check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch")
            for m in (ref, *models.values()):
                m.zero_grad()
    for engine, model in models.items():
        with expect_raises(engine, ValueError):
            model.set_reshard_after_forward(2)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", list(_RAF_CASES))
def test_set_reshard_after_forward_at_runtime(world_size: int, case: str) -> None:
    run_on_ranks(world_size, _runtime_reshard, case)
