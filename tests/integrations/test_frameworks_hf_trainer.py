"""The Hugging Face ``Trainer`` with FSDP2 on fsdp2 (``fsdp2.integrations.using_fsdp2``):
bitwise torch's FSDP2.

One spawned 2-rank run. For each ``fsdp_config["state_dict_type"]`` (``SHARDED_STATE_DICT``,
``FULL_STATE_DICT``): a ``Trainer`` trains a tiny ``LlamaForCausalLM`` for 2 optimizer steps
(``gradient_accumulation_steps=2``, ``max_grad_norm=1``, each decoder layer its own FSDP
unit) and checkpoints, with torch's FSDP2 and then with fsdp2 under the switch; then a fresh
``Trainer`` resumes from torch's checkpoint (``resume_from_checkpoint``) for one more step
with each engine. The logged (rank-averaged) losses of every step and the final full
parameters are bitwise equal.

The ``Trainer`` builds its ``Accelerator`` from ``TrainingArguments``; on CPU accelerate falls
back to DDP ([Note: accelerate on CPU] in test_frameworks_accelerate.py), so the test
configures accelerate's ``PartialState`` as multi-GPU first and lets the ``Trainer`` use it
(``accelerator_config={"use_configured_state": True}``, ``use_cpu=True``).
"""

from __future__ import annotations

import contextlib
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

STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")


class _Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = tokens(i, local=False)[0]
        return {"input_ids": ids, "labels": ids}


def _trainer(out_dir: str, state_dict_type: str, max_steps: int) -> Any:
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
    )
    return Trainer(model=tiny_llama(), args=args, train_dataset=_Data())


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
