"""fsdp2's modes through the Hugging Face ``Trainer``'s own loop (``use_fsdp2(...)``).

A ``Trainer`` with FSDP2 (each ``LlamaDecoderLayer`` a unit) builds its own AdamW
(``optim="adamw_torch"``) and constant LR schedule, accumulates ``gradient_accumulation_steps=k``
micro-batches itself (its ``Accelerator`` counts 1), normalizes the loss its own way (each
micro-batch's token sum over the global token count, times the world size:
``average_tokens_across_devices``) and clips with ``max_grad_norm``; it is held to the same mode
in a plain script (``modes_common.plain``), bitwise, on every micro-batch's loss, every step's
logged ``grad_norm`` and the final parameters:

* ``deterministic=True`` on 2 and 4 ranks against the plain script on 1 rank (the same bits at
  every world size, through the Trainer's normalization and clipping); with labels padded by
  -100 (token counts that differ between micro-batches, where the Trainer's normalization is
  not the mean over ``k``), the Trainer on 2 and 4 ranks against the Trainer on 1;
  ``gradient_accumulation_steps=3`` raises ``ValueError`` naming the setting before training
  (the Trainer gives accelerate a count of 1: fsdp2 checks the Trainer's own);
* ``exchange_reduce=torch.bfloat16`` on 2 ranks against the plain script on 2;
* ``shard_over_replicas=True`` on HSDP 2x2 (``TrainingArguments(parallelism_config=...)``)
  against the plain script on 2x2.

What makes the Trainer's run the plain script's:

* the data: one global dataset read in order (``train_sampling_strategy="sequential"``), laid
  out for accelerate's split of the batches over the ranks (rank ``r`` gets the batches ``r``,
  ``r + W``, ...), so each rank gets its micro-batches in the order ``modes_common.mine``
  gives; checked on every micro-batch;
* the loss: every micro-batch has the same token count ``n``, so the Trainer's ``sum / (n M) *
  W`` is the micro-batch's mean (``sum / n``) over ``k = M / W``, exactly (powers of two), the
  plain script's ``loss / k``, and so are their gradients;
* the optimizer: the Trainer's AdamW with torch's defaults (``weight_decay=0.01``, betas, eps)
  on every parameter (the Trainer exempts norm weights from decay; this subclass does not);
  the ``"constant"`` schedule keeps the LR at 1e-2.

On CPU the ``Trainer`` takes accelerate's FSDP path only with the state marked multi-GPU
([Note: accelerate on CPU] in test_frameworks_accelerate.py; test_frameworks_hf_trainer.py).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks
from frameworks_common import rank_env, tiny_llama
from modes_common import MAX_NORM, SEQS, STEPS, M, check_same, mine, plain, result

from fsdp2.integrations import using_fsdp2

pytest.importorskip("accelerate", reason="accelerate is a test extra: pip install -e '.[test]'")
pytest.importorskip("transformers", reason="transformers is a test extra")

MODES = {
    "deterministic": {"deterministic": True},
    "wire": {"exchange_reduce": torch.bfloat16},
    "shard_over_replicas": {"shard_over_replicas": True},
}


class _GlobalBatches(torch.utils.data.Dataset):
    """Every step's global batch, one sequence an item, in the order a sequential sampler and
    accelerate's split (batch ``b`` of ``SEQS`` items to rank ``b % W``) hand each rank its
    micro-batches of ``modes_common.mine``; ``padded``: each sequence's labels end in -100
    from a length of its own (token counts that differ between micro-batches)."""

    def __init__(self, world: int, padded: bool) -> None:
        self.world, self.padded = world, padded

    def __len__(self) -> int:
        return STEPS * M * SEQS

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        batch, seq = divmod(index, SEQS)
        nth, rank = divmod(batch, self.world)  # the rank's nth micro-batch
        step, j = divmod(nth, M // self.world)
        i, ids = mine(step, rank, self.world)[j]
        labels = ids[seq].clone()
        if self.padded:
            labels[4 + (7 * i + 3 * seq + 5 * step) % 12 :] = -100
        return {"input_ids": ids[seq], "labels": labels}


def _trainer_class() -> type:
    """The ``Trainer``, recording each micro-batch's inputs and loss, and decaying every
    parameter (torch's AdamW default, as the plain script)."""
    from transformers import Trainer

    class Recording(Trainer):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.seen: list[tuple[torch.Tensor, float]] = []

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            self.seen.append((inputs["input_ids"].clone(), loss.item()))
            return loss

        def get_decay_parameter_names(self, model: Any) -> list[str]:
            return [name for name, _ in model.named_parameters()]

    return Recording


def _trainer(
    out_dir: str, accumulation: int, mesh_shape: tuple[int, ...], padded: bool = False
) -> Any:
    from accelerate import PartialState
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedType
    from transformers import TrainingArguments

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState(cpu=True).distributed_type = DistributedType.MULTI_GPU  # the GPU setup, on CPU
    config = None
    if len(mesh_shape) == 2:  # HSDP
        config = ParallelismConfig(dp_replicate_size=mesh_shape[0], dp_shard_size=mesh_shape[1])
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=SEQS,
        gradient_accumulation_steps=accumulation,
        max_steps=STEPS,
        train_sampling_strategy="sequential",
        optim="adamw_torch",
        learning_rate=1e-2,
        weight_decay=0.01,  # torch's AdamW defaults, as the plain script's
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        lr_scheduler_type="constant",
        max_grad_norm=MAX_NORM,
        logging_steps=1,  # each step's grad_norm in log_history (no reporters)
        save_strategy="no",
        report_to=[],
        fsdp=True,
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        parallelism_config=config,
        use_cpu=True,
        accelerator_config={"use_configured_state": True},
        disable_tqdm=True,
    )
    world = dist.get_world_size()
    data = _GlobalBatches(world, padded)
    return _trainer_class()(model=tiny_llama(), args=args, train_dataset=data)


def _train(
    mode: str, mesh_shape: tuple[int, ...], out_dir: str, padded: bool = False
) -> dict[str, Any]:
    """The Trainer's run with ``mode`` from ``use_fsdp2``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    k = M // world
    with rank_env(), using_fsdp2(**MODES[mode]):
        run_dir = os.path.join(out_dir, f"{mode}-{world}{'-padded' * padded}")
        trainer = _trainer(run_dir, k, mesh_shape, padded)
        assert trainer.accelerator.num_processes == world, trainer.accelerator.num_processes
        trainer.train()
        _check_applied(mode, trainer)
        assert len(trainer.seen) == STEPS * k, len(trainer.seen)
        losses: dict[int, float] = {}
        for nth, (ids, loss) in enumerate(trainer.seen):
            step, j = divmod(nth, k)
            i, want = mine(step, rank, world)[j]
            assert torch.equal(ids, want), f"{mode}: step {step}: not micro-batch {i}"
            # sum / N * W, times k = M / W: sum / (N / M), the same at every W (the mean if
            # every micro-batch holds N / M tokens)
            losses[step * M + i] = loss * k
        norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        return result(losses, trainer.model_wrapped, norms)


def _check_applied(mode: str, trainer: Any) -> None:
    """The mode is on the model the Trainer sharded and the optimizer it built."""
    import fsdp2
    from fsdp2.reduction import ExchangeReduceScatter
    from fsdp2.replica_optim import ReplicaShardedOptimizer

    model = trainer.model_wrapped
    assert isinstance(model, fsdp2.FSDPModule), type(model)
    groups = [g for m in model.modules() if isinstance(m, fsdp2.FSDPModule) for g in m._groups()]
    assert groups and all(g.reduce.exact == (mode == "deterministic") for g in groups)
    wire = [isinstance(g.reduce.comm, ExchangeReduceScatter) for g in groups]
    assert all(wire) if mode != "shard_over_replicas" else not any(wire), (mode, wire)
    hsdp = [g.info.replicate_group is not None for g in groups]
    assert all(hsdp) == (mode == "shard_over_replicas"), (mode, hsdp)
    pieced = isinstance(trainer.optimizer.optimizer, ReplicaShardedOptimizer)
    assert pieced == (mode == "shard_over_replicas"), (mode, type(trainer.optimizer.optimizer))


def _three_micro_batches(out_dir: str) -> dict[str, Any]:
    """``gradient_accumulation_steps=3`` under the deterministic mode: the error, and how many
    micro-batches ran before it."""
    with rank_env(), using_fsdp2(deterministic=True):
        trainer = _trainer(os.path.join(out_dir, "three"), 3, (dist.get_world_size(),))
        try:
            trainer.train()
        except ValueError as e:
            return {"error": str(e), "ran": len(trainer.seen)}
    return {"error": "no error", "ran": len(trainer.seen)}


def _one_rank(out_dir: str) -> dict[str, Any]:
    # accelerate and the Trainer imported before the modes are set (the seams are installed on
    # the classes imported then)
    _trainer_class()
    return {
        "plain": plain("deterministic", (1,)),
        "padded": _train("deterministic", (1,), out_dir, padded=True),
    }


def _two_ranks(out_dir: str) -> dict[str, Any]:
    _trainer_class()
    return {
        "deterministic": _train("deterministic", (2,), out_dir),
        "padded": _train("deterministic", (2,), out_dir, padded=True),
        "wire": _train("wire", (2,), out_dir),
        "wire, plain": plain("wire", (2,)),
        "three": _three_micro_batches(out_dir),
    }


def _four_ranks(out_dir: str) -> dict[str, Any]:
    _trainer_class()
    return {
        "deterministic": _train("deterministic", (4,), out_dir),
        "padded": _train("deterministic", (4,), out_dir, padded=True),
        "shard_over_replicas": _train("shard_over_replicas", (2, 2), out_dir),
        "shard_over_replicas, plain": plain("shard_over_replicas", (2, 2)),
    }


def test_modes_through_hf_trainer(tmp_path) -> None:
    one = run_on_ranks(1, _one_rank, str(tmp_path))[0]
    two = run_on_ranks(2, _two_ranks, str(tmp_path))[0]
    four = run_on_ranks(4, _four_ranks, str(tmp_path))[0]
    plain_one = one["plain"]
    check_same(two["deterministic"], plain_one, "deterministic: the Trainer on 2 ranks vs 1 rank")
    check_same(four["deterministic"], plain_one, "deterministic: the Trainer on 4 ranks vs 1 rank")
    # the Trainer's normalization where it is not the mean over k: still world-size invariant
    check_same(two["padded"], one["padded"], "deterministic, padded: the Trainer on 2 vs 1 rank")
    check_same(four["padded"], one["padded"], "deterministic, padded: the Trainer on 4 vs 1 rank")
    check_same(two["wire"], two["wire, plain"], "bf16 wire: the Trainer vs a plain script")
    check_same(
        four["shard_over_replicas"],
        four["shard_over_replicas, plain"],
        "shard_over_replicas: the Trainer vs a plain script",
    )
    three = two["three"]
    msg = three["error"]
    assert "gradient_accumulation_steps=3" in msg and "power of two" in msg, msg
    assert three["ran"] == 0, three  # before training
