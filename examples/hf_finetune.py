"""Fine-tune a Hugging Face causal LM with fsdp2's fully_shard, then save it for from_pretrained.

    torchrun --standalone --nproc_per_node 2 examples/hf_finetune.py

On CPU (gloo) it trains a tiny Llama built from a config, on this file's own bytes (no
download). On GPUs (NCCL, one per rank) pass a model and a tokenizer's vocabulary takes over:
``--model Qwen/Qwen2.5-0.5B`` (any local folder or Hub name ``from_pretrained`` reads).
Each decoder layer is one fully_shard unit, then the root; bf16 compute with fp32 gradient
reduction; activation checkpointing by transformers' own switch (``--ac hf``, the default) or
torch's ``checkpoint_wrapper`` around each layer before it is sharded (``--ac wrapper``).
The trained model is written as safetensors with its config.json (``--out``), and rank 0
reloads it with ``from_pretrained`` and checks every weight.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, LlamaConfig

from fsdp2 import MixedPrecisionPolicy, fully_shard
from fsdp2.checkpoint import save_full_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="a from_pretrained name or folder (default: a tiny Llama)")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
parser.add_argument("--ac", choices=["hf", "wrapper", "none"], default="hf")
parser.add_argument("--out", default="runs/hf_finetune")
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if device.type == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh(device.type, (world,))

torch.manual_seed(0)  # the same initial weights on every rank
if args.model:
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
else:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = AutoModelForCausalLM.from_config(config)

layers = model.model.layers  # the decoder layers (Llama, Qwen, Mistral, ...)
if args.ac == "hf":
    model.activation_checkpointing_enable()
elif args.ac == "wrapper":
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer)  # wrap first, then shard the wrapper
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in layers:
    fully_shard(layer, mesh=mesh, mp_policy=mp)
fully_shard(model, mesh=mesh, mp_policy=mp)  # the root: embeddings, final norm, head
optim = torch.optim.AdamW(model.parameters(), lr=3e-3)

# Every rank draws the same global batch and trains on its own rows.
text = torch.frombuffer(bytearray(open(__file__, "rb").read()), dtype=torch.uint8).long()
text = text % model.config.vocab_size
gen = torch.Generator().manual_seed(0)
model.config.use_cache = False  # no KV cache while training
model.train()
for step in range(args.steps):
    starts = torch.randint(len(text) - args.seq_len, (world * args.batch_size,), generator=gen)
    ids = torch.stack([text[s : s + args.seq_len] for s in starts.tolist()])
    ids = ids.view(world, args.batch_size, -1)[rank].to(device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    optim.zero_grad()
    loss = loss.detach()
    dist.all_reduce(loss)  # the sum over ranks, for the log
    if rank == 0:
        print(f"step {step}: loss {loss.item() / world:.4f}")

# model.safetensors (or shards and an index) and config.json, for from_pretrained.
save_full_checkpoint(model, args.out)
full = {name: t.full_tensor() for name, t in model.state_dict().items()}  # collective
if rank == 0:
    reloaded = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    for name, t in reloaded.state_dict().items():
        assert torch.equal(t, full[name].cpu()), name
    print(f"saved to {args.out}; from_pretrained gives the trained weights")
dist.destroy_process_group()
