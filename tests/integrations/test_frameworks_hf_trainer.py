"""The Hugging Face ``Trainer`` with FSDP2 on fsdp2 (``fsdp2.integrations.using_fsdp2``):
bitwise torch's FSDP2.

One spawned 2-rank run. For each ``fsdp_config["state_dict_type"]`` (``SHARDED_STATE_DICT``,
``FULL_STATE_DICT``): a ``Trainer`` trains a tiny ``LlamaForCausalLM`` for 2 optimizer steps
(``gradient_accumulation_steps=2``, ``max_grad_norm=1``, each decoder layer its own FSDP
unit) and checkpoints, with torch's FSDP2 and then with fsdp2 under the switch; then a fresh
``Trainer`` resumes from torch's checkpoint (``resume_from_checkpoint``) for one more step
with each engine. The logged (rank-averaged) losses of every step and the final full
parameters are bitwise equal.

PEFT: the same ``Trainer`` (2 steps, no checkpoints) trains a LoRA adapter on the tiny Llama
with each engine (the wrap policy ``update_fsdp_plugin_peft`` sets makes the embedding, each
decoder layer and ``lm_head`` units): the losses and all parameters are bitwise equal (only
the adapters moved), then greedy ``generate`` (5 tokens) gives the same tokens on both
engines and ranks. The ``Trainer``
calls ``dist.fsdp.register_fsdp_forward_method(model, "generate")`` (``generate`` bypasses
the root's forward); under the switch that name reaches fsdp2's, without it (torch's, a
no-op on fsdp2's modules) ``generate`` fails with "got mixed torch.Tensor and DTensor".

The ``Trainer`` builds its ``Accelerator`` from ``TrainingArguments``; on CPU accelerate falls
back to DDP ([Note: accelerate on CPU] in test_frameworks_accelerate.py), so the test
configures accelerate's ``PartialState`` as multi-GPU first and lets the ``Trainer`` use it
(``accelerator_config={"use_configured_state": True}``, ``use_cpu=True``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Any

import pytest
import torch
from _harness import run_on_ranks
from frameworks_common import ENGINES, rank_env, record, tiny_llama, tokens
from helpers import check_same_run

from fsdp2.integrations import using_fsdp2

pytest.importorskip("accelerate", reason="accelerate is a test extra: pip install -e '.[test]'")
pytest.importorskip("transformers", reason="transformers is a test extra")
if importlib.util.find_spec("peft") is None:  # (importing it here costs the collection ~1 s)
    pytest.skip("peft is a test extra", allow_module_level=True)

STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")


class _Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = tokens(i, local=False)[0]
        return {"input_ids": ids, "labels": ids}


def _trainer(
    out_dir: str, state_dict_type: str, max_steps: int, model: Any = None, **overrides: Any
) -> Any:
    from accelerate import PartialState
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedType
    from transformers import Trainer, TrainingArguments

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState().distributed_type = DistributedType.MULTI_GPU  # the GPU setup, on CPU
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        max_steps=max_steps,
        learning_rate=1e-2,
        max_grad_norm=1.0,
        logging_steps=1,
        save_steps=2,
        report_to=[],
        fsdp=True,
        fsdp_config={
            "version": 2,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "state_dict_type": state_dict_type,
            "reshard_after_forward": True,
        },
        seed=0,
        data_seed=0,
        use_cpu=True,
        accelerator_config={"use_configured_state": True},
        disable_tqdm=True,
        **overrides,
    )
    model = tiny_llama() if model is None else model
    return Trainer(model=model, args=args, train_dataset=_Data())


def _losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _case(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for sdt in STATE_DICT_TYPES:
        for engine in ENGINES:
            with rank_env(), using_fsdp2() if engine == "fsdp2" else contextlib.nullcontext():
                trainer = _trainer(os.path.join(tmp, f"{sdt}-{engine}"), sdt, max_steps=2)
                trainer.train()
                out[f"{sdt}-{engine}"] = record(_losses(trainer), trainer.model_wrapped)
                out[f"{sdt}-{engine}-engine"] = type(trainer.model_wrapped).__module__.split(".")[0]
        for engine in ENGINES:
            with rank_env(), using_fsdp2() if engine == "fsdp2" else contextlib.nullcontext():
                trainer = _trainer(os.path.join(tmp, f"{sdt}-resume-{engine}"), sdt, max_steps=3)
                trainer.train(
                    resume_from_checkpoint=os.path.join(tmp, f"{sdt}-torch", "checkpoint-2")
                )
                out[f"{sdt}-resume-{engine}"] = record(_losses(trainer), trainer.model_wrapped)
    return out


def test_hf_trainer_train_checkpoint_resume(tmp_path) -> None:
    out = run_on_ranks(2, _case, str(tmp_path))[0]
    for sdt in STATE_DICT_TYPES:
        assert out[f"{sdt}-torch-engine"] == "torch", out
        assert out[f"{sdt}-fsdp2-engine"] == "fsdp2", out
        assert len(out[f"{sdt}-torch"]["losses"]) == 2, out[f"{sdt}-torch"]
        check_same_run(out[f"{sdt}-fsdp2"], out[f"{sdt}-torch"], sdt)
        resumed = out[f"{sdt}-resume-torch"]["losses"]  # the log comes with the checkpoint
        assert resumed[:2] == out[f"{sdt}-torch"]["losses"] and len(resumed) == 3, resumed
        check_same_run(out[f"{sdt}-resume-fsdp2"], out[f"{sdt}-resume-torch"], f"{sdt} resume")


# ---- PEFT LoRA, then generate ----------------------------------------------------------------


def _lora_llama() -> Any:
    """The tiny Llama with a LoRA adapter (r=4 on q_proj / v_proj; the base frozen)."""
    import warnings

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = tiny_llama()  # seeds; the adapters' initialisation follows
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft calls deprecated transformers properties
        config.task_type = "CAUSAL_LM"
        return get_peft_model(model, config)


def _generate(model: Any) -> torch.Tensor:
    """Greedy decoding of 5 tokens from the same two prompts on every rank."""
    prompts = tokens(99, local=False)[:2, :6]
    model.eval()
    with torch.no_grad():
        return model.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=5,
            min_new_tokens=5,  # no early end-of-sequence: every rank decodes 5 steps
            do_sample=False,
        )


def _units(model: Any) -> list[str]:
    """The modules either engine sharded (its FSDP units)."""
    from torch.distributed.fsdp import FSDPModule

    import fsdp2

    kinds = (FSDPModule, fsdp2.FSDPModule)
    return [name for name, m in model.named_modules() if isinstance(m, kinds)]


def _lora_case(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for engine in ENGINES:
        with rank_env(), using_fsdp2() if engine == "fsdp2" else contextlib.nullcontext():
            model = _lora_llama()
            trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            trainer = _trainer(
                os.path.join(tmp, engine), "SHARDED_STATE_DICT", 2, model, save_strategy="no"
            )
            trainer.train()
            wrapped = trainer.model_wrapped
            out[engine] = record(_losses(trainer), wrapped)
            out[f"{engine}-trainable"] = trainable
            after = out[engine]["params"]
            out[f"{engine}-moved"] = sorted(
                n for n in after if not torch.equal(after[n], before[n])
            )
            out[f"{engine}-engine"] = type(wrapped).__module__.split(".")[0]
            out[f"{engine}-units"] = _units(wrapped)
            # the Trainer registered ``generate`` through torch's name (the switched one)
            out[f"{engine}-registered"] = "generate" in vars(wrapped)
            out[f"{engine}-tokens"] = _generate(wrapped)
    return out


def test_hf_trainer_peft_lora_generate(tmp_path) -> None:
    outs = run_on_ranks(2, _lora_case, str(tmp_path))
    out = outs[0]
    for engine in ENGINES:
        assert out[f"{engine}-engine"] == engine and out[f"{engine}-registered"], out
        trainable = out[f"{engine}-trainable"]
        assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), out
        assert out[f"{engine}-moved"] == trainable, out  # the adapters trained, the base not
        assert len(out[engine]["losses"]) == 2, out[engine]
        assert out[f"{engine}-tokens"].shape == (2, 11), out[f"{engine}-tokens"]
    # the units of PEFT's wrap policy, the same with either engine
    llama = "base_model.model."
    units = ["", *(llama + m for m in ("model.embed_tokens", "model.layers.0", "model.layers.1"))]
    assert out["torch-units"] == [*units, llama + "lm_head"] == out["fsdp2-units"], out
    check_same_run(out["fsdp2"], out["torch"], "LoRA")  # the adapters and the frozen base
    assert torch.equal(out["fsdp2-tokens"], out["torch-tokens"]), out
    assert torch.equal(outs[1]["fsdp2-tokens"], out["fsdp2-tokens"]), "ranks generated apart"
