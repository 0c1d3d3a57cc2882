"""Stream the trained weights to an inference process after every step (RL weight sync).

    torchrun --standalone --nproc_per_node 3 examples/rl_weight_sync.py
    torchrun --standalone --nproc_per_node 3 examples/rl_weight_sync.py --lora

The last rank stands in for an inference engine (vLLM, SGLang): it holds an unsharded copy
of the model and takes no part in training. The other ranks train a Hugging Face causal LM
sharded with fsdp2's ``fully_shard``. After each optimizer step the trainers stream the
full weights with ``fsdp2.checkpoint.iter_full_tensors`` (a few bucketed all-gathers among
the trainers; only rank 0 receives them) and rank 0 broadcasts them, bucket by bucket, to
the engine over a process group of their own; the engine loads them as vLLM's
``load_weights`` does. Then both sides generate greedily from the same prompt and the
example checks that the engine's tokens equal the trainers' ``generate``. With ``--lora``
the trainers fine-tune PEFT LoRA adapters and the engine, a plain base model, receives the
weights with the adapters merged (``merge_lora=True``).

On CPU everything runs over gloo with a tiny Llama; on GPUs (one per rank) pass ``--model``
(a Hub name or folder) and the same code uses NCCL. A real engine gets
``dtype=torch.bfloat16`` (half the bytes); the check here compares fp32 weights.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoModelForCausalLM, LlamaConfig

from fsdp2 import fully_shard, register_fsdp_forward_method
from fsdp2.checkpoint import iter_full_tensors

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="a from_pretrained name or folder (default: a tiny Llama)")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--lora", action="store_true", help="train LoRA adapters, sync merged")
parser.add_argument("--bucket-mb", type=int, default=64, help="bytes per broadcast (MiB)")
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if device.type == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert world >= 2, "run with at least 2 processes: trainers, then the engine"
engine = world - 1  # the last rank is the inference engine
trainers = list(range(engine))
train_group = dist.new_group(trainers)  # every rank takes part in creating each group
sync_group = dist.new_group([0, engine])  # trainer rank 0 -> engine


def base_model(seed):
    torch.manual_seed(seed)
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


# --- the wire: (name, tensor) pairs in buckets, a header (names, shapes, dtypes) first ---


def send(weights, bucket_bytes):
    """Rank 0: broadcast the ``(name, tensor)`` pairs to the engine, a bucket at a time."""
    bucket, size = [], 0
    for name, t in weights:
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            _send_bucket(bucket)
            bucket, size = [], 0
    if bucket:
        _send_bucket(bucket)
    dist.broadcast_object_list([[]], src=0, group=sync_group)  # the end


def _send_bucket(bucket):
    header = [(name, t.shape, t.dtype) for name, t in bucket]
    dist.broadcast_object_list([header], src=0, group=sync_group)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])
    dist.broadcast(flat, src=0, group=sync_group)


def receive():
    """The engine: yield ``(name, tensor)`` as rank 0 sends them."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=sync_group)
        header = box[0]
        if not header:
            return
        sizes = [shape.numel() * dtype.itemsize for _, shape, dtype in header]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0, group=sync_group)
        for (name, shape, dtype), raw in zip(header, flat.split(sizes), strict=True):
            yield name, raw.view(dtype).view(shape)


def load_weights(model, weights):
    """What vLLM's ``model.load_weights(weights)`` does for a plain model."""
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, t in weights:
            params[name].copy_(t)


prompt = torch.tensor([[1, 17, 42, 99, 7]], device=device)
greedy = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}

if rank == engine:
    model = base_model(seed=1).to(device).eval()  # other weights until the first sync
    for _ in range(args.steps):
        load_weights(model, receive())
        with torch.no_grad():
            tokens = model.generate(prompt, **greedy)
        dist.broadcast(tokens, src=engine, group=sync_group)  # rank 0 checks them
else:
    mesh = DeviceMesh.from_group(train_group, device.type)
    model = base_model(seed=0)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
        layers = model.base_model.model.model.layers
    else:
        layers = model.model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # PeftModel.generate calls the base model's generate, not the root's forward: register
    # it so the root's parameters (embeddings, norm, head) are gathered for it too.
    register_fsdp_forward_method(model, "generate")
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        ids = torch.randint(model.config.vocab_size, (len(trainers), 4, 32), generator=gen)
        ids = ids[rank].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()

        # The weight sync: every trainer iterates (the all-gathers are collective);
        # only rank 0 receives the tensors and sends them on.
        start = time.perf_counter()
        weights = iter_full_tensors(model, ranks=[0], merge_lora=args.lora)
        if rank == 0:
            send(weights, args.bucket_mb << 20)
        else:
            for _ in weights:
                pass
        seconds = time.perf_counter() - start

        model.eval()
        with torch.no_grad():
            ours = model.generate(input_ids=prompt, **greedy)
        model.train()
        if rank == 0:
            theirs = torch.empty_like(ours)
            dist.broadcast(theirs, src=engine, group=sync_group)
            assert torch.equal(theirs, ours), (step, theirs.tolist(), ours.tolist())
            print(
                f"step {step}: loss {loss.item():.4f}, sync {seconds * 1000:.0f} ms, "
                f"engine tokens {theirs[0, prompt.shape[1] :].tolist()}"
            )
if rank == 0:
    print(f"weights in sync: {args.steps} steps, the engine's generations match")
dist.destroy_process_group()
