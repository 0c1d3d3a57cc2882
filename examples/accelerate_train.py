"""Train with accelerate's FSDP2 plugin, running on fsdp2 (``fsdp2.integrations.use_fsdp2``).

    torchrun --standalone --nproc_per_node 2 examples/accelerate_train.py
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no examples/accelerate_train.py

The script is an ordinary accelerate FSDP2 script with one line added, ``use_fsdp2()``,
before anything builds FSDP objects. On CPU (gloo) it trains a tiny Llama built from a
config: accelerate takes its FSDP2 path only on a GPU setup and otherwise falls back to DDP
without a word, so the two lines under ``if device == "cpu"`` make it take that path on the
CPU; on GPUs they are not run (delete them). Every decoder layer is one FSDP unit, bf16
compute, 2 micro-batches per optimizer step, gradient clipping; at the end the full model is
saved (``save_pretrained`` of ``get_state_dict``) and reloaded with ``from_pretrained``.
"""

from fsdp2.integrations import use_fsdp2

use_fsdp2()  # first thing: accelerate's FSDP2 then shards with fsdp2

import argparse  # noqa: E402

import torch  # noqa: E402
from accelerate import Accelerator, PartialState  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import fsdp2  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
parser.add_argument("--out", default="runs/accelerate_train")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cpu":  # CPU only: take accelerate's FSDP2 path on gloo (see the docstring)
    PartialState(cpu=True).distributed_type = DistributedType.MULTI_GPU

plugin = FullyShardedDataParallelPlugin(
    fsdp_version=2,
    auto_wrap_policy="transformer_based_wrap",
    transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    reshard_after_forward=True,
    state_dict_type="FULL_STATE_DICT",
)
accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="bf16", gradient_accumulation_steps=2)

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
optim = torch.optim.AdamW(model.parameters(), lr=3e-3)

# This file's bytes as tokens; accelerate's data loader gives each rank its own batches.
text = torch.frombuffer(bytearray(open(__file__, "rb").read()), dtype=torch.uint8).long()
ids = text[: len(text) // 64 * 64].view(-1, 64)
data = torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in ids], batch_size=4)

model, optim, data = accelerator.prepare(model, optim, data)
assert isinstance(model, fsdp2.FSDPModule) and type(model).__module__.startswith("fsdp2")
accelerator.print(f"{accelerator.num_processes} processes, {accelerator.distributed_type}")
model.train()
step = 0
while step < args.steps:
    for batch in data:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            optim.zero_grad()
        if accelerator.sync_gradients:
            loss = accelerator.reduce(loss.detach(), reduction="mean")
            accelerator.print(f"step {step}: loss {loss.item():.4f}")
            step += 1
            if step == args.steps:
                break

# The full model as from_pretrained reads it (weights and config.json), written by rank 0.
state_dict = accelerator.get_state_dict(model)  # collective: full tensors on rank 0
accelerator.unwrap_model(model).save_pretrained(
    args.out, state_dict=state_dict, is_main_process=accelerator.is_main_process
)
accelerator.wait_for_everyone()
if accelerator.is_main_process:
    reloaded = AutoModelForCausalLM.from_pretrained(args.out).state_dict()
    assert all(torch.equal(reloaded[name], t) for name, t in state_dict.items())
    print(f"saved to {args.out}; from_pretrained gives the trained weights")
accelerator.end_training()
