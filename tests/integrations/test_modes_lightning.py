"""fsdp2's modes through Lightning's own loops (``use_fsdp2(deterministic=...)``, ...).

A tiny Llama sharded with torch's ``fully_shard`` names (each decoder layer and the root)
under the switch, trained by Lightning, against the same mode in a plain script
(``modes_common.plain``), bitwise: every micro-batch's loss, every step's gradient norm and
the final full parameters.

* the ``Trainer`` with ``ModelParallelStrategy``: a ``LightningModule`` whose
  ``configure_model`` shards, ``accumulate_grad_batches=k`` (Lightning divides the loss by
  it), ``gradient_clip_val=MAX_NORM`` (its precision plugin's ``clip_grad_by_norm``), a loader
  of this rank's micro-batches in order (no distributed sampler), ``max_steps``:
  - ``deterministic=True`` on 2 and 4 ranks against the plain script on 1 rank, one gradient
    reduction per optimizer step (counted); ``accumulate_grad_batches=3`` raises at ``fit``,
    naming the setting, before any all-gather, reduce-scatter or all-reduce (counted);
  - ``exchange_reduce=torch.bfloat16`` on 2 ranks against the plain script on 2 whose loop
    reduces every micro-batch, as the Trainer's does (see [Note: the Trainer reduces every
    micro-batch]);
  - ``shard_over_replicas=True`` on HSDP 2x2 (``configure_model`` builds the mesh) against
    the plain script on 2x2.
  Lightning's clipping returns no norm: ``on_before_optimizer_step`` (just before it, on the
  same gradients) records the norm the mode's clipping function computes, with an infinite
  ``max_norm`` (a scale by 1.0, which changes no bit).
* Fabric with ``ModelParallelStrategy(parallelize_fn)``: ``fabric.no_backward_sync`` on the
  accumulating micro-batches, ``fabric.backward(loss / k)``, ``fabric.clip_gradients`` (its
  returned norm): ``deterministic=True`` on 2 ranks against 1 rank, ``exchange_reduce`` on 2
  ranks against the plain script on 2, ``shard_over_replicas`` on 2x2 against the plain
  script on 2x2.

Each run also checks that the mode is on the model Lightning sharded and on the optimizer it
steps. The workers look like a torchrun launch to Lightning (as in
test_frameworks_lightning.py), so it uses the existing gloo group.

[Note: the Trainer reduces every micro-batch]
Lightning 2.6.6's ``ParallelStrategy.block_backward_sync``, which the Trainer enters for the
accumulating micro-batches, blocks only a ``DistributedDataParallel`` model's sync, and
``ModelParallelStrategy`` does not override it: with torch's FSDP2 and with fsdp2 alike, every
micro-batch reduce-scatters its gradient (3 reductions per micro-batch here, counted). The
deterministic mode's seam skips them (it needs one reduction per step); the other modes keep
Lightning's loop. Under the bf16 wire that rounds each micro-batch's partial sums to bf16,
where ``modes_common.plain`` (and accelerate, and Fabric's ``no_backward_sync``) rounds
their sum once: the losses differ from the second step on (4.903729 vs 4.903575), while the
same plain loop reducing every micro-batch is bitwise equal, so the Trainer's wire run is held
to that. (``shard_over_replicas`` on 2x2 has ``k = 1``: nothing to accumulate.)
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks
from comm_counter import CommCounter
from frameworks_common import rank_env, tiny_llama
from modes_common import MAX_NORM, STEPS, M, as_float, check_same, mine, plain, result

from fsdp2.integrations import using_fsdp2

if importlib.util.find_spec("lightning") is None:  # (importing it here costs the collection ~1 s)
    pytest.skip("lightning is a test extra: pip install -e '.[test]'", allow_module_level=True)
pytest.importorskip("transformers", reason="transformers is a test extra")

MODES = {
    "deterministic": {"deterministic": True},
    "wire": {"exchange_reduce": torch.bfloat16},
    "shard_over_replicas": {"shard_over_replicas": True},
}


@contextlib.contextmanager
def _launch(mode: str) -> Iterator[None]:
    """Lightning's view of a torchrun launch, with ``mode`` from ``using_fsdp2``."""
    with rank_env(), using_fsdp2(**MODES[mode]):
        os.environ["TORCHELASTIC_RUN_ID"] = "fsdp2-tests"
        yield


def _parallelize(model: Any, mesh_shape: tuple[int, ...]) -> Any:
    """Written for torch's FSDP2, as a Lightning user would; an HSDP ``mesh_shape`` builds
    its own (replicate, shard) mesh."""
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    names = ("dp_replicate", "dp_shard") if len(mesh_shape) == 2 else ("dp_shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for layer in model.model.layers:
        torch_fsdp.fully_shard(layer, mesh=mesh)
    torch_fsdp.fully_shard(model, mesh=mesh)
    return model


def _fabric_parallelize(mesh_shape: tuple[int, ...], model: Any, device_mesh: Any) -> Any:
    return _parallelize(model, mesh_shape)


def _check_applied(mode: str, model: Any, opt: Any) -> None:
    """The mode is on the model Lightning sharded (fsdp2's, under the switch) and on the
    optimizer it steps."""
    from fsdp2.reduction import ExchangeReduceScatter
    from fsdp2.replica_optim import ReplicaShardedOptimizer

    assert type(model).__module__.split(".")[0] == "fsdp2", type(model)
    groups = [g for m in model.modules() if hasattr(m, "_groups") for g in m._groups()]
    assert groups and all(g.reduce.exact == (mode == "deterministic") for g in groups)
    wire = [isinstance(g.reduce.comm, ExchangeReduceScatter) for g in groups]
    assert all(wire) if mode != "shard_over_replicas" else not any(wire), (mode, wire)
    pieced = isinstance(opt, ReplicaShardedOptimizer)
    assert pieced == (mode == "shard_over_replicas"), (mode, type(opt))


# ---- the Trainer --------------------------------------------------------------------------


def _norm(mode: str, params: list[torch.Tensor]) -> float:
    """The total norm the mode's clipping computes (``max_norm`` infinite: no bit changes)."""
    from fsdp2 import reduction

    clip = reduction.clip_grad_norm_ if mode == "deterministic" else torch.nn.utils.clip_grad_norm_
    return as_float(clip(params, float("inf")))


def _lightning_module(mode: str, mesh_shape: tuple[int, ...]) -> Any:
    import lightning as L

    rank, world = dist.get_rank(), dist.get_world_size()
    k = M // world

    class TinyLlama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.llama = tiny_llama()
            self.losses: dict[int, float] = {}
            self.norms: list[float] = []

        def configure_model(self) -> None:
            _parallelize(self.llama, mesh_shape)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.llama(input_ids=batch, labels=batch).loss
            step, j = divmod(batch_idx, k)
            self.losses[step * M + rank * k + j] = loss.item()
            return loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self.norms.append(_norm(mode, params))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return TinyLlama()


def _trainer(accumulation: int) -> Any:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    world = dist.get_world_size()
    return L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        max_steps=STEPS,
        accumulate_grad_batches=accumulation,
        gradient_clip_val=MAX_NORM,
        gradient_clip_algorithm="norm",
        use_distributed_sampler=False,  # the loader already holds this rank's micro-batches
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _data() -> Any:
    """This rank's micro-batches of every step, in order, one per batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [ids for step in range(STEPS) for _, ids in mine(step, rank, world)]
    return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)


def _trainer_run(mode: str, mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    with _launch(mode):
        module, trainer = _lightning_module(mode, mesh_shape), _trainer(M // dist.get_world_size())
        with CommCounter() as counter:
            trainer.fit(module, _data())
        assert trainer.global_step == STEPS, trainer.global_step
        _check_applied(mode, module.llama, trainer.strategy.optimizers[0])
        out = result(module.losses, module.llama, module.norms)
        out["reductions"] = sum(c.kind == "RS" for c in counter.calls)
        out["modules"] = len(module.llama.model.layers) + 1
        return out


def _three_micro_batches() -> tuple[str, list[str]]:
    with _launch("deterministic"), CommCounter() as counter:
        module, trainer = _lightning_module("deterministic", (2,)), _trainer(3)
        try:
            trainer.fit(module, _data())
        except ValueError as e:
            return str(e), [c.kind for c in counter.calls]
    return "no error", []


# ---- Fabric -------------------------------------------------------------------------------


def _fabric_run(mode: str, mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    rank, world = dist.get_rank(), dist.get_world_size()
    with _launch(mode):
        strategy = ModelParallelStrategy(
            parallelize_fn=functools.partial(_fabric_parallelize, mesh_shape),
            data_parallel_size=world,
            tensor_parallel_size=1,
        )
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        model = fabric.setup(tiny_llama())
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        _check_applied(mode, model.module, opt.optimizer)
        losses: dict[int, float] = {}
        norms = []
        for step in range(STEPS):
            batch = mine(step, rank, world)
            for j, (i, ids) in enumerate(batch):
                with fabric.no_backward_sync(model, enabled=j < len(batch) - 1):
                    loss = model(input_ids=ids, labels=ids).loss
                    fabric.backward(loss / len(batch))
                losses[step * M + i] = loss.item()
            norms.append(as_float(fabric.clip_gradients(model, opt, max_norm=MAX_NORM)))
            opt.step()
            opt.zero_grad()
        return result(losses, model.module, norms)


# ---- the runs -----------------------------------------------------------------------------


def _plain_reducing_each() -> dict[str, Any]:
    """``modes_common.plain("wire", (W,))`` with the loop the Trainer runs: every micro-batch
    reduces (see [Note: the Trainer reduces every micro-batch])."""
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2
    from fsdp2 import reduction

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    model = tiny_llama()
    for layer in model.model.layers:
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    reduction.set_exchange_reduce(model, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses: dict[int, float] = {}
    norms = []
    for step in range(STEPS):
        batch = mine(step, rank, world)
        for i, ids in batch:
            loss = model(input_ids=ids, labels=ids).loss
            (loss / len(batch)).backward()
            losses[step * M + i] = loss.item()
        norms.append(as_float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return result(losses, model, norms)


def _one_rank() -> dict[str, Any]:
    return {
        "plain": plain("deterministic", (1,)),
        "deterministic": _trainer_run("deterministic", (1,)),
    }


def _two_ranks() -> dict[str, Any]:
    return {
        "deterministic": _trainer_run("deterministic", (2,)),
        "wire": _trainer_run("wire", (2,)),
        "wire, reducing each": _plain_reducing_each(),
        "wire, plain": plain("wire", (2,)),
        "three": _three_micro_batches(),
        "fabric deterministic": _fabric_run("deterministic", (2,)),
        "fabric wire": _fabric_run("wire", (2,)),
    }


def _four_ranks() -> dict[str, Any]:
    return {
        "deterministic": _trainer_run("deterministic", (4,)),
        "shard_over_replicas": _trainer_run("shard_over_replicas", (2, 2)),
        "fabric shard_over_replicas": _fabric_run("shard_over_replicas", (2, 2)),
        "shard_over_replicas, plain": plain("shard_over_replicas", (2, 2)),
    }


def test_modes_through_lightning() -> None:
    single = run_on_ranks(1, _one_rank)[0]
    one = single["plain"]
    two = run_on_ranks(2, _two_ranks)[0]
    four = run_on_ranks(4, _four_ranks)[0]
    check_same(single["deterministic"], one, "deterministic: Trainer on 1 rank vs 1 rank")
    check_same(two["deterministic"], one, "deterministic: Trainer on 2 ranks vs 1 rank")
    check_same(four["deterministic"], one, "deterministic: Trainer on 4 ranks vs 1 rank")
    check_same(two["fabric deterministic"], one, "deterministic: Fabric on 2 ranks vs 1 rank")
    check_same(two["fabric wire"], two["wire, plain"], "bf16 wire: Fabric vs a plain script")
    check_same(two["wire"], two["wire, reducing each"], "bf16 wire: Trainer vs a plain script")
    sor = four["shard_over_replicas, plain"]
    check_same(four["shard_over_replicas"], sor, "shard_over_replicas: Trainer vs a plain script")
    check_same(four["fabric shard_over_replicas"], sor, "shard_over_replicas: Fabric vs plain")
    msg, collectives = two["three"]
    assert "accumulate_grad_batches=3" in msg and "power of two" in msg, msg
    assert collectives == [], collectives
    k = M // 2  # micro-batches per rank and step on 2 ranks
    per_step = two["deterministic"]["modules"]
    assert two["deterministic"]["reductions"] == per_step * STEPS, two["deterministic"]
    assert two["wire"]["reductions"] == per_step * k * STEPS, two["wire"]  # see the Note
