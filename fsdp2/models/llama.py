"""A small Llama-style decoder: RMSNorm, rotary attention (grouped-query),
SwiGLU MLP, optional tied embedding/output weights.

Written for readability and for sharding one ``TransformerBlock`` per
``fully_shard`` call (``model.layers`` is an ``nn.ModuleList``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    """Model shape.

    Attributes:
        vocab_size: tokens (256 for byte-level text).
        dim: model width.
        n_layers: transformer blocks.
        n_heads: attention heads.
        n_kv_heads: key/value heads (grouped-query attention); ``None`` = ``n_heads``.
        ffn_multiple_of: the SwiGLU hidden size is rounded up to a multiple of this.
        max_seq_len: longest sequence the rotary tables cover.
        rope_theta: rotary base.
        norm_eps: RMSNorm epsilon.
        tie_embeddings: share the token embedding and output head weights.
    """

    vocab_size: int = 256
    dim: int = 256
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int | None = None
    ffn_multiple_of: int = 64
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} must be divisible by n_heads {self.n_heads}")
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ValueError(f"n_heads {self.n_heads} must be divisible by n_kv_heads {kv}")

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        m = self.ffn_multiple_of
        return m * ((hidden + m - 1) // m)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rotary_tables(
    head_dim: int, seq_len: int, theta: float, device: torch.device | str | None = None
) -> torch.Tensor:
    """``(seq_len, head_dim // 2, 2)``: cos and sin of each position's angles."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of features of ``x`` (batch, seq, heads, head_dim)."""
    xr = x.float().unflatten(-1, (-1, 2))
    cos, sin = rope[: x.size(1), None, :, 0], rope[: x.size(1), None, :, 1]
    a, b = xr[..., 0], xr[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        proj: torch.Tensor = self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))
        return proj


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        hidden = cfg.ffn_hidden
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class TransformerBlock(nn.Module):
    """Pre-norm attention + SwiGLU MLP with residuals: the unit to shard."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = x + self.attention(self.attention_norm(x), rope)
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out


class Llama(nn.Module):
    """Token embedding, ``n_layers`` blocks, final norm, output head.

    ``forward(tokens)`` returns logits ``(batch, seq, vocab)``; with
    ``targets`` it returns the mean cross-entropy loss instead.
    """

    rope: torch.Tensor  # the rotary tables (a non-persistent buffer)

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", self._rope(None), persistent=False)
        self.init_weights()

    def _rope(self, device: torch.device | None) -> torch.Tensor:
        cfg = self.cfg
        return rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta, device)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialize every parameter and buffer in place: works on sharded
        DTensor parameters too (after ``to_empty`` from the meta device)."""
        if not self.rope.is_meta:
            self.rope.copy_(self._rope(self.rope.device))
        std = 0.02
        nn.init.normal_(self.tok_embeddings.weight, std=std if self.cfg.tie_embeddings else 1.0)
        depth_std = std / math.sqrt(2 * self.cfg.n_layers)
        for layer in self.layers:
            block = cast(TransformerBlock, layer)  # or a wrapper forwarding its attributes
            for lin in (block.attention.wq, block.attention.wk, block.attention.wv):
                nn.init.trunc_normal_(lin.weight, std=std)
            for lin in (block.feed_forward.w1, block.feed_forward.w3):
                nn.init.trunc_normal_(lin.weight, std=std)
            nn.init.trunc_normal_(block.attention.wo.weight, std=depth_std)
            nn.init.trunc_normal_(block.feed_forward.w2.weight, std=depth_std)
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        if not self.cfg.tie_embeddings:
            nn.init.trunc_normal_(self.output.weight, std=self.cfg.dim**-0.5)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        logits: torch.Tensor = self.output(self.norm(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
