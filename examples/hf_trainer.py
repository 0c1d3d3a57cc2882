"""Train with the Hugging Face Trainer's FSDP2 option, running on fsdp2 (``use_fsdp2``).

    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py

An ordinary ``Trainer`` script with ``TrainingArguments(fsdp=True, fsdp_config={"version": 2,
...})`` and one line added, ``use_fsdp2()``, before the ``Trainer`` is built. On CPU (gloo) it
trains a tiny Llama built from a config. The Trainer sets FSDP up through accelerate, which
takes its FSDP2 path only on a GPU setup (on CPU it falls back to DDP without a word, and
``bf16=True`` raises "Your setup doesn't support bf16/gpu"): the CPU-only lines below set
accelerate's shared state up as on a GPU and tell the Trainer to use it
(``use_configured_state``). On GPUs drop them, and ``use_cpu``.
The run saves a full checkpoint at the end (``FULL_STATE_DICT``: ``model.safetensors`` and
config.json), which ``from_pretrained`` reads back.
"""

from fsdp2.integrations import use_fsdp2

use_fsdp2()  # first thing: the Trainer's FSDP2 then shards with fsdp2

import argparse  # noqa: E402

import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments  # noqa: E402

import fsdp2  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
parser.add_argument("--out", default="runs/hf_trainer")
args = parser.parse_args()

on_cpu = not torch.cuda.is_available()
if on_cpu:  # CPU only: accelerate's FSDP2 path on gloo (see the docstring)
    PartialState(cpu=True).distributed_type = DistributedType.MULTI_GPU

training_args = TrainingArguments(
    output_dir=args.out,
    max_steps=args.steps,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    learning_rate=3e-3,
    max_grad_norm=1.0,
    bf16=True,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    seed=0,
    fsdp=True,
    fsdp_config={
        "version": 2,
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "reshard_after_forward": True,
        "state_dict_type": "FULL_STATE_DICT",
    },
    use_cpu=on_cpu,
    accelerator_config={"use_configured_state": on_cpu},
)

torch.manual_seed(0)  # the same initial weights on every rank
config = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
model = AutoModelForCausalLM.from_config(config)  # on GPUs: from_pretrained("...")

# This file's bytes as tokens; the Trainer's sampler gives each rank its own rows.
text = torch.frombuffer(bytearray(open(__file__, "rb").read()), dtype=torch.uint8).long()
rows = text[: len(text) // 64 * 64].view(-1, 64)
dataset = [{"input_ids": r, "labels": r} for r in rows]

trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
trainer.train()
assert isinstance(trainer.model_wrapped, fsdp2.FSDPModule)
assert type(trainer.model_wrapped).__module__.startswith("fsdp2")
trainer.save_model(args.out)  # FULL_STATE_DICT: model.safetensors + config.json, from rank 0
if trainer.is_world_process_zero():
    reloaded = AutoModelForCausalLM.from_pretrained(args.out)
    print(
        f"{trainer.args.world_size} processes; saved to {args.out}, "
        f"from_pretrained loads {len(reloaded.state_dict())} tensors"
    )
