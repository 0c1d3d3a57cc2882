"""A small mixture-of-experts (MoE) transformer with expert parallelism, in the style of
torchtitan's MoE models, for testing per-parameter meshes (experts on one mesh, dense
weights on another) with either engine's ``fully_shard``.

* :class:`MoETransformer`: token embedding, ``layers`` (an ``nn.ModuleDict`` of
  :class:`MoEBlock`), final RMSNorm, output head. Each block is pre-norm causal attention
  (rotary positions) and a pre-norm :class:`MoE` layer; ``block.moe_enabled`` is ``True``
  and ``block.moe.experts`` is the :class:`GroupedExperts` module, as in torchtitan.
* :class:`MoE`: a linear router, softmax scores, top-k experts per token (no capacity limit,
  no load-balancing loss), the weighted sum of the chosen experts' outputs.
* :func:`apply_expert_parallel`: every block's expert weights become ``Shard(0)`` DTensors
  on a 1D expert-parallel mesh (each rank keeps ``num_experts / ep`` experts) and the MoE
  layers exchange tokens with autograd-aware all-to-alls over that mesh's group.
* :func:`parallelize_moe`: torchtitan's ``apply_fsdp_to_decoder`` for this model with the
  ``fully_shard`` of either engine: experts over an expert-FSDP mesh, the rest over the
  data-parallel mesh, one ``fully_shard`` call per block.

Without :func:`apply_expert_parallel` the same model computes every expert locally: that
is the replicated reference the sharded runs are compared with. Balanced routing under fake
tensors (``fsdp2.estimate_memory``'s simulated step), whose token counts (per expert, the
all-to-all splits) cannot be read: every expert gets ``tokens * top_k / num_experts`` of a
rank's routed tokens (near-equal integers summing to the total) and every rank sends each
rank of the expert-parallel group an equal share. Real tensors take the real path,
unchanged (tests/planning/test_estimate_moe.py: the estimate vs measured peaks).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

from fsdp2.api import ShardPlacementResult
from fsdp2.models.llama import RMSNorm, apply_rotary, rotary_tables

__all__ = [
    "GroupedExperts",
    "MoE",
    "MoEBlock",
    "MoEConfig",
    "MoETransformer",
    "apply_expert_parallel",
    "parallelize_moe",
]


@dataclass(frozen=True)
class MoEConfig:
    """Model shape (tiny by default: a few thousand parameters per block).

    Attributes:
        vocab_size: tokens.
        dim: model width.
        n_layers: transformer blocks (each with an MoE layer).
        n_heads: attention heads.
        num_experts: routed experts per MoE layer.
        top_k: experts each token is sent to.
        hidden: hidden size of each expert's SwiGLU feed-forward.
        max_seq_len: longest sequence the rotary tables cover.
        rope_theta: rotary base.
        norm_eps: RMSNorm epsilon.
    """

    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    num_experts: int = 4
    top_k: int = 2
    hidden: int = 16
    max_seq_len: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} must be divisible by n_heads {self.n_heads}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, num_experts={self.num_experts}]")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (expert parallelism), the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU feed-forwards with stacked weights: ``w1`` and ``w3``
    ``(E, hidden, dim)``, ``w2`` ``(E, dim, hidden)``. Under expert parallelism they are
    ``Shard(0)`` DTensors on the expert-parallel mesh and ``forward`` computes the local
    experts only (``.to_local()``: token counts per expert vary from step to step, which a
    DTensor cannot express).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` ``(N, dim)``: tokens sorted by (local) expert, ``counts[e]`` of them for
        expert ``e``; returns each token's expert output ``(N, dim)`` in the same order.
        Every local expert takes part in the autograd graph, with no tokens too (an empty
        matmul): its weights get a zero gradient rather than none, on every rank alike.
        """
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        if counts.numel() != w1.size(0):
            raise ValueError(f"{counts.numel()} token counts for {w1.size(0)} local experts")
        sizes = _balanced(x.size(0), counts.numel()) if _fake(counts) else counts.tolist()
        outs = []
        for e, chunk in enumerate(torch.split(x, sizes, dim=0)):
            h = F.silu(chunk @ w1[e].transpose(0, 1)) * (chunk @ w3[e].transpose(0, 1))
            outs.append(h @ w2[e].transpose(0, 1))
        return torch.cat(outs)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        """Truncated-normal weights: ``std`` for ``w1``/``w3``, ``out_std`` for ``w2``."""
        nn.init.trunc_normal_(self.w1, std=std)
        nn.init.trunc_normal_(self.w3, std=std)
        nn.init.trunc_normal_(self.w2, std=out_std)


def _fake(t: torch.Tensor) -> bool:  # estimate_memory's; not torch.compile's (the real path)
    return not torch.compiler.is_compiling() and is_fake(t)


def _balanced(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` near-equal shares, the larger first (balanced routing)."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def _all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Autograd-aware ``all_to_all_single`` of ``x``'s rows (backward: the reverse exchange)."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with warnings.catch_warnings():  # torch 2.13 deprecates the autograd-aware functional API
        warnings.simplefilter("ignore", FutureWarning)
        return dist_nn.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)  # type: ignore[no-any-return]


def _group_by_expert(counts: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder tokens received as ``[source rank][local expert]`` segments
    (``counts[s, e]`` rows each, row-major) into ``[local expert][source rank]`` order."""
    ep, n_local = counts.shape
    segment = torch.arange(ep * n_local).repeat_interleave(counts.flatten())
    return torch.argsort((segment % n_local) * ep + segment // n_local, stable=True)


class MoE(nn.Module):
    """Token-choice top-k routing over :class:`GroupedExperts`.

    The router's softmax scores (in fp32) pick each token's ``top_k`` experts (ties go to
    the lower expert index; ``expert_bias`` is added for the choice only, as torchtitan's
    load-balancing bias); the output is the sum of the chosen experts' outputs weighted by
    their unbiased scores. Every token reaches its experts (no capacity limit).

    With ``ep_group`` set (:func:`apply_expert_parallel`), ``forward`` exchanges the
    per-expert token counts, sends each token to its expert's rank (``all_to_all_single``
    over that group), runs the local experts and sends the outputs back; the backward's
    reverse all-to-alls make a local expert's gradient sum every rank's contributions.

    Attributes:
        tokens_per_expert: how many of this rank's tokens each expert got in the last
            forward, ``(num_experts,)``; ``None`` before the first.
    """

    expert_bias: torch.Tensor

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.dim, cfg.hidden, cfg.num_experts)
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))
        self.ep_group: dist.ProcessGroup | None = None
        self.tokens_per_expert: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        scores = F.softmax(self.router(tokens).float(), dim=-1)  # (T, E)
        ranked = torch.sort(scores + self.expert_bias, dim=-1, descending=True, stable=True)[1]
        expert_ids = ranked[:, : self.top_k]  # (T, K)
        weights = scores.gather(1, expert_ids)  # (T, K)
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (T * K,): by expert, then by token
        token_ids = order // self.top_k
        if _fake(flat):  # fake tensors (estimate_memory): balanced routing
            counts = torch.tensor(_balanced(flat.numel(), self.num_experts), device=flat.device)
        else:
            counts = flat.new_zeros(self.num_experts).scatter_add_(0, flat, torch.ones_like(flat))
        self.tokens_per_expert = counts.detach().clone()
        routed = tokens[token_ids]
        if self.ep_group is None:
            out = self.experts(routed, counts)
        else:
            out = self._expert_parallel(routed, counts, self.ep_group)
        out = out * weights.reshape(-1)[order].unsqueeze(1).to(out.dtype)
        combined = tokens.new_zeros(tokens.shape).index_add(0, token_ids, out.to(tokens.dtype))
        return combined.view(shape)

    def _expert_parallel(
        self, routed: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup
    ) -> torch.Tensor:
        """Send ``routed`` (sorted by global expert, ``counts`` per expert) to the experts'
        ranks, compute there, bring the outputs back in the same order."""
        ep = dist.get_world_size(group)
        n_local = self.num_experts // ep
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=group)
        by_source = received_counts.view(ep, n_local)  # [source rank][local expert]
        if _fake(counts):  # balanced routing: equal shares each way, kept in arrival order
            send_splits = _balanced(routed.size(0), ep)
            recv_splits = [send_splits[dist.get_rank(group)]] * ep
            perm = torch.arange(sum(recv_splits), device=routed.device)
        else:
            send_splits = counts.view(ep, n_local).sum(1).tolist()
            recv_splits = by_source.sum(1).tolist()
            perm = _group_by_expert(by_source)
        received = _all_to_all(routed, recv_splits, send_splits, group)
        out = self.experts(received[perm], by_source.sum(0))
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel())
        return _all_to_all(out[inverse], send_splits, recv_splits, group)


class Attention(nn.Module):
    """Multi-head causal self-attention with rotary positions."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            w(x).view(b, t, self.n_heads, self.head_dim) for w in (self.wq, self.wk, self.wv)
        )
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.wo(y.transpose(1, 2).reshape(b, t, -1))
        return out


class MoEBlock(nn.Module):
    """Pre-norm attention and pre-norm :class:`MoE` with residuals: the unit to shard.

    Attributes:
        moe_enabled: always ``True`` (torchtitan's marker of an MoE block).
        activation_checkpoint: recompute the block's forward in backward
            (``torch.utils.checkpoint``, non-reentrant) instead of keeping activations.
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = MoE(cfg)
        self.moe_enabled = True
        self.activation_checkpoint = False

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpoint:
            return cast(torch.Tensor, checkpoint(self._forward, x, rope, use_reentrant=False))
        return self._forward(x, rope)

    def _forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        out: torch.Tensor = h + self.moe(self.ffn_norm(h))
        return out


class MoETransformer(nn.Module):
    """Token embedding, ``n_layers`` :class:`MoEBlock` (``layers["0"]``, ...), final norm,
    output head. ``forward(tokens)`` returns logits ``(batch, seq, vocab)``; with
    ``targets``, the mean cross-entropy over the tokens given instead.
    """

    rope: torch.Tensor  # the rotary tables (a non-persistent buffer)

    def __init__(self, cfg: MoEConfig | None = None) -> None:
        super().__init__()
        cfg = MoEConfig() if cfg is None else cfg
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): MoEBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("rope", self._rope(None), persistent=False)
        self.init_weights()

    def _rope(self, device: torch.device | None) -> torch.Tensor:
        cfg = self.cfg
        return rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta, device)

    def blocks(self) -> list[MoEBlock]:
        """The transformer blocks, in order."""
        return [cast(MoEBlock, block) for block in self.layers.values()]

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialize every parameter and buffer in place."""
        if not self.rope.is_meta:
            self.rope.copy_(self._rope(self.rope.device))
        std = 0.02
        depth_std = std / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.tok_embeddings.weight)
        for block in self.blocks():
            attn = block.attention
            for lin in (attn.wq, attn.wk, attn.wv):
                nn.init.trunc_normal_(lin.weight, std=std)
            nn.init.trunc_normal_(attn.wo.weight, std=depth_std)
            # Wider than the other weights so that routing is decisive, not near-uniform.
            nn.init.trunc_normal_(block.moe.router.weight, std=self.cfg.dim**-0.5)
            block.moe.experts.init_weights(std, depth_std)
            block.moe.expert_bias.zero_()
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.output.weight, std=self.cfg.dim**-0.5)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h, self.rope)
        logits: torch.Tensor = self.output(self.norm(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def apply_expert_parallel(model: MoETransformer, ep_mesh: DeviceMesh) -> None:
    """Expert parallelism over the 1D ``ep_mesh``: each block's ``w1``/``w2``/``w3`` become
    ``Shard(0)`` DTensors on it (rank ``r`` of the mesh keeps experts
    ``r * E / ep ... (r + 1) * E / ep - 1``, the same values as the unsharded model's, no
    communication), and the MoE layers dispatch tokens over ``ep_mesh.get_group()``. Call
    it on an unsharded model, before :func:`parallelize_moe`.

    Raises:
        ValueError: ``ep_mesh`` is not 1D, ``num_experts`` is not divisible by its size, or
            the experts are already DTensors.
    """
    if ep_mesh.ndim != 1:
        raise ValueError(f"apply_expert_parallel: ep_mesh must be 1D, got {ep_mesh.ndim} dims")
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for block in model.blocks():
        experts = block.moe.experts
        if experts.num_experts % ep:
            raise ValueError(
                f"apply_expert_parallel: {experts.num_experts} experts do not split over {ep} ranks"
            )
        for name in ("w1", "w2", "w3"):
            full = getattr(experts, name)
            if isinstance(full, DTensor):
                raise ValueError(f"apply_expert_parallel: experts.{name} is already a DTensor")
            local = full.detach().chunk(ep, dim=0)[rank].clone()
            dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(dt, requires_grad=full.requires_grad))
        block.moe.ep_group = ep_mesh.get_group()


def parallelize_moe(
    model: MoETransformer,
    *,
    fully_shard: Callable[..., Any],
    dp_mesh: DeviceMesh,
    efsdp_mesh: DeviceMesh | None = None,
    ep_degree: int = 1,
    placement_result: Callable[[Shard, DeviceMesh], Any] | None = None,
    reshard_after_forward: bool | int = True,
    mp_policy: Any = None,
    ac: bool = False,
) -> MoETransformer:
    """Shard ``model`` with ``fully_shard`` (either engine's) as torchtitan's
    ``apply_fsdp_to_decoder`` does, expert-parallel branch included; returns ``model``.

    Order: ``tok_embeddings``; ``[norm, output]`` as one group; each block; the root. An MoE
    block's experts are sharded ``Shard(0)`` (on the expert dim), or ``Shard(1)`` when the
    expert-FSDP shard size times ``ep_degree`` exceeds ``num_experts``. With ``ep_degree >
    1`` the block's ``shard_placement_fn`` returns ``placement_result(expert placement,
    efsdp_mesh)`` for each expert parameter, ``placement_result(Shard(0), dp_mesh)`` for the
    others: two parameter groups per block, each with its own collectives. Each result is
    built once per mesh and reused (torch's engine wants one mesh-info object per process
    group), and explicit prefetching is set up as torchtitan does. Last,
    ``set_gradient_divide_factor(1.0)`` on every FSDP module (and, on CPU meshes,
    ``set_force_sum_reduction_for_comms(True)``: gloo has no ``PREMUL_SUM``).

    [Note: MoE loss scaling]
    With the divide factor 1, every gradient is a plain sum over ranks: a dense gradient
    over ``dp_mesh``; an expert gradient first over the expert-parallel group by the
    all-to-all's backward (every rank's tokens that reached the expert), then over
    ``efsdp_mesh`` by FSDP: ``efsdp x ep`` ranks are again every data-parallel rank. FSDP's
    default would divide each sum by its group's size: the dense gradients by the dp size,
    the expert gradients by the efsdp size only, ``ep`` times too large. So each rank scales
    its loss instead: backpropagating ``(local mean loss) / dp world size`` makes every
    gradient that of the global batch's mean loss (ranks hold equal token counts).
    torchtitan divides by the global token count for the same reason.

    Args:
        model: the model, with :func:`apply_expert_parallel` applied if ``ep_degree > 1``.
        fully_shard: ``fsdp2.fully_shard`` or torch's FSDP2 ``fully_shard``.
        dp_mesh: the data-parallel mesh of the dense parameters: 1D (FSDP) or 2D (HSDP).
        efsdp_mesh: the mesh the experts are sharded over (FSDP) when ``ep_degree > 1``.
        ep_degree: the expert-parallel degree; 1 shards experts over ``dp_mesh``.
        placement_result: ``(placement, mesh) -> result`` building the engine's
            ``shard_placement_fn`` result; ``fsdp2.ShardPlacementResult`` by default. For
            torch's engine: its ``ShardPlacementResult(placement, mesh_info)``.
        reshard_after_forward: passed to every ``fully_shard`` but the root's.
        mp_policy: the engine's ``MixedPrecisionPolicy``, or ``None`` for its default.
        ac: activation checkpointing around each block (set before sharding).
    """
    if ep_degree > 1 and efsdp_mesh is None:
        raise ValueError("parallelize_moe: ep_degree > 1 needs efsdp_mesh")
    make = placement_result or ShardPlacementResult
    blocks = model.blocks()
    if ac:
        for block in blocks:
            block.activation_checkpoint = True
    kw: dict[str, Any] = {"mesh": dp_mesh}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    fully_shard(model.tok_embeddings, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard([model.norm, model.output], reshard_after_forward=reshard_after_forward, **kw)
    results: dict[tuple[int, int], Any] = {}  # (placement dim, id(mesh)) -> result

    def result(dim: int, mesh: DeviceMesh) -> Any:
        key = (dim, id(mesh))
        if key not in results:
            results[key] = make(Shard(dim), mesh)
        return results[key]

    dense = dp_mesh.size(dp_mesh.ndim - 1)  # shard size (1D FSDP or 2D HSDP: its last dim)
    shards = efsdp_mesh.size(efsdp_mesh.ndim - 1) * ep_degree if efsdp_mesh else dense
    for block in blocks:
        experts = block.moe.experts
        expert_params = set(experts.parameters())
        expert_dim = 1 if shards > experts.num_experts else 0
        fn: Callable[[nn.Parameter], Any] | None = None
        if ep_degree > 1:
            assert efsdp_mesh is not None
            fn = _placement_fn(expert_params, result(expert_dim, efsdp_mesh), result(0, dp_mesh))
        elif expert_dim == 1:
            fn = _placement_fn(expert_params, Shard(1), None)
        fully_shard(block, reshard_after_forward=reshard_after_forward, shard_placement_fn=fn, **kw)
    fully_shard(model, **kw)
    for module in model.modules():
        if callable(getattr(module, "set_gradient_divide_factor", None)):
            cast(Any, module).set_gradient_divide_factor(1.0)
            if dp_mesh.device_type == "cpu":
                # torch's engine reduces with PREMUL_SUM(1 / factor), which gloo lacks; for
                # a factor of 1 a plain sum is the same reduction.
                cast(Any, module).set_force_sum_reduction_for_comms(True)
    if ep_degree > 1:
        _prefetch_like_torchtitan(model, blocks)
    return model


def _placement_fn(
    expert_params: set[nn.Parameter], for_experts: Any, for_others: Any
) -> Callable[[nn.Parameter], Any]:
    return lambda p: for_experts if p in expert_params else for_others


def _prefetch_like_torchtitan(model: MoETransformer, blocks: list[MoEBlock]) -> None:
    """Explicit prefetching (torchtitan sets it up under expert parallelism, whose
    device-to-host syncs would delay FSDP's implicit prefetching): forward, embeddings ->
    block 0 -> ... -> [norm, output]; backward, output -> last block -> ... -> embeddings."""
    chain: list[Any] = [model.tok_embeddings, *blocks]
    for i, unit in enumerate(chain):
        unit.set_modules_to_forward_prefetch(
            [chain[i + 1]] if i + 1 < len(chain) else [model.norm, model.output]
        )
        if i > 0:
            unit.set_modules_to_backward_prefetch([chain[i - 1]])
    cast(Any, model.output).set_modules_to_backward_prefetch([chain[-1]])
