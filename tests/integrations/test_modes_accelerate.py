"""fsdp2's modes through accelerate's own loop (``use_fsdp2(deterministic=...)``, ...).

``Accelerator.prepare`` with the FSDP2 plugin (each ``LlamaDecoderLayer`` wrapped), its
gradient accumulation (``accumulate``, ``backward`` dividing the loss by the steps), its
``clip_grad_norm_`` and the optimizer it prepared, against the same mode in a plain script
(``modes_common.plain``), bitwise:

* ``deterministic=True`` on 1, 2 and 4 ranks against the plain script on 1 rank (the mode's
  promise: the same bits at every world size, through accelerate's clipping too);
  ``gradient_accumulation_steps=3`` raises at ``prepare``, naming the setting;
* ``exchange_reduce=torch.bfloat16`` on 2 ranks against the plain script on 2;
* ``shard_over_replicas=True`` on HSDP 2x2 (``ParallelismConfig``) against the plain script
  on 2x2: accelerate's clipping reads the gradient pieces (``.grad``).

On CPU accelerate takes its FSDP path only when its state says multi-GPU ([Note: accelerate
on CPU] in test_frameworks_accelerate.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks
from frameworks_common import rank_env, tiny_llama
from modes_common import MAX_NORM, STEPS, M, as_float, check_same, mine, plain, result

from fsdp2.integrations import using_fsdp2

pytest.importorskip("accelerate", reason="accelerate is a test extra: pip install -e '.[test]'")
pytest.importorskip("transformers", reason="transformers is a test extra")

MODES = {
    "deterministic": {"deterministic": True},
    "wire": {"exchange_reduce": torch.bfloat16},
    "shard_over_replicas": {"shard_over_replicas": True},
}


def _accelerator(accumulation: int, mesh_shape: tuple[int, ...]) -> Any:
    from accelerate import Accelerator, PartialState
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState(cpu=True).distributed_type = DistributedType.MULTI_GPU  # the GPU setup, on CPU
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    )
    config = None
    if len(mesh_shape) == 2:  # HSDP
        config = ParallelismConfig(dp_replicate_size=mesh_shape[0], dp_shard_size=mesh_shape[1])
    acc = Accelerator(
        fsdp_plugin=plugin, gradient_accumulation_steps=accumulation, parallelism_config=config
    )
    assert acc.is_fsdp2, acc.distributed_type
    return acc


def _accelerate(mode: str, mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    """The loop as an accelerate script writes it, with ``mode`` from ``use_fsdp2``."""
    import fsdp2

    rank, world = dist.get_rank(), dist.get_world_size()
    with rank_env(), using_fsdp2(**MODES[mode]):
        acc = _accelerator(M // world, mesh_shape)
        model = tiny_llama()
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        assert isinstance(model, fsdp2.FSDPModule)
        _check_applied(mode, model, opt)
        losses: dict[int, float] = {}
        norms = []
        for step in range(STEPS):
            for i, ids in mine(step, rank, world):
                with acc.accumulate(model):
                    loss = model(input_ids=ids, labels=ids).loss
                    acc.backward(loss)
                    if acc.sync_gradients:
                        norms.append(as_float(acc.clip_grad_norm_(model.parameters(), MAX_NORM)))
                    opt.step()
                    opt.zero_grad()
                losses[step * M + i] = loss.item()
        return result(losses, model, norms)


def _check_applied(mode: str, model: Any, opt: Any) -> None:
    """The mode is on the model accelerate sharded and the optimizer it prepared."""
    from fsdp2.reduction import ExchangeReduceScatter
    from fsdp2.replica_optim import ReplicaShardedOptimizer

    groups = [g for m in model.modules() if hasattr(m, "_groups") for g in m._groups()]
    assert groups and all(g.reduce.exact == (mode == "deterministic") for g in groups)
    wire = [isinstance(g.reduce.comm, ExchangeReduceScatter) for g in groups]
    assert all(wire) if mode != "shard_over_replicas" else not any(wire), (mode, wire)
    pieced = isinstance(opt.optimizer, ReplicaShardedOptimizer)
    assert pieced == (mode == "shard_over_replicas"), (mode, type(opt.optimizer))


def _three_micro_batches() -> str:
    with rank_env(), using_fsdp2(deterministic=True):
        acc = _accelerator(3, (2,))
        model = tiny_llama()
        try:
            acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        except ValueError as e:
            return str(e)
    return "no error"


def _one_rank() -> dict[str, Any]:
    return {
        "plain": plain("deterministic", (1,)),
        "deterministic": _accelerate("deterministic", (1,)),
    }


def _two_ranks() -> dict[str, Any]:
    return {
        "deterministic": _accelerate("deterministic", (2,)),
        "wire": _accelerate("wire", (2,)),
        "wire, plain": plain("wire", (2,)),
        "three": _three_micro_batches(),
    }


def _four_ranks() -> dict[str, Any]:
    return {
        "deterministic": _accelerate("deterministic", (4,)),
        "shard_over_replicas": _accelerate("shard_over_replicas", (2, 2)),
        "shard_over_replicas, plain": plain("shard_over_replicas", (2, 2)),
    }


def test_modes_through_accelerate() -> None:
    single = run_on_ranks(1, _one_rank)[0]
    one = single["plain"]
    two = run_on_ranks(2, _two_ranks)[0]
    four = run_on_ranks(4, _four_ranks)[0]
    check_same(single["deterministic"], one, "deterministic: accelerate on 1 rank vs 1 rank")
    check_same(two["deterministic"], one, "deterministic: accelerate on 2 ranks vs 1 rank")
    check_same(four["deterministic"], one, "deterministic: accelerate on 4 ranks vs 1 rank")
    check_same(two["wire"], two["wire, plain"], "bf16 wire: accelerate vs a plain script")
    check_same(
        four["shard_over_replicas"],
        four["shard_over_replicas, plain"],
        "shard_over_replicas: accelerate vs a plain script",
    )
    msg = two["three"]
    assert "gradient_accumulation_steps=3" in msg and "power of two" in msg, msg


_IMPORT_ORDER = """
import sys
from fsdp2.integrations import restore_torch_fsdp, use_fsdp2

use_fsdp2(shard_over_replicas=True)  # first thing, as the docs say: accelerate not imported yet
assert "accelerate" not in sys.modules
from accelerate import Accelerator
from transformers import Trainer

assert getattr(Accelerator._prepare_fsdp2, "_fsdp2_modes", False)
assert getattr(Trainer._prepare_for_training, "_fsdp2_modes", False)
restore_torch_fsdp()
assert not getattr(Accelerator._prepare_fsdp2, "_fsdp2_modes", False)
print("patched at import", flush=True)
import gc

gc.freeze()  # exit without the last collections over transformers' objects (~1 s)
"""


def test_modes_reach_a_framework_imported_after_use_fsdp2() -> None:
    """``use_fsdp2(mode=...)`` comes before the framework's import: its seams are patched as
    it is imported, so its first ``prepare`` already wraps the optimizer."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_ORDER], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "patched at import" in out.stdout, out.stderr[-2000:]
