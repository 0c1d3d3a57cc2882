"""torchtitan's own ``Trainer`` (0.3.0) on fsdp2, on CPU with gloo (tests/integrations/
torchtitan_cpu.py: the patches, the 2-layer llama3 debug model, synthetic data).

Each run records what torchtitan logs per step (loss, and the gradient norm: a wrong gradient
scale moves the norm but hardly the loss), every micro-batch's loss, and the full parameters
after training:

* default (``use_fsdp2()``) on 2 ranks, 2 micro-batches accumulated per rank: equal bitwise
  to torch's FSDP2 in the same Trainer (2 steps); a checkpoint saved at step 1 (DCP, full
  state: AdamW's state of step 1 too) and resumed by a new ``Trainer`` gives step 2 and the
  parameters of the uninterrupted run;
* ``use_fsdp2(deterministic=True)`` on 1, 2 and 4 ranks (4, 2 and 1 micro-batches
  accumulated per rank over one global batch; parameters drawn whole from one seed): per
  micro-batch losses, gradient norms and parameters equal bitwise (torchtitan's logged loss,
  its own sum of the micro-batch losses in an order that follows the world size, to
  rounding), with torchtitan's chunked loss in one chunk; 3 micro-batches per rank, and the
  default 8 chunks, raise ``ValueError`` naming the setting;
* ``use_fsdp2(shard_over_replicas=True)`` on HSDP 2x2 (``data_parallel_replicate_degree=2``):
  the container's optimizer is a ``ReplicaShardedOptimizer``; without clipping, losses and
  parameters equal the same Trainer without the mode bitwise and the gradient norms (summed
  over pieces instead of shards) to rounding; a checkpoint saved at step 1 and resumed equals
  the uninterrupted run bitwise.

One task per world size, cases in sequence; the fsdp2 seams for torchtitan
(``fsdp2.integrations._torchtitan.SEAMS``) are merged into the framework table for the task.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks
from frameworks_common import rank_env
from helpers import check_same
from torchtitan_cpu import available, load, train, trainer_config

from fsdp2.integrations import using_fsdp2

_MISSING = available()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")

M = 4  # micro-batches in a step's global batch
STEPS = 2  # the runs compared and resumed: step 2 runs on AdamW's state of step 1
CKPT = 1  # the step checkpointed and resumed from
TIMEOUT = 600.0  # importing torchtitan and building Trainers on a shared 2-core machine


def _groups(trainer: Any) -> list[Any]:
    model = trainer.model_parts[0]
    return [g for m in model.modules() if hasattr(m, "_groups") for g in m._groups(False)]


def _check_deterministic(trainer: Any) -> None:
    groups = _groups(trainer)
    assert groups and all(g.reduce.exact for g in groups), "the mode is not on every group"


def _check_fsdp2(trainer: Any) -> None:
    assert _groups(trainer), "torchtitan's model is not sharded by fsdp2"


def _check_torch(trainer: Any) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    model = trainer.model_parts[0]
    assert not _groups(trainer) and isinstance(model._get_fsdp_state(), FSDPState)


def _rank0(out: dict[str, Any]) -> dict[str, Any] | None:
    dist.barrier()
    return out if dist.get_rank() == 0 else None


def _deterministic(folder: str) -> dict[str, Any]:
    with using_fsdp2(deterministic=True):
        # one chunk: its backward and the final norm's are the [norm, lm_head] group's 2
        # micro-batches per micro-batch (num_chunks + 1 must be a power of two)
        cfg = trainer_config(folder, steps=2, micro_batches=M, loss_chunks=1)
        return train(cfg, global_init=True, check=_check_deterministic)


def _refused(folder: str, **config: Any) -> str:
    """The ``ValueError`` building a ``Trainer`` under the deterministic mode raises."""
    with using_fsdp2(deterministic=True):
        try:
            train(trainer_config(folder, steps=1, **config))
        except ValueError as e:
            return str(e)
    return "no error"


def _one_rank(tmp: str) -> dict[str, Any] | None:
    load()
    with rank_env():
        return _rank0({"deterministic": _deterministic(os.path.join(tmp, "det1"))})


def _two_ranks(tmp: str) -> dict[str, Any] | None:
    load()
    out: dict[str, Any] = {}
    with rank_env():
        cfg = trainer_config(os.path.join(tmp, "torch"), steps=STEPS, micro_batches=M)
        out["torch"] = train(cfg, check=_check_torch)
        with using_fsdp2():
            folder = os.path.join(tmp, "fsdp2")
            ckpt = {"steps": STEPS, "micro_batches": M, "checkpoint_at": CKPT}
            out["fsdp2"] = train(trainer_config(folder, **ckpt), check=_check_fsdp2)
            out["resumed"] = train(trainer_config(folder, load_step=CKPT, **ckpt))
        out["deterministic"] = _deterministic(os.path.join(tmp, "det2"))
        out["three"] = _refused(os.path.join(tmp, "three"), micro_batches=6)
        out["eight chunks"] = _refused(os.path.join(tmp, "chunks"), micro_batches=M)
    return _rank0(out)


def _four_ranks(tmp: str) -> dict[str, Any] | None:
    load()
    out: dict[str, Any] = {}
    with rank_env():
        out["deterministic"] = _deterministic(os.path.join(tmp, "det4"))
        # no clipping: its coefficient comes from a norm summed in another order over the
        # pieces than over the shards (the last bits), which AdamW would carry into the weights
        hsdp = {"steps": STEPS, "micro_batches": M, "replicate": 2, "max_norm": 1e4}
        with using_fsdp2(shard_over_replicas=True):
            folder = os.path.join(tmp, "replicas")
            out["replicas"] = train(trainer_config(folder, checkpoint_at=CKPT, **hsdp))
            cfg = trainer_config(folder, checkpoint_at=CKPT, load_step=CKPT, **hsdp)
            out["replicas resumed"] = train(cfg)
        with using_fsdp2():
            out["hsdp"] = train(trainer_config(os.path.join(tmp, "hsdp"), **hsdp))
    return _rank0(out)


# ---- comparisons ----------------------------------------------------------------------


def _same_run(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """Logged steps, micro-batch losses and parameters equal bitwise."""
    assert got["steps"] == want["steps"], f"{what}: (step, loss, grad_norm) differ"
    assert got["micro_losses"] == want["micro_losses"], f"{what}: micro-batch losses differ"
    check_same(got["params"], want["params"], f"{what}: params", bitwise=True)


def _resumed(resumed: dict[str, Any], full: dict[str, Any], what: str) -> None:
    resumed_at = [s[0] for s in resumed["steps"]]
    assert resumed_at == list(range(CKPT + 1, STEPS + 1)), f"{what}: resumed at {resumed_at}"
    assert [s[0] for s in full["steps"]] == list(range(1, STEPS + 1)), full["steps"]
    assert resumed["steps"] == full["steps"][CKPT:], f"{what}: steps after resuming differ"
    check_same(resumed["params"], full["params"], f"{what}: params after resuming", bitwise=True)


def _same_deterministic(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    norms = [s[2] for s in got["steps"]]
    assert norms == [s[2] for s in want["steps"]], f"{what}: grad norms differ"
    assert got["micro_losses"] == want["micro_losses"], f"{what}: micro-batch losses differ"
    losses = torch.tensor([s[1] for s in got["steps"]], dtype=torch.float64)
    wanted = torch.tensor([s[1] for s in want["steps"]], dtype=torch.float64)
    torch.testing.assert_close(losses, wanted, rtol=1e-6, atol=0, msg=f"{what}: logged losses")
    check_same(got["params"], want["params"], f"{what}: params", bitwise=True)


def test_torchtitan_trainer(tmp_path: Any) -> None:
    tmp = str(tmp_path)
    two = run_on_ranks(2, _two_ranks, tmp, timeout=TIMEOUT)[0]
    four = run_on_ranks(4, _four_ranks, tmp, timeout=TIMEOUT)[0]
    one = run_on_ranks(1, _one_rank, tmp, timeout=TIMEOUT)[0]

    # default: fsdp2 against torch's FSDP2, and a checkpoint resumed
    assert two["fsdp2"]["accumulation"] == 2
    _same_run(two["fsdp2"], two["torch"], "fsdp2 vs torch's FSDP2")
    _resumed(two["resumed"], two["fsdp2"], "fsdp2")

    # deterministic: the same bits at 1, 2 and 4 ranks
    accumulation = [r["deterministic"]["accumulation"] for r in (one, two, four)]
    assert accumulation == [4, 2, 1], accumulation
    _same_deterministic(two["deterministic"], one["deterministic"], "deterministic 2 vs 1 rank")
    _same_deterministic(four["deterministic"], one["deterministic"], "deterministic 4 vs 1 rank")
    msg = two["three"]
    assert "training.global_batch_size" in msg and "=3" in msg and "power of two" in msg, msg
    msg = two["eight chunks"]
    assert "loss.num_chunks=8" in msg, msg

    # shard_over_replicas on HSDP 2x2: HSDP's numbers, and a checkpoint resumed
    replicas, hsdp = four["replicas"], four["hsdp"]
    assert replicas["optimizers"] == ["ReplicaShardedOptimizer"], replicas["optimizers"]
    assert hsdp["optimizers"] == ["AdamW"], hsdp["optimizers"]
    assert [s[:2] for s in replicas["steps"]] == [s[:2] for s in hsdp["steps"]], "losses"
    got = torch.tensor([s[2] for s in replicas["steps"]], dtype=torch.float64)
    want = torch.tensor([s[2] for s in hsdp["steps"]], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=5e-5, atol=0, msg="replicas vs HSDP: grad norms")
    check_same(replicas["params"], hsdp["params"], "replicas vs HSDP: params", bitwise=True)
    _resumed(four["replicas resumed"], replicas, "shard_over_replicas")
