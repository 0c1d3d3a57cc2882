"""A small transformer and its tensor-parallel plans, shared by the FSDP + TP tests.

``TPModel`` (embedding, two pre-norm blocks of multi-head attention and a GELU MLP, final
norm, output head) has sizes that TP and FSDP split unevenly on a ``(2, 2)`` mesh: the
vocabulary (34) and the MLP's hidden size (10) leave TP-local shards of 17 and 5 rows, which
FSDP splits 9/8 and 3/2. ``parallelize(model, tp_mesh, plan)`` applies the ``tp`` plan
(colwise/rowwise linears, plain norms) or ``tp_sp`` (plus ``SequenceParallel`` norms).
``make_meshes(name)`` builds the FSDP + TP and HSDP + TP meshes of ``MESHES``; TP is always the
innermost dimension, so data-parallel rank ``r`` holds ranks ``r * tp ... r * tp + tp - 1``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = [
    "GLOBAL_BATCH",
    "MESHES",
    "TPModel",
    "VOCAB",
    "build_tp_model",
    "dp_rank_and_size",
    "make_meshes",
    "parallelize",
    "tp_batch",
    "tp_loss",
]

VOCAB, DIM, HEADS, HIDDEN, SEQ = 34, 8, 4, 10, 8  # TP-local: 17 rows, 2 heads, 5 rows (uneven)
GLOBAL_BATCH = 4

# name -> (mesh shape, mesh dim names, data-parallel dim names)
MESHES: dict[str, tuple[tuple[int, ...], tuple[str, ...], tuple[str, ...]]] = {
    "fsdp2x2": ((2, 2), ("dp", "tp"), ("dp",)),
    "hsdp1x2x2": ((1, 2, 2), ("replicate", "shard", "tp"), ("replicate", "shard")),
    "hsdp2x1x2": ((2, 1, 2), ("replicate", "shard", "tp"), ("replicate", "shard")),
}


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under ColwiseParallel each TP rank computes HEADS / tp of them.
        q, k, v = (
            w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class TPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(DIM)
        self.attn = _Attention()
        self.mlp_norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.w2(F.gelu(self.w1(self.mlp_norm(x))))


class TPModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(TPBlock() for _ in range(2))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_tp_model() -> TPModel:
    torch.manual_seed(0)
    return TPModel()


def parallelize(model: TPModel, tp_mesh: DeviceMesh, plan: str) -> TPModel:
    """``tp``: Megatron-style colwise/rowwise linears, norms left plain (so FSDP alone shards
    them, on the data-parallel mesh). ``tp_sp``: plus sequence parallelism on the norms (their
    parameters become ``Replicate()`` DTensors on the TP mesh)."""
    if plan == "tp":
        parallelize_module(
            model,
            tp_mesh,
            {
                "tok_emb": RowwiseParallel(input_layouts=Replicate()),
                "head": ColwiseParallel(output_layouts=Replicate()),
            },
        )
        block_plan: dict[str, Any] = {
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(),
            "w1": ColwiseParallel(),
            "w2": RowwiseParallel(),
        }
    else:
        assert plan == "tp_sp", plan
        parallelize_module(
            model,
            tp_mesh,
            {
                "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "norm": SequenceParallel(),
                "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            },
        )
        block_plan = {
            "attn_norm": SequenceParallel(),
            "attn": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "w1": ColwiseParallel(input_layouts=Shard(1)),
            "w2": RowwiseParallel(output_layouts=Shard(1)),
        }
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan)
    return model


def make_meshes(mesh_name: str) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """``(world mesh, data-parallel mesh, tp mesh)`` for a key of ``MESHES``."""
    shape, names, dp_names = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_mesh = mesh[dp_names[0]] if len(dp_names) == 1 else mesh[dp_names]
    return mesh, dp_mesh, mesh["tp"]


def dp_rank_and_size(mesh: DeviceMesh) -> tuple[int, int]:
    tp = mesh["tp"].size()
    return dist.get_rank() // tp, dist.get_world_size() // tp  # tp is the innermost dim


def tp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def tp_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
