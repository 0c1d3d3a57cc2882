"""Small deterministic models and training helpers shared by the distributed tests.

Every model keeps its shardable blocks in ``self.layers`` (an ``nn.ModuleList``) so a test
shards them the usual way (``shard_model``: every block, then the root). Sizes are uneven on
purpose: with 2 or 4 ranks some dim-0 shards are padded and some ranks hold no rows at all
(``MLPStack``'s last ``Linear(3, 1)``, the vocabulary of 37 rows, ``ResidualNet``'s 6 features
on 4 ranks: 2, 2, 2, 0 rows).

Build every copy of a model under the same seed (``build``) and feed every engine the same
global batch (``make_batch``); a rank trains on its slice of it (``rank_slice``). Compare full
values with ``full_params`` / ``full_grads``: one all-gather per group and dtype for the usual
dim-0 shards (``full_values``; ``test_shared_helpers.py`` holds them to ``full_tensor()``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from comm_counter import AG_API
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.checkpoint import checkpoint

from fsdp2._core.replicas.piece_grad import PieceGrad

__all__ = [
    "MLPBlock",
    "MLPStack",
    "ResidualBlock",
    "ResidualNet",
    "TinyTransformer",
    "TransformerBlock",
    "build",
    "full_value",
    "full_values",
    "full_grads",
    "full_params",
    "local_loss",
    "make_batch",
    "make_optimizer",
    "mean_over_ranks",
    "rank_slice",
    "shard_model",
]


class MLPBlock(nn.Module):
    """``act(lin(x))``; the inner ``lin`` is a plain submodule tests can hook."""

    def __init__(self, d_in: int, d_out: int, relu: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return F.relu(y) if self.relu else y


class MLPStack(nn.Module):
    """A stack of ``Linear`` blocks over ``dims`` (ReLU after all but the last block).

    Args:
        dims: feature sizes, ``dims[i] -> dims[i + 1]`` per block.
        head_dim: if given, the root itself holds a ``Linear(dims[-1], head_dim)`` (``head``),
            so the root's ``fully_shard`` group has parameters; if ``None`` the root holds none.
    """

    def __init__(self, dims: Sequence[int] = (7, 5, 3, 1), head_dim: int | None = None) -> None:
        super().__init__()
        n = len(dims) - 1
        self.layers = nn.ModuleList(
            MLPBlock(dims[i], dims[i + 1], relu=i < n - 1) for i in range(n)
        )
        self.head = nn.Linear(dims[-1], head_dim) if head_dim is not None else None
        self.in_dim = dims[0]
        self.out_dim = dims[-1] if head_dim is None else head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


class _Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (b, heads, t, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    """Pre-norm block: RMSNorm + causal attention, LayerNorm + MLP (hidden 40: uneven)."""

    def __init__(self, dim: int, n_heads: int, hidden: int = 40) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = _Attention(dim, n_heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.fc2(F.gelu(self.fc1(self.mlp_norm(x))))


class TinyTransformer(nn.Module):
    """Token + learned position embeddings, ``n_layers`` blocks, final norm, output head.

    With ``tied=True`` the head's weight *is* the token embedding's (one parameter,
    registered on two modules, both managed by the root's ``fully_shard``).
    ``forward(tokens)`` takes ``(batch, seq)`` int64 tokens, ``seq <= max_seq``, and returns
    ``(batch, seq, vocab)`` logits.
    """

    def __init__(
        self,
        vocab: int = 37,
        dim: int = 24,
        n_heads: int = 2,
        n_layers: int = 2,
        tied: bool = True,
        max_seq: int = 16,
    ) -> None:
        super().__init__()
        self.vocab = vocab
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(max_seq, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.tok_emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.size(1), device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class ResidualBlock(nn.Module):
    """``x + lin2(tanh(lin1(x)))``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.tanh(self.lin1(x)))


class ResidualNet(nn.Module):
    """``inp -> layers -> out``: the root holds parameters on both sides of its blocks.

    Flags change the forward between steps: ``skip`` (the index of a block to leave out),
    ``reuse_first`` (call ``layers[0]`` twice), ``checkpoint`` (``None``: no activation
    checkpointing; else each block under ``checkpoint(use_reentrant=checkpoint)``).
    ``generate`` uses the root's own parameters outside ``forward``.
    """

    def __init__(self, d_in: int = 5, dim: int = 6, d_out: int = 3, n_layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, dim)
        self.layers = nn.ModuleList(ResidualBlock(dim) for _ in range(n_layers))
        self.out = nn.Linear(dim, d_out)
        self.skip: int | None = None
        self.reuse_first = False
        self.checkpoint: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.layers):
            if i == self.skip:
                continue
            if self.checkpoint is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.checkpoint)
            if self.reuse_first and i == 0:
                h = block(h)
        return self.out(h)

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        """Uses the root's own parameters outside ``forward``."""
        return self.out(torch.relu(self.inp(x))) * 2

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Calls ``forward`` inside itself, twice, as Hugging Face's ``generate`` does."""
        return self(x) + self(x * 2)


# ---------------------------------------------------------------------------------------------
# Building, data, training helpers

MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": lambda: MLPStack((7, 5, 3, 1)),
    "mlp_head": lambda: MLPStack((7, 5, 3, 1), head_dim=2),
    "transformer": lambda: TinyTransformer(),
    "residual": lambda: ResidualNet(),
}
_IO_DIMS = {"mlp": (7, 1), "mlp_head": (7, 2), "residual": (5, 3)}  # (input, output) features


def hf_llama_config(vocab_size: int, **overrides: Any) -> Any:
    """A tiny Hugging Face ``LlamaConfig`` (2 decoder layers, hidden 32, 4 heads, 2 KV heads)
    for the transformers, PEFT and framework tests (transformers imported here, lazily)."""
    from transformers import LlamaConfig

    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    return LlamaConfig(**(fields | overrides))


def build(name: str, seed: int = 0) -> nn.Module:
    """A fresh model of kind ``name`` (a key of ``MODELS``), initialized under ``seed``."""
    torch.manual_seed(seed)
    return MODELS[name]()


def shard_model(
    model: nn.Module,
    fully_shard_fn: Callable[..., Any],
    mesh: Any,
    *,
    root_kwargs: dict[str, Any] | None = None,
    **kw: Any,
) -> nn.Module:
    """Apply ``fully_shard_fn(block, mesh=mesh, **kw)`` to every block of ``model.layers``,
    then to ``model`` itself (with ``root_kwargs`` instead of ``kw`` when given).

    Works for ``fsdp2.fully_shard`` and ``torch.distributed.fsdp.fully_shard`` alike.
    """
    for block in model.layers:
        fully_shard_fn(block, mesh=mesh, **kw)
    fully_shard_fn(model, mesh=mesh, **(kw if root_kwargs is None else root_kwargs))
    return model


def make_batch(name: str, step: int, global_batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The global ``(inputs, targets)`` of training step ``step`` for model kind ``name``;
    identical on every rank (seeded by ``step`` only)."""
    g = torch.Generator().manual_seed(1000 + step)
    if name == "transformer":
        tokens = torch.randint(0, 37, (global_batch, 9), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    model_in, model_out = _IO_DIMS[name]
    x = torch.randn(global_batch, model_in, generator=g)
    y = torch.randn(global_batch, model_out, generator=g)
    return x, y


def rank_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s equal share (along dim 0) of a global batch."""
    assert t.size(0) % world_size == 0, f"global batch {t.size(0)} not divisible by {world_size}"
    n = t.size(0) // world_size
    return t[rank * n : (rank + 1) * n]


def local_loss(model: nn.Module, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean loss over the batch given (so averaging equal-size ranks' gradients equals the
    gradient of the global batch's mean loss)."""
    out = model(x)
    if name == "transformer":
        return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))
    if out.dtype != y.dtype:  # a low-precision output: torch < 2.13 has no mixed-dtype backward
        out = out.to(y.dtype)
    return F.mse_loss(out, y)


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    """``adamw`` (with weight decay) or ``sgd`` (with momentum), fixed hyperparameters.

    AdamW's ``eps`` is 1e-4, not torch's 1e-8: its first step moves each element by
    ``lr * g / (|g| + eps)``, so a gradient near zero (a rarely used expert, a cancelling sum)
    turns the last bit of a reduction into up to ``lr / eps`` of update. The replicated
    reference sums a batch in another order than the ranks do, and CPUs round differently
    (vector width, vendor): with 1e-8 a comparison could hold on one CPU and fail on another;
    with 1e-4 a rounding of the gradient moves an update by at most 100 times as much."""
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-4)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    raise ValueError(f"unknown optimizer {kind!r}")


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """The average of ``t`` over the default group (gloo has no ``ReduceOp.AVG`` all-reduce)."""
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def full_value(t: Any) -> Any:
    """A detached copy of the full (unsharded) value of ``t``: ``full_tensor()`` of a DTensor
    (collective), a clone of a plain tensor; anything else (``None``, a Python number) as is."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def full_values(ts: Sequence[Any]) -> list[Any]:
    """``[full_value(t) for t in ts]`` (collective), with one all-gather per process group and
    dtype for the DTensors whose full value is their dim-0 shards put back together: plain
    local tensors of a float dtype, placements ``(Shard(0),)`` or ``(Replicate(), Shard(0))``.
    The same values as ``full_tensor()`` (``torch.chunk``'s split of dim 0, replicas equal),
    in far fewer collectives; every other value goes through ``full_value``. Like DTensor's
    functional collectives, the all-gather bypasses ``comm_counter.CommCounter``'s patches."""
    out: list[Any] = [None] * len(ts)
    buckets: dict[tuple[Any, torch.dtype], list[int]] = {}
    for i, t in enumerate(ts):
        dim = _shard0_dim(t)
        if dim is None:
            out[i] = full_value(t)
        else:
            buckets.setdefault((t.device_mesh.get_group(dim), t.dtype), []).append(i)
    for idx in buckets.values():
        for i, full in zip(idx, _gather_shard0([ts[i] for i in idx]), strict=True):
            out[i] = full
    return out


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """``name -> full (unsharded) parameter`` for every parameter; collective for DTensors."""
    named = list(model.named_parameters())
    return dict(zip([n for n, _ in named], full_values([p for _, p in named]), strict=True))


def full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """``name -> full gradient`` (``None`` where a parameter has none); collective for
    DTensor gradients, so every rank must call it."""
    named = list(model.named_parameters())
    grads = full_values([p.grad for _, p in named])
    return dict(zip([n for n, _ in named], grads, strict=True))


_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_all_gather_single = getattr(dist, AG_API)  # taken at import: no CommCounter patch sees it


def _shard0_dim(t: Any) -> int | None:
    """The mesh dim ``t`` is sharded on (dim 0) when ``full_values`` may gather it in a
    bucket, else ``None``. Depends only on what every rank agrees on."""
    if not isinstance(t, DTensor) or t.dtype not in _FLOATS or t.dim() == 0:
        return None
    if isinstance(t, PieceGrad):  # a gradient held in pieces over the replicas
        return None
    if type(t.to_local()) is not torch.Tensor:  # tensor subclasses: DTensor knows best
        return None
    ndim = t.device_mesh.ndim
    if ndim > 2 or tuple(t.placements) != (Replicate(),) * (ndim - 1) + (Shard(0),):
        return None
    return ndim - 1


def _gather_shard0(ts: list[DTensor]) -> list[torch.Tensor]:
    """Full values of DTensors on one group, dtype and layout (see ``full_values``)."""
    mesh, dim = ts[0].device_mesh, ts[0].device_mesh.ndim - 1
    world, rank = mesh.size(dim), mesh.get_local_rank(dim)
    pieces, rows = [], []
    for t in ts:
        local = t.to_local().detach()
        per_rank = -(-t.shape[0] // world)  # torch.chunk's split: ceil, trailing ranks short
        held = max(0, min(per_rank, t.shape[0] - rank * per_rank))
        assert tuple(local.shape) == (held, *t.shape[1:]), (
            f"rank {rank}'s local shard of a {tuple(t.shape)} DTensor is {tuple(local.shape)}, "
            f"not torch.chunk's {held} rows"
        )
        piece = local.new_zeros((per_rank, *t.shape[1:]))
        piece[:held] = local
        pieces.append(piece.reshape(-1))
        rows.append(per_rank)
    flat = torch.cat(pieces)
    gathered = flat.new_empty(world * flat.numel())
    _all_gather_single(gathered, flat, group=mesh.get_group(dim))
    gathered = gathered.view(world, -1)
    out, offset = [], 0
    for t, per_rank in zip(ts, rows, strict=True):
        n = per_rank * math.prod(t.shape[1:])
        full = gathered[:, offset : offset + n].reshape(world * per_rank, *t.shape[1:])
        out.append(full[: t.shape[0]].clone(memory_format=torch.contiguous_format))
        offset += n
    return out
