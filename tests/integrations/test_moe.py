"""Mixture-of-experts with expert parallelism (EP) and per-parameter meshes, on 4 gloo ranks.

``fsdp2.models.MoETransformer`` (2 blocks, each attention + an MoE layer of 4 experts, top-2)
gets its experts split over ``mesh["ep"]`` (``apply_expert_parallel``: ``Shard(0)`` DTensors,
tokens exchanged with autograd-aware all-to-alls) and is sharded as torchtitan's
``apply_fsdp_to_decoder`` does (``parallelize_moe``): each block in one ``fully_shard`` call
whose ``shard_placement_fn`` puts the experts on the expert-FSDP mesh ``mesh["efsdp"]`` and
every other parameter on the dense data-parallel mesh, so one call holds two parameter groups
on two meshes. The mesh is ``(efsdp, ep) = (2, 2)``; the dense mesh is its flattening
``"dp"`` (all 4 ranks), or for HSDP the 2D mesh itself named ``(dp_replicate, dp_shard)``
(experts: efsdp = dim 0, ep = dim 1). Gradient division is off (``set_gradient_divide_factor
(1.0)``, as torchtitan) and each rank backpropagates its mean loss / 4 (see [Note: MoE loss
scaling] in ``fsdp2/models/moe.py``).

Each rank trains on its slice of a global batch; a replicated reference (no EP, unsharded,
same init) trains on the whole batch. Unless said otherwise a case checks every step the
rank-averaged loss, the full gradients (``.full_tensor()``) and, after the optimizer step,
the full parameters against the reference with fp32 tolerance (``helpers.TOL``), and, in the
fsdp2 cases, fsdp2 against torch's ``fully_shard`` trained in the same worker: bitwise (the
model code, the all-to-alls and the fp32 sums of 2 or 4 ranks are the same floats;
``helpers.train_and_compare``). Each case's ``torch`` parametrization (torch's engine alone)
is marked ``long`` (``make test-long``): the ``fsdp2`` case trains torch's engine too, against
the same reference with the same checks. Cases:

1. EP + FSDP, experts ``Shard(0)`` (4 experts: ``(_StridedShard(0), Shard(0))`` on
   ``(efsdp, ep)``) and ``Shard(1)`` (2 experts, fewer than ``efsdp * ep`` shards:
   ``(Shard(1), Shard(0))``), ``reshard_after_forward`` True, False and 2 (torch accepts 2:
   it divides the dense shard size 4 and equals the experts' 2, i.e. True there), 2 AdamW
   steps; the sharded layout (meshes, placements, local shapes) is checked too.
2. bf16 compute, fp32 reduction (``MixedPrecisionPolicy``), 2 SGD steps (see ``_bf16``):
   against the fp32 reference within bf16 tolerances scaled to each tensor (``BF16_*``);
   fsdp2 against torch bitwise.
3. Activation checkpointing around each block: every MoE layer (its all-to-alls included)
   runs again in backward.
4. HSDP dense parameters (replicate 2 x shard 2), experts FSDP over the replicate dim.
5. Experts without tokens: ``expert_bias`` makes expert 3 unreachable and expert 2 rare, so
   some ranks route no token to an expert others use, and some rank receives no token at all
   in some layer (asserted). Every local expert still takes part in the graph (an empty
   matmul: a zero gradient, never ``None``), so the collectives match without
   ``set_reduce_scatter_unused_params``.
6. ``fsdp2.clip_grad_norm_`` over dense gradients on ``"dp"`` and expert gradients on
   ``(efsdp, ep)`` in one call (2 AdamW steps, clipping every step): the total norm equals
   the reference's ``torch.nn.utils.clip_grad_norm_``, the clipped gradients and parameters
   match; torch's own function raises on the sharded model (its norms live on two meshes).
7. DCP: model + AdamW state (``get_state_dict``, ``dcp.save``) saved from the EP + FSDP
   layout, loaded into plain FSDP over 4 ranks without EP (experts ``Shard(0)`` on the
   dense mesh; fsdp2 case: each engine's checkpoint into each engine): exact full parameters
   and optimizer state, then 2 more steps match the reference.
8. fsdp2 only: ``fsdp2.checkpoint.save_full_checkpoint`` of the EP + FSDP model (sharded
   safetensors files + index) loads back exactly into an unsharded model and into a fresh
   EP + FSDP model, which trains on like the reference.
9. torchtitan's EP branch as it is, only the ``fully_shard`` import swapped: torch's own
   ``ShardPlacementResult`` objects built with ``_get_mesh_info(mesh, None)`` handed to
   ``fsdp2.fully_shard`` (and to torch's, which is what torchtitan runs).

Where torch needs help: gloo has no ``PREMUL_SUM``, which torch reduces with for a divide
factor of 1, so ``parallelize_moe`` also sets ``set_force_sum_reduction_for_comms(True)`` on
CPU meshes (the same sum). torch before 2.13 has no per-parameter meshes: the file is skipped.

"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from _harness import run_on_ranks
from helpers import ENGINES, check_close, check_same, mine, train_and_compare
from models import full_grads, full_params, make_optimizer, mean_over_ranks
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
from torch.distributed.tensor import DTensor, Shard

import fsdp2
from fsdp2.checkpoint import load_full_checkpoint, save_full_checkpoint
from fsdp2.models import MoEConfig, MoETransformer, apply_expert_parallel, parallelize_moe

try:  # torch 2.13+
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        ShardPlacementResult as TorchShardPlacementResult,
    )
except ImportError:
    pytest.skip("torch's fully_shard has no per-parameter meshes", allow_module_level=True)

WORLD_SIZE = 4
STEPS = 2  # the second step runs on the optimizer state of the first
GLOBAL_BATCH, SEQ = 8, 8  # 2 sequences (16 tokens) per rank
VOCAB = MoEConfig().vocab_size
# torch alone is a subset of the fsdp2 case (which trains both engines): outside the main suite.
ENGINE_PARAMS = ["fsdp2", pytest.param("torch", marks=pytest.mark.long)]
_MP = {"fsdp2": fsdp2.MixedPrecisionPolicy, "torch": TorchMixedPrecisionPolicy}


# ---------------------------------------------------------------------------------------------
# Running a case: the fsdp2 cases also train torch's engine, unless fsdp2 cannot shard


def _run(fn: Callable[..., Any], *args: Any) -> list[Any]:
    return run_on_ranks(WORLD_SIZE, fn, *args)


def _shard_all(
    engine: str, make: Callable[[str], nn.Module], *, with_torch: bool = True
) -> dict[str, nn.Module]:
    """``{e: make(e)}`` for ``engine`` and, for fsdp2 ``with_torch``, torch's engine too (to
    compare them in the same worker), fsdp2 first."""
    engines = ("fsdp2", "torch") if engine == "fsdp2" and with_torch else (engine,)
    return {e: make(e) for e in engines}


# ---------------------------------------------------------------------------------------------
# Meshes, models, data


class Meshes(NamedTuple):
    dp: DeviceMesh  # the dense parameters' mesh (1D, or 2D for HSDP)
    efsdp: DeviceMesh | None  # the experts' FSDP mesh (with EP)
    ep: DeviceMesh | None  # the experts' DTensor mesh (with EP)


def _meshes(kind: str) -> Meshes:
    if kind == "ep":  # dense FSDP over all 4 ranks, experts (efsdp, ep) = (2, 2)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
        return Meshes(mesh._flatten("dp"), mesh["efsdp"], mesh["ep"])
    if kind == "hsdp":  # dense HSDP (replicate 2 x shard 2); experts efsdp = dim 0, ep = dim 1
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        return Meshes(mesh, mesh["dp_replicate"], mesh["dp_shard"])
    assert kind == "fsdp", kind  # no EP: everything FSDP over all 4 ranks
    return Meshes(init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("dp",)), None, None)


def _torch_results() -> Callable[[Shard, DeviceMesh], Any]:
    """torch's ``ShardPlacementResult`` builder: one mesh-info object per mesh (torch
    refuses two objects for one process group in a ``fully_shard`` call)."""
    infos: dict[int, FSDPMeshInfo] = {}

    def make(placement: Shard, mesh: DeviceMesh) -> Any:
        if id(mesh) not in infos:
            infos[id(mesh)] = (
                FSDPMeshInfo(mesh, shard_mesh_dim=0)
                if mesh.ndim == 1
                else HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
            )
        return TorchShardPlacementResult(placement=placement, mesh_info=infos[id(mesh)])

    return make


def _torchtitan_results() -> Callable[[Shard, DeviceMesh], Any]:
    """The objects torchtitan's ``apply_fsdp_to_decoder`` builds (``edp_mesh_dims`` and
    ``dp_mesh_dims`` are ``None`` outside spmd_types), one per mesh."""
    infos: dict[int, Any] = {}

    def make(placement: Shard, mesh: DeviceMesh) -> Any:
        if id(mesh) not in infos:
            infos[id(mesh)] = _get_mesh_info(mesh, None)
        return TorchShardPlacementResult(placement=placement, mesh_info=infos[id(mesh)])

    return make


def _results(engine: str) -> Callable[[Shard, DeviceMesh], Any]:
    if engine == "fsdp2":
        return lambda placement, mesh: fsdp2.ShardPlacementResult(placement, mesh)
    return _torch_results()


def _build(cfg: MoEConfig, seed: int = 0) -> MoETransformer:
    torch.manual_seed(seed)
    return MoETransformer(cfg)


def _sharded(
    engine: str,
    meshes: Meshes,
    cfg: MoEConfig,
    *,
    seed: int = 0,
    prepare: Callable[[MoETransformer], None] | None = None,
    results: Callable[[], Callable[[Shard, DeviceMesh], Any]] | None = None,
    mp: dict[str, Any] | None = None,
    **kw: Any,
) -> MoETransformer:
    """``_build(cfg, seed)``, ``prepare``d, expert-parallel on ``meshes.ep`` (if any), then
    ``parallelize_moe`` with ``engine``'s ``fully_shard`` and ``kw``."""
    model = _build(cfg, seed)
    if prepare is not None:
        prepare(model)
    ep_degree = 1
    if meshes.ep is not None:
        apply_expert_parallel(model, meshes.ep)
        ep_degree = meshes.ep.size()
    return parallelize_moe(
        model,
        fully_shard=ENGINES[engine],
        dp_mesh=meshes.dp,
        efsdp_mesh=meshes.efsdp,
        ep_degree=ep_degree,
        placement_result=(results or (lambda: _results(engine)))(),
        mp_policy=None if mp is None else _MP[engine](**mp),
        **kw,
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _forward_backward(ref: nn.Module) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], Any]:
    """The reference backpropagates its mean loss, a sharded model its mean loss / the
    data-parallel size (divide factor 1). Returns the unscaled loss."""

    def run(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        (loss if model is ref else loss / dist.get_world_size()).backward()
        return loss

    return run


def _train(ref: nn.Module, models: dict[str, nn.Module], steps: int = STEPS, **kw: Any) -> None:
    train_and_compare(
        ref, models, batch=_batch, forward_backward=_forward_backward(ref), steps=steps, **kw
    )


def _layout(model: nn.Module) -> dict[str, tuple[Any, str, tuple[int, ...]]]:
    """name -> (mesh dim names, placements as text, local shape)."""
    return {
        n: (p.device_mesh.mesh_dim_names, repr(tuple(p.placements)), tuple(p.to_local().shape))
        for n, p in model.named_parameters()
    }


def _check_layout(models: dict[str, nn.Module], meshes: Meshes, cfg: MoEConfig) -> None:
    """Experts on ``(efsdp, ep)``: ``_StridedShard(0)`` / ``Shard(1)`` on efsdp and ``Shard(0)``
    on ep; the rest on the dense mesh, ``Shard(0)`` on its shard dim; fsdp2's as torch's."""
    assert meshes.efsdp is not None and meshes.ep is not None
    expert_dims = (*meshes.efsdp.mesh_dim_names, *meshes.ep.mesh_dim_names)
    per_rank = cfg.num_experts // meshes.ep.size()
    for key, model in models.items():
        for name, (dims, placements, local) in _layout(model).items():
            what = f"{key} {name}: {dims} {placements} {local}"
            if ".experts." not in name:  # Shard(0) on the dense mesh's shard dim
                assert dims == meshes.dp.mesh_dim_names, what
                want = "(Replicate(), Shard(dim=0))" if meshes.dp.ndim == 2 else "(Shard(dim=0),)"
                assert placements == want, what
                continue
            assert dims == expert_dims, what
            if per_rank > 1:  # 2 local experts over efsdp 2: one each
                assert placements == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", what
                assert local[0] == 1, what
            else:  # 1 local expert, its dim 1 over efsdp
                assert placements == "(Shard(dim=1), Shard(dim=0))", what
                full = model.get_parameter(name).shape
                assert local == (1, full[1] // 2, full[2]), what
    if len(models) == 2:
        assert _layout(models["fsdp2"]) == _layout(models["torch"]), "layouts differ"


# ---------------------------------------------------------------------------------------------
# 1. EP + FSDP training parity


def _ep_fsdp(engine: str, num_experts: int) -> None:
    meshes = _meshes("ep")
    cfg = MoEConfig(num_experts=num_experts)
    for reshard in (True, False, 2):
        models = _shard_all(
            engine, lambda e, r=reshard: _sharded(e, meshes, cfg, reshard_after_forward=r)
        )
        _check_layout(models, meshes, cfg)
        _train(_build(cfg), models, check_init=True)


@pytest.mark.parametrize("num_experts", [4, 2], ids=["experts_shard0", "experts_shard1"])
@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_ep_fsdp_training(engine: str, num_experts: int) -> None:
    """reshard_after_forward True / False / 2 in one worker."""
    _run(_ep_fsdp, engine, num_experts)


# ---------------------------------------------------------------------------------------------
# 2-4. Mixed precision, activation checkpointing, HSDP dense parameters


# bf16 against the fp32 reference: the loss within 2e-3 relative (seen: 2e-4); each full
# gradient within 4% of its largest element (seen: 1.5%, on small norm gradients); each
# parameter within 4% of the reference's largest update so far (seen: 1%), plus a few
# fp32 ulps (a norm weight near 1 moves by less than its ulp).
BF16_LOSS_RTOL = 2e-3
BF16_GRAD_FRAC = 4e-2
BF16_UPDATE_FRAC = 4e-2
_FP32_EPS = torch.finfo(torch.float32).eps


def _check_scaled(got: torch.Tensor, want: torch.Tensor, bound: float, what: str) -> None:
    err = (got - want).abs().max().item()
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def _bf16(engine: str) -> None:
    # SGD, not AdamW: AdamW's first update is about lr * sign(g), so a near-zero gradient
    # whose sign bf16 rounding flips moves a weight by 2 * lr, which no tolerance separates
    # from a bug; SGD's update is lr * g, as close as the gradients.
    meshes = _meshes("ep")
    cfg = MoEConfig()
    mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    models = _shard_all(engine, lambda e: _sharded(e, meshes, cfg, mp=mp))
    computed_in: set[tuple[torch.dtype, ...]] = set()  # (expert weight, its local, tokens)

    def record(experts: nn.Module, args: tuple[Any, ...]) -> None:
        computed_in.add((experts.w1.dtype, experts.w1.to_local().dtype, args[0].dtype))

    for model in models.values():
        model.blocks()[0].moe.experts.register_forward_pre_hook(record)
    ref = _build(cfg)
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    run = _forward_backward(ref)
    opts = [make_optimizer("sgd", m.parameters()) for m in (ref, *models.values())]
    for step in range(STEPS):
        x, y = _batch(step)
        ref_loss = run(ref, x, y).detach()
        seen: dict[str, dict[str, torch.Tensor | None]] = {}
        for key, model in models.items():
            loss = run(model, mine(x), mine(y)).detach()
            what = f"{key} step {step}"
            bound = BF16_LOSS_RTOL * ref_loss.item()
            _check_scaled(mean_over_ranks(loss), ref_loss, bound, f"{what} loss")
            seen[key] = {"loss": loss}
            for name, grad in full_grads(model).items():
                want = ref.get_parameter(name).grad
                assert grad is not None and want is not None, f"{what}: {name} has no gradient"
                bound = BF16_GRAD_FRAC * want.abs().max().item()
                _check_scaled(grad, want, bound, f"{what} grad of {name}")
                seen[key][f"grad of {name}"] = grad
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for key, model in models.items():
            for name, full in full_params(model).items():
                want = ref.get_parameter(name).detach()
                bound = BF16_UPDATE_FRAC * (want - init[name]).abs().max().item()
                bound += 4 * _FP32_EPS * want.abs().max().item()  # updates below fp32's ulp
                _check_scaled(full, want, bound, f"{key} step {step} param {name}")
                seen[key][f"param {name}"] = full
        if len(models) == 2:
            check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch", bitwise=True)
    assert computed_in == {(torch.bfloat16,) * 3}, computed_in


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_ep_fsdp_bf16(engine: str) -> None:
    _run(_bf16, engine)


def _activation_checkpointing(engine: str) -> None:
    meshes = _meshes("ep")
    cfg = MoEConfig()
    models = _shard_all(engine, lambda e: _sharded(e, meshes, cfg, ac=True))
    calls = dict.fromkeys(models, 0)  # MoE forwards: each runs again in backward
    for key, model in models.items():
        assert all(b.activation_checkpoint for b in model.blocks()), key
        for block in model.blocks():
            block.moe.register_forward_pre_hook(lambda *_, k=key: calls.update({k: calls[k] + 1}))
    _train(_build(cfg), models)
    assert calls == dict.fromkeys(models, 2 * cfg.n_layers * STEPS), calls


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_ep_fsdp_activation_checkpointing(engine: str) -> None:
    _run(_activation_checkpointing, engine)


def _hsdp(engine: str) -> None:
    meshes = _meshes("hsdp")
    cfg = MoEConfig()
    models = _shard_all(engine, lambda e: _sharded(e, meshes, cfg))
    _check_layout(models, meshes, cfg)
    _train(_build(cfg), models)


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_hsdp_dense_with_ep_experts(engine: str) -> None:
    _run(_hsdp, engine)


# ---------------------------------------------------------------------------------------------
# 5. Experts that receive no tokens


# Expert 3 is never chosen (a softmax score minus 1 is below any other score); expert 2 only
# where its score beats the second best by more than 0.5: a token or two per rank, or none.
_EXPERT_BIAS = [0.0, 0.0, -0.5, -1.0]


def _bias_router(model: MoETransformer) -> None:
    for block in model.blocks():
        block.moe.expert_bias.copy_(torch.tensor(_EXPERT_BIAS))


def _zero_tokens(engine: str) -> None:
    meshes = _meshes("ep")
    cfg = MoEConfig()
    ref = _build(cfg)
    _bias_router(ref)
    models = _shard_all(engine, lambda e: _sharded(e, meshes, cfg, prepare=_bias_router))
    sent: list[list[list[int]]] = []  # [forward][block][expert]: tokens this rank routed
    base = _forward_backward(ref)

    def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = base(model, x, y)
        if model is next(iter(models.values())):
            sent.append([block.moe.tokens_per_expert.tolist() for block in model.blocks()])
        return loss

    # check_grads: every expert's full gradient (zeros for expert 3) matches the reference's,
    # none is None. SGD: with this routing a gradient of ~2e-8 (AdamW's eps) comes out of a
    # sum of ~1e-3 terms, and AdamW's update of it differs by 1e-5 between sum orders.
    train_and_compare(
        ref,
        models,
        batch=_batch,
        forward_backward=forward_backward,
        steps=STEPS,
        optimizer=lambda ps: make_optimizer("sgd", ps),
    )
    gathered: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, sent)
    counts = torch.tensor(gathered)  # (rank, step, block, expert)
    assert counts[..., 3].sum() == 0, "expert 3 got tokens"
    from_some = (counts[..., 2] > 0).any(0) & (counts[..., 2] == 0).any(0)
    assert from_some.any(), f"expert 2 gets tokens from every rank or from none: {counts}"
    # mesh [[0, 1], [2, 3]]: ranks 1 and 3 hold experts 2 and 3 of EP groups {0, 1}, {2, 3}
    received = torch.stack([counts[0:2, ..., 2:].sum((0, -1)), counts[2:4, ..., 2:].sum((0, -1))])
    assert (received == 0).any(), f"every rank received tokens every time: {counts}"
    assert (received > 0).any(), f"experts 2 and 3 never got tokens: {counts}"


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_experts_without_tokens(engine: str) -> None:
    _run(_zero_tokens, engine)


# ---------------------------------------------------------------------------------------------
# 6. Gradient clipping over two meshes

MAX_NORM = 0.2  # below every total norm seen here, so clipping scales


def _clip(engine: str) -> None:
    meshes = _meshes("ep")
    cfg = MoEConfig()
    ref = _build(cfg)
    models = _shard_all(engine, lambda e: _sharded(e, meshes, cfg))
    norms: dict[str, list[torch.Tensor]] = {"ref": [], **{key: [] for key in models}}
    base = _forward_backward(ref)

    def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = base(model, x, y)
        if model is ref:
            norms["ref"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
            return loss
        key = next(k for k, m in models.items() if m is model)
        meshes_seen = {p.grad.device_mesh.mesh_dim_names for p in model.parameters()}
        assert meshes_seen == {("dp",), ("efsdp", "ep")}, meshes_seen
        with pytest.raises(RuntimeError, match="same mesh|different mesh"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        norms[key].append(fsdp2.clip_grad_norm_(model.parameters(), MAX_NORM))
        return loss

    # train_and_compare checks the clipped gradients and the updated parameters.
    train_and_compare(ref, models, batch=_batch, forward_backward=forward_backward, steps=2)
    want = torch.stack(norms["ref"])
    assert (want > MAX_NORM).all(), f"no clipping: total norms {want}"
    for key in models:
        got = torch.stack(norms[key])
        assert not isinstance(got, DTensor)
        check_close(got, want, f"{key} total norms")
    if len(models) == 2:
        assert torch.equal(torch.stack(norms["fsdp2"]), torch.stack(norms["torch"]))


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_clip_grad_norm_over_two_meshes(engine: str) -> None:
    _run(_clip, engine)


# ---------------------------------------------------------------------------------------------
# 7. DCP: EP + FSDP checkpoint into plain FSDP


def _full_optim_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        for key, value in sorted(opt.state[p].items()):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            out[f"{key} of {name}"] = full.detach().clone()
    return out


def _continue(
    ref: nn.Module,
    ref_opt: torch.optim.Optimizer,
    models: dict[str, tuple[nn.Module, torch.optim.Optimizer]],
    steps: range,
) -> None:
    """Train ``ref`` and ``models`` (with their own optimizers) on steps ``steps``: losses
    and full parameters against the reference."""
    run = _forward_backward(ref)
    for step in steps:
        x, y = _batch(step)
        ref_loss = run(ref, x, y).detach()
        for key, (model, _) in models.items():
            loss = run(model, mine(x), mine(y))
            check_close(mean_over_ranks(loss), ref_loss, f"{key} step {step} loss")
        for opt in (ref_opt, *(o for _, o in models.values())):
            opt.step()
            opt.zero_grad()
        want = dict(ref.named_parameters())
        for key, (model, _) in models.items():
            for name, full in full_params(model).items():
                check_close(full, want[name].detach(), f"{key} step {step} param {name}")


def _dcp(engine: str, root: str) -> None:
    meshes = _meshes("ep")
    cfg = MoEConfig()
    ref = _build(cfg)
    models = _shard_all(engine, lambda e: _sharded(e, meshes, cfg))
    opts: list[torch.optim.Optimizer] = []

    def optimizer(params: Any) -> torch.optim.Optimizer:
        opts.append(make_optimizer("adamw", params))
        return opts[-1]

    _train(ref, models, steps=2, optimizer=optimizer)
    ref_opt, saved = opts[0], {}
    for (key, model), opt in zip(models.items(), opts[1:], strict=True):
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, key))
        saved[key] = {**full_params(model), **_full_optim_state(model, opt)}
    plain = _meshes("fsdp")
    loaded: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    for saver in models:
        for loader in models:
            what = f"{saver} EP checkpoint -> {loader} FSDP(4)"
            model = _sharded(loader, plain, cfg, seed=3)  # an init that differs from the saved
            opt = make_optimizer("adamw", model.parameters())
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=os.path.join(root, saver))
            set_state_dict(
                model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
            got = {**full_params(model), **_full_optim_state(model, opt)}
            assert got.keys() == saved[saver].keys(), what
            for key, want in saved[saver].items():
                assert torch.equal(got[key], want), f"{what}: {key} differs"
            loaded[what] = (model, opt)
    _continue(ref, ref_opt, loaded, range(2, 4))


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_dcp_ep_checkpoint_into_plain_fsdp(engine: str, tmp_path: Any) -> None:
    _run(_dcp, engine, str(tmp_path))


# ---------------------------------------------------------------------------------------------
# 8. fsdp2's full (safetensors) checkpoint


def _full_checkpoint(engine: str, path: str) -> None:
    meshes = _meshes("ep")
    cfg = MoEConfig()
    ref = _build(cfg)
    model = _shard_all(engine, lambda e: _sharded(e, meshes, cfg), with_torch=False)[engine]
    _train(ref, {engine: model}, steps=1)
    files = save_full_checkpoint(model, path, max_shard_size="40KB")
    want = full_params(model)
    index = os.path.join(path, "model.safetensors.index.json")
    assert files[-1] == index and len(files) > 2, files
    with open(index) as f:
        assert set(json.load(f)["weight_map"]) >= set(want), "names missing from the index"
    plain = _build(cfg, seed=3)
    result = load_full_checkpoint(plain, path)
    assert not result.missing_keys and not result.unexpected_keys, result
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), want[name]), f"unsharded load: {name}"
    fresh = _sharded(engine, meshes, cfg, seed=3)
    load_full_checkpoint(fresh, path)
    got = full_params(fresh)
    for name, full in want.items():
        assert torch.equal(got[name], full), f"EP + FSDP load: {name}"
    # The loaded model trains on like the reference, with a fresh SGD on both sides: a fresh
    # AdamW's first step divides each gradient by its own magnitude, so an expert weight
    # whose gradient is near zero (few tokens) turned the reference's other summation order
    # into a visible update difference on some CPUs (AVX2: 5.9e-5 against atol 1e-5).
    _continue(
        ref,
        make_optimizer("sgd", ref.parameters()),
        {"loaded": (fresh, make_optimizer("sgd", fresh.parameters()))},
        range(1, 3),
    )


@pytest.mark.parametrize("engine", ["fsdp2"])
def test_full_checkpoint_round_trip(engine: str, tmp_path: Any) -> None:
    """fsdp2 only: ``fsdp2.checkpoint`` reads and writes fsdp2's sharded models."""
    _run(_full_checkpoint, engine, str(tmp_path))


# ---------------------------------------------------------------------------------------------
# 9. torchtitan's objects, fsdp2's fully_shard


def _torchtitan_objects(engine: str) -> None:
    meshes = _meshes("ep")
    cfg = MoEConfig()
    models = _shard_all(engine, lambda e: _sharded(e, meshes, cfg, results=_torchtitan_results))
    _check_layout(models, meshes, cfg)
    _train(_build(cfg), models, steps=2)


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_torchtitan_placement_results(engine: str) -> None:
    """torchtitan's apply_fsdp EP branch works with only the fully_shard import swapped:
    torch's ``ShardPlacementResult(placement, _get_mesh_info(mesh, None))`` objects."""
    _run(_torchtitan_objects, engine)
