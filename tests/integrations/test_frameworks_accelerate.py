"""accelerate's FSDP2 path on fsdp2 (``fsdp2.integrations.using_fsdp2``): bitwise torch's FSDP2.

Each case is one spawned 2-rank run that trains a tiny ``LlamaForCausalLM`` through
``Accelerator.prepare`` with torch's FSDP2, then again with fsdp2 under the switch (same
plugin options, seed and data), and checks the rank-averaged losses of every micro-step and
the full parameters at the end bitwise equal. The plugin wraps each ``LlamaDecoderLayer``
(``transformer_based_wrap``), gradients accumulate over 2 micro-steps (``accumulate``), and
``clip_grad_norm_`` clips them before each optimizer step.

* ``fp32``: then ``save_state`` (sharded, DCP) and ``save_model`` (safetensors, equal
  tensors); then resume: a fresh model and optimizer ``load_state`` and train on, fsdp2 from
  the checkpoint torch wrote and from its own, equal to torch resuming from its own;
* ``bf16``: ``mixed_precision="bf16"`` (bf16 compute, fp32 reduction), activation
  checkpointing and ``cpu_ram_efficient_loading``, with the switch turned on *after* the
  plugin was built (its ``MixedPrecisionPolicy`` and ``OffloadPolicy`` are torch's objects,
  read by field);
* ``presharded``: the model sharded by the user through torch's names before ``prepare``
  (``prepare`` keeps it: ``isinstance(model, FSDPModule)`` holds for fsdp2's modules).

[Note: accelerate on CPU] On CPU accelerate silently ignores ``fsdp_plugin`` and wraps the
model in DDP: its state takes the FSDP path only from a GPU distributed type
(``AcceleratorState.__init__`` in accelerate/state.py). ``_accelerator`` marks the shared
``PartialState`` as multi-GPU before the ``Accelerator`` is built, so it sets FSDP up as it
would on a GPU; the device stays the CPU and the process group the harness's gloo group.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks
from frameworks_common import ENGINES, mean_loss, rank_env, record, tiny_llama, tokens
from helpers import check_same, check_same_run

from fsdp2.integrations import use_fsdp2, using_fsdp2

pytest.importorskip("accelerate", reason="accelerate is a test extra: pip install -e '.[test]'")
pytest.importorskip("transformers", reason="transformers is a test extra")

ACCUM = 2
STEPS = 4  # micro-steps: 2 optimizer steps


def _plugin(**options: Any) -> Any:
    from accelerate.utils import FullyShardedDataParallelPlugin

    wrap = {"auto_wrap_policy": "transformer_based_wrap"}
    wrap["transformer_cls_names_to_wrap"] = ["LlamaDecoderLayer"]  # type: ignore[assignment]
    return FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", **{**wrap, **options}
    )


def _accelerator(plugin: Any, mixed_precision: str = "no") -> Any:
    """A fresh ``Accelerator`` taking its FSDP2 path on CPU (see [Note: accelerate on CPU])."""
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState().distributed_type = DistributedType.MULTI_GPU  # the GPU setup, on CPU
    acc = Accelerator(
        fsdp_plugin=plugin, gradient_accumulation_steps=ACCUM, mixed_precision=mixed_precision
    )
    assert acc.is_fsdp2 and acc.device.type == "cpu", (acc.distributed_type, acc.device)
    return acc


def _train(acc: Any, model: Any, opt: Any, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids = tokens(step)
        with acc.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        losses.append(mean_loss(loss))
    return losses


def _prepared(acc: Any, presharded: bool = False) -> tuple[Any, Any]:
    model = tiny_llama()
    if presharded:  # the user's own sharding, through torch's names
        import torch.distributed.fsdp as torch_fsdp

        for layer in model.model.layers:
            torch_fsdp.fully_shard(layer)
        torch_fsdp.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return model, opt


def _engine(engine: str, late: bool = False) -> Any:
    """Torch's FSDP2 as is, or fsdp2 under the switch (``late``: switched by the caller)."""
    import contextlib

    return using_fsdp2() if engine == "fsdp2" and not late else contextlib.nullcontext()


def _engine_of(model: Any) -> str:
    import fsdp2

    return "fsdp2" if isinstance(model, fsdp2.FSDPModule) else "torch"


def _fp32_case(tmp: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for engine in ENGINES:
        with rank_env(), _engine(engine):
            acc = _accelerator(_plugin())
            model, opt = _prepared(acc)
            out[engine] = record(_train(acc, model, opt, range(STEPS)), model)
            acc.save_state(os.path.join(tmp, f"{engine}-state"))
            acc.save_model(model, os.path.join(tmp, f"{engine}-model"))
            acc.wait_for_everyone()
            if dist.get_rank() == 0:
                out[f"{engine}-saved"] = load_file(
                    os.path.join(tmp, f"{engine}-model", "model.safetensors")
                )
    for engine, source in (("torch", "torch"), ("fsdp2", "torch"), ("fsdp2", "fsdp2")):
        with rank_env(), _engine(engine):
            acc = _accelerator(_plugin())
            model, opt = _prepared(acc)
            acc.load_state(os.path.join(tmp, f"{source}-state"))
            losses = _train(acc, model, opt, range(STEPS, STEPS + ACCUM))
            out[f"resume-{engine}-from-{source}"] = record(losses, model)
    return out


def _bf16_case() -> dict[str, Any]:
    out = {}
    for engine in ENGINES:
        with rank_env():
            plugin = _plugin(
                activation_checkpointing=True,
                cpu_ram_efficient_loading=True,
                mixed_precision_policy={
                    "param_dtype": torch.bfloat16,
                    "reduce_dtype": torch.float32,
                    "output_dtype": torch.bfloat16,
                },
            )
            policies = (plugin.mixed_precision_policy, plugin.cpu_offload)
            assert all(type(p).__module__.startswith("torch.") for p in policies), policies
            if engine == "fsdp2":
                use_fsdp2()  # after the plugin built torch's policy objects
            try:
                acc = _accelerator(plugin, mixed_precision="bf16")
                model, opt = _prepared(acc)
                out[engine] = record(_train(acc, model, opt, range(STEPS)), model)
                out[f"{engine}-engine"] = _engine_of(model)
            finally:
                from fsdp2.integrations import restore_torch_fsdp

                restore_torch_fsdp()
    return out


def _presharded_case() -> dict[str, Any]:
    out = {}
    for engine in ENGINES:
        with rank_env(), _engine(engine):
            acc = _accelerator(_plugin(auto_wrap_policy=None))  # the model is sharded already
            model, opt = _prepared(acc, presharded=True)
            out[engine] = record(_train(acc, model, opt, range(STEPS)), model)
            out[f"{engine}-engine"] = _engine_of(model)
    return out


def test_accelerate_fp32_checkpoints(tmp_path) -> None:
    out = run_on_ranks(2, _fp32_case, str(tmp_path))[0]
    check_same_run(out["fsdp2"], out["torch"])
    check_same(out["fsdp2-saved"], out["torch-saved"], "save_model", bitwise=True)
    assert set(out["torch-saved"]) <= set(out["torch"]["params"]), "save_model's names"
    for name, t in out["torch-saved"].items():  # the trained parameters, gathered
        assert torch.equal(t, out["torch"]["params"][name]), name
    want = out["resume-torch-from-torch"]
    check_same_run(out["resume-fsdp2-from-torch"], want, "fsdp2 resumed from torch's")
    check_same_run(out["resume-fsdp2-from-fsdp2"], want, "fsdp2 resumed from its own")


def test_accelerate_bf16_checkpointing_ram_efficient() -> None:
    out = run_on_ranks(2, _bf16_case)[0]
    assert out["torch-engine"] == "torch" and out["fsdp2-engine"] == "fsdp2", out
    check_same_run(out["fsdp2"], out["torch"])


def test_accelerate_presharded_model() -> None:
    out = run_on_ranks(2, _presharded_case)[0]
    assert out["torch-engine"] == "torch" and out["fsdp2-engine"] == "fsdp2", out
    check_same_run(out["fsdp2"], out["torch"])
