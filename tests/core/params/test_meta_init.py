"""Deferred initialization: build on the meta device, ``fully_shard``, ``to_empty``, re-init;
and module conversions after ``fully_shard`` (``.to(dtype)``, ``.double()``, ``.to(device)``).

For ``tests/models.TinyTransformer`` (tied embedding/head, re-initialized with each module's
``reset_parameters()``) and ``fsdp2.models.Llama`` with a tiny config (``init_weights()``, a
non-persistent rotary buffer; tied and untied), FSDP on 2 and 4 gloo ranks and HSDP (2x2),
with ``fsdp2`` and torch's ``fully_shard`` side by side:

* after ``fully_shard`` on meta, every parameter is a meta DTensor whose local shape is this
  rank's ``torch.chunk``-style dim-0 shard, and sharding allocates no real memory;
* ``to_empty(device="cpu")`` keeps every parameter object (and the tie), leaves nothing on
  meta (buffers included), and each local tensor still has the shard's numel; while it and the
  re-init run, no single allocation exceeds one ``fully_shard`` group's unsharded size (the
  whole model is never materialized on a rank);
* re-init on the sharded DTensors gives sane values (norm weights one, Linear weights within
  the kaiming bound of their global fan-in) equal bitwise to torch's with the same seed, and
  recomputes the rotary buffer (on a CPU mesh DTensor's RNG tracker is off, so every rank
  draws the same numbers for its shard, with either engine: not checked here);
* training: the full parameters are gathered after init and loaded into an unsharded
  reference; 3 AdamW steps match it (loss, full grads, full params) and torch's engine;
* meta init then ``load_state_dict`` of a plain full state dict (fsdp2 only: torch's FSDP2
  does not load plain tensors into DTensor parameters).

Conversions (fsdp2 vs the reference; torch's FSDP2 has no ``.to(dtype)`` after sharding: its
next forward fails with "Expected out tensor to have dtype double, but got float"):
``model.to(torch.float64)`` / ``model.double()`` keep parameter identity and placements, give
float64 DTensors and train like a float64 reference; ``model.to("cpu")`` is a no-op that keeps
parameter identity and the local tensors' storage, for both engines.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from helpers import ENGINES, TOL, WORLD_SIZES, check_close, hsdp_mesh, train_and_compare, world_mesh
from models import TinyTransformer, full_params, shard_model
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fsdp2
from fsdp2.models import Llama, LlamaConfig
from fsdp2.models.llama import rotary_tables

STEPS = 3
PARAM_TOL = {"atol": 5e-5, "rtol": 1e-5}
VOCAB, SEQ, GLOBAL_BATCH = 37, 8, 8


def _llama_config(tied: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        dim=16,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        ffn_multiple_of=12,  # hidden 48: 12 rows per rank on 4 ranks; dim 16 / 37 vocab uneven
        max_seq_len=16,
        tie_embeddings=tied,
    )


MODELS: dict[str, Callable[[], nn.Module]] = {
    "transformer": lambda: TinyTransformer(vocab=VOCAB),
    "llama": lambda: Llama(_llama_config(tied=False)),
    "llama_tied": lambda: Llama(_llama_config(tied=True)),
}
TIES = {
    "transformer": ("head.weight", "tok_emb.weight"),
    "llama_tied": ("output.weight", "tok_embeddings.weight"),
}


@torch.no_grad()
def _reinit(model: nn.Module) -> None:
    """The model's own init on (sharded) parameters: ``init_weights()`` if it has one, else
    every module's ``reset_parameters()``."""
    if hasattr(model, "init_weights"):
        model.init_weights()
        return
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()


def _shard_rows(dim0: int, world_size: int, rank: int) -> int:
    padded = -(-dim0 // world_size)
    start = min(rank * padded, dim0)
    return max(0, min(padded, dim0 - start))


def _expected_local_shape(shape: torch.Size, mesh: DeviceMesh) -> tuple[int, ...]:
    shard_dim = mesh.ndim - 1
    rows = _shard_rows(shape[0], mesh.size(shard_dim), mesh.get_local_rank(shard_dim))
    return (rows, *shape[1:])


def _largest_group_numel(model: nn.Module, ws: int) -> int:
    """The largest unsharded (padded over ``ws`` shards) size of one ``fully_shard`` group of
    ``shard_model``: one per block of ``model.layers``, and the root's remaining parameters."""

    def padded(params: list[nn.Parameter]) -> int:
        return sum(-(-p.shape[0] // ws) * ws * math.prod(p.shape[1:]) for p in params)

    in_layers = {id(p) for p in model.layers.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_layers]  # parameters() dedups ties
    return max([padded(list(b.parameters())) for b in model.layers] + [padded(root)])


class _Allocations(TorchDispatchMode):
    """Records the largest floating-point storage (in elements) any op creates off the meta
    device; outputs that share an input's storage (in-place ops, views) are not new."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {
            _local(t).untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and not t.is_meta
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.is_meta or not t.is_floating_point():
                continue  # integer tensors are mesh and RNG bookkeeping, never parameters
            t = _local(t)
            storage = t.untyped_storage()
            numel = storage.nbytes() // t.element_size()
            if storage.data_ptr() not in inputs and numel > self.largest:
                self.largest, self.op = numel, str(func)
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def _adamw(params: Any) -> torch.optim.Optimizer:
    # Adam's first step moves each weight by about lr * sign(grad): with Llama's small init
    # some gradients are ~1e-8, where fp32 summation-order noise flips the update. An eps
    # above that noise keeps the comparison about sharding, not rounding.
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-6)


def _train_and_compare(ref: nn.Module, models: dict[str, nn.Module], **tol: float) -> None:
    """``helpers.train_and_compare`` with AdamW for STEPS steps: loss, full grads and full
    params against ``ref`` every step, and (with both engines) fsdp2's against torch's
    bitwise, as ``test_parity.py`` does. ``tol`` replaces every tolerance; by default Adam
    divides by sqrt(v): where a gradient is tiny, fp32 reduction-order noise (both engines
    agree bitwise) moves the update, so parameters get more slack (``PARAM_TOL``)."""
    train_and_compare(
        ref,
        models,
        batch=_batch,
        loss=_loss,
        steps=STEPS,
        optimizer=_adamw,
        tol=tol or TOL,
        param_tol=tol or PARAM_TOL,
    )


# ---------------------------------------------------------------------------------------------
# Meta-device init


def _meta_sharded(engine: str, model_name: str, mesh: DeviceMesh) -> nn.Module:
    """``model_name`` built on meta and sharded by ``engine``; checks the meta layout."""
    with torch.device("meta"):
        model = MODELS[model_name]()
    placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
    with _Allocations() as allocs:
        shard_model(model, ENGINES[engine], mesh)
    assert allocs.largest == 0, (
        f"{engine}: fully_shard on a meta model allocated {allocs.largest} elements ({allocs.op})"
    )
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.is_meta, f"{engine}: {name} is {type(p).__name__}"
        assert tuple(p.placements) == placements, f"{engine}: {name} placed {p.placements}"
        want = _expected_local_shape(p.shape, mesh)
        assert tuple(p.to_local().shape) == want, f"{engine}: {name} local {p.to_local().shape}"
    return model


def _check_materialized(engine: str, model: nn.Module, model_name: str, mesh: DeviceMesh) -> None:
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), f"{engine}: {name}"
        assert not p.is_meta and p.device.type == "cpu", f"{engine}: {name} on {p.device}"
        local = p.to_local()
        assert not local.is_meta, f"{engine}: {name}'s local tensor is still on meta"
        want = _expected_local_shape(p.shape, mesh)
        assert tuple(local.shape) == want, f"{engine}: {name} local {tuple(local.shape)}"
        assert local.numel() == math.prod(want), f"{engine}: {name} holds {local.numel()}"
    for name, b in model.named_buffers():
        assert not b.is_meta and b.device.type == "cpu", f"{engine}: buffer {name} on {b.device}"
    if model_name in TIES:
        a, b = TIES[model_name]
        assert model.get_parameter(a) is model.get_parameter(b), f"{engine}: {a} untied from {b}"
        names = [n for n, _ in model.named_parameters()]
        assert a not in names and b in names, f"{engine}: tied parameter listed twice: {names}"


def _check_init_values(engine: str, full: dict[str, torch.Tensor], model_name: str) -> None:
    for name, t in full.items():
        assert torch.isfinite(t).all(), f"{engine}: {name} has non-finite values after init"
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), f"{engine}: {name} is not ones"
        elif name.endswith("norm.bias"):
            assert torch.equal(t, torch.zeros_like(t)), f"{engine}: {name} is not zeros"
        elif model_name == "transformer" and t.dim() == 2 and "emb" not in name:
            # nn.Linear's kaiming bound, from the global fan-in (a DTensor reports global
            # shapes). Whether ranks draw different numbers is DTensor's business: on a CPU
            # mesh its RNG tracker is off and every rank draws the same shard values.
            bound = 1 / math.sqrt(t.shape[1])
            assert t.abs().max() <= bound, f"{engine}: {name} exceeds its init bound {bound}"
            assert t.std() > bound / 4, f"{engine}: {name} is not spread like uniform(-b, b)"


def _meta_init_parity(model_name: str, mesh_kind: str) -> None:
    """``mesh_kind``: ``fsdp`` (1D over every rank) or ``hsdp`` (replicate 2, shard world / 2)."""
    ws = dist.get_world_size()
    mesh = world_mesh() if mesh_kind == "fsdp" else hsdp_mesh((2, ws // 2))
    models: dict[str, nn.Module] = {}
    inits: dict[str, dict[str, torch.Tensor]] = {}
    for engine in ENGINES:
        model = _meta_sharded(engine, model_name, mesh)
        params = list(model.parameters())
        bound = _largest_group_numel(model, mesh.size(mesh.ndim - 1))
        with _Allocations() as allocs:
            model.to_empty(device="cpu")
            torch.manual_seed(0)
            _reinit(model)
        assert allocs.largest <= bound, (
            f"{engine}: to_empty + init allocated {allocs.largest} elements at once "
            f"({allocs.op}), more than the largest group's unsharded size {bound}"
        )
        after = list(model.parameters())
        assert len(after) == len(params) and all(
            p is q for p, q in zip(params, after, strict=True)
        ), f"{engine}: to_empty replaced parameter objects"
        _check_materialized(engine, model, model_name, mesh)
        inits[engine] = full_params(model)
        _check_init_values(engine, inits[engine], model_name)
        if isinstance(model, Llama):
            cfg = model.cfg
            want = rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
            check_close(model.rope, want, f"{engine}: rope", rtol=0, atol=0)
        models[engine] = model
    for name, want in inits["torch"].items():
        assert torch.equal(inits["fsdp2"][name], want), (
            f"{name}: fsdp2's re-init differs from torch's with the same seed"
        )
    ref = MODELS[model_name]()
    result = ref.load_state_dict(inits["fsdp2"], strict=False)  # named_parameters lists a tie once
    assert not result.unexpected_keys and set(result.missing_keys) <= set(
        TIES.get(model_name, ())
    ), result
    _train_and_compare(ref, models)


def _meta_cases() -> list:
    cases = [
        pytest.param(ws, name, "fsdp", id=f"ws{ws}-{name}-fsdp")
        for ws in WORLD_SIZES
        for name in MODELS
    ]
    cases += [pytest.param(4, name, "hsdp", id=f"ws4-{name}-hsdp") for name in MODELS]
    return cases


@pytest.mark.parametrize("world_size, model_name, mesh_kind", _meta_cases())
def test_meta_init_to_empty_reinit_and_train(
    world_size: int, model_name: str, mesh_kind: str
) -> None:
    run_on_ranks(world_size, _meta_init_parity, model_name, mesh_kind)


def _meta_then_load_full(model_name: str) -> None:
    mesh = world_mesh()
    model = _meta_sharded("fsdp2", model_name, mesh)
    params = list(model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    ref = MODELS[model_name]()  # a plain checkpoint, identical on every rank
    result = model.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys, result
    assert all(p is q for p, q in zip(params, model.parameters(), strict=True)), (
        "load replaced parameters"
    )
    _check_materialized("fsdp2", model, model_name, mesh)
    if isinstance(model, Llama):  # not in the state dict: init_weights recomputes it
        with torch.no_grad():
            cfg = model.cfg
            model.rope.copy_(rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta))
    for name, full in full_params(model).items():
        check_close(full, ref.get_parameter(name).detach(), f"loaded {name}", rtol=0, atol=0)
    _train_and_compare(ref, {"fsdp2": model})


@pytest.mark.parametrize("model_name", ["transformer", "llama_tied"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_meta_init_then_load_full_state_dict(world_size: int, model_name: str) -> None:
    run_on_ranks(world_size, _meta_then_load_full, model_name)


# ---------------------------------------------------------------------------------------------
# Conversions after fully_shard


def _layout(model: nn.Module) -> list[tuple[str, int, Any, tuple[int, ...]]]:
    return [
        (n, id(p), tuple(p.placements), tuple(p.to_local().shape))
        for n, p in model.named_parameters()
    ]


def _dtype_conversion(how: str) -> None:
    torch.manual_seed(0)
    ref = TinyTransformer(vocab=VOCAB)
    torch.manual_seed(0)
    model = shard_model(TinyTransformer(vocab=VOCAB), fsdp2.fully_shard, world_mesh())
    before = _layout(model)
    if how == "to_float64":
        model.to(torch.float64)
    else:
        model.double()
    ref.double()
    assert _layout(model) == before, "the conversion changed parameter identity or layout"
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.dtype == torch.float64, f"{name}: {p.dtype}"
        assert p.to_local().dtype == torch.float64, f"{name}: local {p.to_local().dtype}"
    assert model.head.weight is model.tok_emb.weight, "the conversion untied the weights"
    for name, full in full_params(model).items():
        check_close(full, ref.get_parameter(name).detach(), f"converted {name}", rtol=0, atol=0)
    # Steps after the first read what the optimizer wrote into the converted shards.
    _train_and_compare(ref, {"fsdp2": model}, atol=1e-10, rtol=1e-10)
    for name, p in model.named_parameters():
        assert p.grad is None or p.grad.dtype == torch.float64, f"{name}: grad {p.grad.dtype}"


@pytest.mark.parametrize("how", ["to_float64", "double"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dtype_conversion_after_fully_shard(world_size: int, how: str) -> None:
    run_on_ranks(world_size, _dtype_conversion, how)


def _same_device_noop() -> None:
    torch.manual_seed(0)
    ref = TinyTransformer(vocab=VOCAB)
    models = {}
    for engine, fn in ENGINES.items():
        torch.manual_seed(0)
        model = shard_model(TinyTransformer(vocab=VOCAB), fn, world_mesh())
        before = _layout(model)
        ptrs = [p.to_local().data_ptr() for p in model.parameters()]
        assert model.to("cpu") is model
        model.to(torch.device("cpu"), torch.float32)
        assert _layout(model) == before, f"{engine}: .to('cpu') changed parameters"
        after = [p.to_local().data_ptr() for p in model.parameters()]
        assert after == ptrs, f"{engine}: .to('cpu') copied the local shards"
        models[engine] = model
    _train_and_compare(ref, models)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_to_same_device_is_noop(world_size: int) -> None:
    run_on_ranks(world_size, _same_device_noop)
