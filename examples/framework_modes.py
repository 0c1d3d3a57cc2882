"""fsdp2's modes through accelerate's own loop: ``use_fsdp2(deterministic=True)``, ...

    torchrun --nproc-per-node 1 examples/framework_modes.py --mode deterministic
    torchrun --nproc-per-node 2 examples/framework_modes.py --mode deterministic
    torchrun --nproc-per-node 4 examples/framework_modes.py --mode shard_over_replicas

An ordinary accelerate FSDP2 script (its ``prepare``, its gradient accumulation, its
``clip_grad_norm_``) with the mode asked for in the one line that switches it to fsdp2. Each
step's global batch is 4 micro-batches; each rank takes its share of them, in order. Under
``deterministic`` the last line, a digest of the trained weights, is the same on 1, 2 and 4
ranks; under ``shard_over_replicas`` (4 ranks: HSDP 2x2) each rank holds half of the
gradients and optimizer state, and accelerate's clipping reads the gradient pieces.
``--mode wire`` sends the gradients in bf16 (fp32 sums).
"""

import argparse

import torch

from fsdp2.integrations import use_fsdp2

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["deterministic", "wire", "shard_over_replicas"])
parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
args = parser.parse_args()

modes = {
    "deterministic": {"deterministic": True},
    "wire": {"exchange_reduce": torch.bfloat16},
    "shard_over_replicas": {"shard_over_replicas": True},
}
use_fsdp2(**modes[args.mode])  # first thing: accelerate then shards with fsdp2, in the mode

import hashlib  # noqa: E402

from accelerate import Accelerator, PartialState  # noqa: E402
from accelerate.parallelism_config import ParallelismConfig  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

MICRO_BATCHES = 4  # per optimizer step, over all ranks

device = "cuda" if torch.cuda.is_available() else "cpu"
state = PartialState(cpu=device == "cpu")
if device == "cpu":  # CPU only: take accelerate's FSDP2 path on gloo (examples/accelerate_train.py)
    state.distributed_type = DistributedType.MULTI_GPU
world = state.num_processes
per_rank = MICRO_BATCHES // world  # the accumulation steps: a power of two
hsdp = ParallelismConfig(dp_replicate_size=2, dp_shard_size=world // 2) if world == 4 else None
plugin = FullyShardedDataParallelPlugin(
    fsdp_version=2,
    auto_wrap_policy="transformer_based_wrap",
    transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
)
accelerator = Accelerator(
    fsdp_plugin=plugin, gradient_accumulation_steps=per_rank, parallelism_config=hsdp
)

torch.manual_seed(0)  # the same initial weights on every rank
config = LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip
model = AutoModelForCausalLM.from_config(config)
optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, optim = accelerator.prepare(model, optim)
if args.mode == "shard_over_replicas":  # the optimizer accelerate prepared, wrapped by fsdp2
    from fsdp2.replica_optim import ReplicaShardedOptimizer

    assert isinstance(optim.optimizer, ReplicaShardedOptimizer), type(optim.optimizer)

rank = state.process_index
for step in range(args.steps):
    gen = torch.Generator().manual_seed(step)  # the global batch, the same on every rank
    batch = torch.randint(0, 256, (MICRO_BATCHES, 2, 32), generator=gen)
    total = torch.zeros((), device=accelerator.device)
    for j in range(per_rank):  # this rank's consecutive micro-batches of the global batch
        tokens = batch[rank * per_rank + j].to(accelerator.device)
        with accelerator.accumulate(model):
            loss = model(input_ids=tokens, labels=tokens).loss  # accelerate divides it by per_rank
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            optim.zero_grad()
        total += loss.detach()
    mean = accelerator.reduce(total / per_rank, reduction="mean")
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    accelerator.print(f"step {step}: loss {mean.item():.6f}, gradient norm {norm.item():.6f}")

weights = [p.full_tensor().detach().cpu().contiguous() for p in model.parameters()]
digest = hashlib.sha256(b"".join(w.numpy().tobytes() for w in weights)).hexdigest()[:16]
accelerator.print(f"trained with --mode {args.mode} on {world} ranks: weights {digest}")
accelerator.end_training()
