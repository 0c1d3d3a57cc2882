"""Fine-tune LoRA adapters (PEFT) on a Hugging Face causal LM sharded with fsdp2's fully_shard.

    torchrun --standalone --nproc_per_node 2 examples/lora_finetune.py

On CPU (gloo) the base model is a tiny Llama built from a config (seeded, so the same on
every run); on GPUs pass ``--model`` (a Hub name or folder). The base weights stay frozen in
bf16-computing shards; only ``lora_A`` / ``lora_B`` get gradients and optimizer state. The
adapter is saved with PEFT's ``save_pretrained`` (rank 0 writes the gathered adapter weights)
and reloaded onto a fresh base model with ``PeftModel.from_pretrained``, checked weight by
weight.
"""

import argparse
import os

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, LlamaConfig

from fsdp2 import MixedPrecisionPolicy, fully_shard

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="a from_pretrained name or folder (default: a tiny Llama)")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
parser.add_argument("--out", default="runs/lora_finetune")
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if device.type == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh(device.type, (world,))


def base_model():
    torch.manual_seed(0)  # the same base weights on every rank, and when reloading
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return AutoModelForCausalLM.from_config(config)


lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
model = get_peft_model(base_model(), lora)  # freezes the base, adds lora_A / lora_B
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in model.base_model.model.model.layers:  # PeftModel -> LoraModel -> LlamaForCausalLM
    fully_shard(layer, mesh=mesh, mp_policy=mp)
fully_shard(model, mesh=mesh, mp_policy=mp)
optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

text = torch.frombuffer(bytearray(open(__file__, "rb").read()), dtype=torch.uint8).long()
text = text % model.config.vocab_size
gen = torch.Generator().manual_seed(0)
for step in range(args.steps):
    starts = torch.randint(len(text) - args.seq_len, (world * args.batch_size,), generator=gen)
    ids = torch.stack([text[s : s + args.seq_len] for s in starts.tolist()])
    ids = ids.view(world, args.batch_size, -1)[rank].to(device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    loss = loss.detach()
    dist.all_reduce(loss)  # the sum over ranks, for the log
    if rank == 0:
        print(f"step {step}: loss {loss.item() / world:.4f}")

# The adapter only: gather its (small) weights, rank 0 writes them.
adapter = {
    name: t.full_tensor()  # collective: every rank gathers
    for name, t in model.state_dict().items()
    if "lora_" in name
}
if rank == 0:
    model.save_pretrained(args.out, state_dict=adapter)
    reloaded = PeftModel.from_pretrained(base_model(), args.out)
    state = reloaded.state_dict()
    for name, t in adapter.items():
        assert torch.equal(state[name].to(t.device), t), name
    print(f"adapter saved to {args.out}; PeftModel.from_pretrained gives the trained adapter")
dist.destroy_process_group()
