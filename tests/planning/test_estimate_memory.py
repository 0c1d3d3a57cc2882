"""``fsdp2.estimate_memory``: a training step simulated on fake tensors over a fake process
group, its peak against the measured one, and what a planning user relies on.

* Accuracy: the estimate is within 10% of the peak measured on real gloo ranks with the
  benchmarks' sampler (``benchmarks/_memory.py``: persistent state + the C heap's
  high-water mark during the step) for an MLP stack (fp32 and bf16, ``reshard_after_forward``
  True / False / 2, activation checkpointing, 2 and 4 ranks, HSDP 2x2; bf16 on 2 ranks in
  the long suite), a small Llama and a transformers ``LlamaForCausalLM`` (dict batch,
  ``.loss``, blocks found by default).
  The larger table is ``benchmarks/estimate.py`` (docs/benchmarks.md).
* Planning: a world size larger than the machine's processes, a model too big for this
  machine (nothing is allocated), the parts add up to the peak, the alternatives
  (``reshard_after_forward``), optimizers' state sizes, ``shard_over_replicas`` (gradients
  and optimizer state in pieces over HSDP's replicas), a ``build(mesh)`` function, the
  printed table, and the process group and engine watchers put back afterwards; a frozen
  subclass weight using an unsharded view of its own storage counts no unsharded bytes.
* Errors: an already sharded model, a bad mesh shape, an unknown optimizer, an output
  that is no loss, a real process group already initialized.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.two_tensor import TwoTensor

import fsdp2
from fsdp2._core.support.observe import HUB
from fsdp2.models import Llama, LlamaConfig
from fsdp2.planning.estimate import PARTS

_BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
sys.path.insert(0, _BENCHMARKS)
from _memory import peak_step_bytes  # noqa: E402
from estimate import MLP  # noqa: E402  (the benchmark's MLP stack)

MiB = 2**20
DIM, BATCH = 512, 256
LLAMA = LlamaConfig(vocab_size=128, dim=128, n_layers=2, n_heads=4, max_seq_len=128)


def _build(kind: str, ac: bool) -> nn.Module:
    model: nn.Module = MLP(DIM, layers=4) if kind == "mlp" else Llama(LLAMA)
    if ac:
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    return model


def _batch(kind: str, device: str | None = None) -> tuple[torch.Tensor, ...]:
    if kind == "mlp":
        return (torch.randn(BATCH, DIM, device=device),)
    tok = torch.randint(0, LLAMA.vocab_size, (4, LLAMA.max_seq_len), device=device)
    return tok, tok


def _mp(bf16: bool) -> fsdp2.MixedPrecisionPolicy:
    if bf16:
        return fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return fsdp2.MixedPrecisionPolicy()


def _step(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(*batch)


def _measure(
    kind: str, mesh_shape: tuple[int, ...], reshard: bool | int, bf16: bool, ac: bool
) -> int:
    torch.manual_seed(0)
    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = _build(kind, ac)
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=_mp(bf16))
    fsdp2.fully_shard(model, mesh=mesh, mp_policy=_mp(bf16))
    return _measured_peak(model, lambda: _step(model, _batch(kind)))


def _measured_peak(model: nn.Module, loss: Callable[[], torch.Tensor]) -> int:
    """This rank's peak of a steady-state step (AdamW, after two warm-up steps)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        loss().backward()
        opt.step()
        opt.zero_grad()

    step()
    step()
    dist.barrier()
    return peak_step_bytes(step, model, opt)


def _estimate(
    kind: str, mesh_shape: tuple[int, ...], reshard: bool | int, bf16: bool, ac: bool
) -> fsdp2.MemoryEstimate:
    with torch.device("meta"):
        model = _build(kind, ac)
    return fsdp2.estimate_memory(
        model,
        _batch(kind, "meta"),
        mesh_shape=mesh_shape,
        device="cpu",
        reshard_after_forward=reshard,
        mp_policy=_mp(bf16),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        step_fn=_step,
        compare=False,
    )


ACCURACY = [
    # kind, mesh shape, reshard_after_forward, bf16, activation checkpointing
    ("mlp", (2,), True, False, False),
    ("mlp", (2,), False, False, False),
    # long (docs/testing.md): bf16 is checked on the HSDP 2x2 mesh below, 1D meshes in fp32
    pytest.param("mlp", (2,), True, True, False, marks=pytest.mark.long),
    ("mlp", (2,), True, False, True),
    ("mlp", (4,), 2, False, False),
    ("mlp", (2, 2), True, True, False),
    ("llama", (2,), True, False, False),
]


@pytest.mark.parametrize("kind,shape,reshard,bf16,ac", ACCURACY)
def test_estimate_within_10_percent_of_measured_peak(
    kind: str, shape: tuple[int, ...], reshard: bool | int, bf16: bool, ac: bool
) -> None:
    est = _estimate(kind, shape, reshard, bf16, ac)
    world = int(torch.tensor(shape).prod())
    measured = run_on_ranks(world, _measure, kind, shape, reshard, bf16, ac, timeout=300)
    error = (est.peak_bytes - measured[0]) / measured[0]  # rank 0: the largest shards
    assert abs(error) < 0.10, (
        f"estimate {est.peak_bytes / MiB:.1f} MiB vs measured {measured[0] / MiB:.1f} MiB "
        f"({error:+.1%})\n{est}"
    )


# ---- planning ---------------------------------------------------------------------------


def _llama(n_layers: int = 2, dim: int = 128) -> Llama:
    cfg = LlamaConfig(vocab_size=128, dim=dim, n_layers=n_layers, n_heads=4, max_seq_len=64)
    with torch.device("meta"):
        return Llama(cfg)


def _tokens(batch: int = 2, seq: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return tok, tok


@functools.cache
def _plain() -> fsdp2.MemoryEstimate:
    """``_llama()`` on 2 ranks with the defaults (AdamW), simulated once for the tests that
    read it (they only read it)."""
    return fsdp2.estimate_memory(_llama(), _tokens(), mesh_shape=2, device="cpu", compare=False)


def test_parts_add_up_and_name_the_moment() -> None:
    est = _plain()
    assert set(est.parts) == set(PARTS)
    assert sum(est.parts.values()) == est.peak_bytes
    n = sum(p.numel() for p in _llama().parameters())
    # rank 0's shards: about half of every parameter (dim-0 shards, rounded up)
    assert n * 4 / 2 <= est.parts["parameters (sharded)"] <= n * 4 / 2 * 1.05
    assert est.parts["optimizer state"] >= 2 * n * 4 / 2  # AdamW: exp_avg, exp_avg_sq
    assert est.parts["activations"] > 0
    assert est.when.split(" of ")[0] in ("forward", "backward", "post-backward", "recompute")
    assert est.world_size == 2 and est.mesh_shape == (2,) and est.device == "cpu"
    assert est.alternatives == ()


def test_world_size_beyond_this_machine_shrinks_the_shards() -> None:
    small = _plain()
    big = fsdp2.estimate_memory(_llama(), _tokens(), mesh_shape=64, device="cpu", compare=False)
    assert big.world_size == 64
    ratio = small.parts["parameters (sharded)"] / big.parts["parameters (sharded)"]
    assert 20 < ratio <= 32  # 32x fewer rows, up to padding
    assert big.peak_bytes < small.peak_bytes
    hsdp = fsdp2.estimate_memory(
        _llama(), _tokens(), mesh_shape=(8, 2), device="cpu", compare=False
    )
    assert hsdp.parts["parameters (sharded)"] == small.parts["parameters (sharded)"]
    assert not dist.is_initialized()  # the fake process group is gone again
    assert not HUB.observers  # the tracker unsubscribed


def test_a_model_too_big_for_this_machine_allocates_nothing() -> None:
    # ~5.4B parameters: 20 GiB of fp32 weights alone, on a 24 GiB machine (6 blocks as wide
    # as a 70B model's: a quarter of the simulation of 24 blocks of width 4096)
    with torch.device("meta"):
        model = Llama(
            LlamaConfig(vocab_size=32000, dim=8192, n_layers=6, n_heads=64, max_seq_len=512)
        )
    est = fsdp2.estimate_memory(
        model, _tokens(1, 512), mesh_shape=8, device="cpu", optimizer="sgd", compare=False
    )
    n = sum(p.numel() for p in model.parameters())
    assert n > 5e9
    assert est.parts["parameters (sharded)"] >= n * 4 / 8
    assert est.peak_bytes > 4 * 2**30


def test_alternatives_cover_reshard_choices() -> None:
    est = fsdp2.estimate_memory(_llama(3), _tokens(), mesh_shape=4, device="cpu")
    names = [est.settings] + [a.settings for a in est.alternatives]
    assert names == ["reshard_after_forward=True", "reshard_after_forward=False"]
    keep = est.alternatives[0]
    # without resharding, every block's parameters stay from the forward to its backward
    assert keep.parts["parameters (unsharded)"] > est.parts["parameters (unsharded)"]
    assert keep.peak_bytes > est.peak_bytes
    assert len(keep.unsharded) > len(est.unsharded)
    table = str(est)
    assert "reshard_after_forward=False" in table and "activations" in table
    assert "peak" in table.splitlines()[1]


def test_cpu_offload_is_simulated() -> None:
    # On a CPU mesh the offload moves nothing: the same peak, named as such.
    plain = _plain()
    est = fsdp2.estimate_memory(
        _llama(), _tokens(), mesh_shape=2, device="cpu", compare=False,
        offload_policy=fsdp2.CPUOffloadPolicy(),  # pinned: simulated unpinned (same bytes)
    )  # fmt: skip
    assert est.settings == "reshard_after_forward=True, CPU offload"
    assert est.peak_bytes == plain.peak_bytes and est.host_peak_bytes == 0


class _Viewed(TwoTensor):
    """A frozen weight's subclass with the all-gather hooks and ``fsdp_get_unsharded_view``
    ([Note: unsharded views] in fsdp2/_core/params/views.py); ``view=False`` declines."""

    view = True

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self.a, self.b), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        return None if out is not None else (type(self)(*outputs), ())

    def fsdp_get_unsharded_view(self, mesh, module, mp_policy):
        return type(self)(self.a, self.b) if self.view else None


def test_unsharded_views_count_no_unsharded_bytes() -> None:
    """A frozen subclass weight that lends its storage as the unsharded parameter (one shard
    rank) adds no unsharded parameter or all-gather bytes; declining gathers its 32 KiB."""

    class Declines(_Viewed):
        view = False

    parts = {}
    for cls in (_Viewed, Declines):
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
            w = model[0].weight.detach()
            model[0].weight = nn.Parameter(cls(w, w.clone()), requires_grad=False)
            model[0].requires_grad_(False)
        est = fsdp2.estimate_memory(
            model, torch.randn(4, 64, device="meta"), mesh_shape=1, device="cpu", compare=False
        )
        parts[cls.view] = est.parts
    assert parts[True]["parameters (unsharded)"] == 0, parts
    assert parts[True]["communication buffers"] == 0, parts
    assert parts[False]["parameters (unsharded)"] == 2 * 64 * 64 * 4, parts


@pytest.mark.parametrize(
    "optimizer,state_factor", [("sgd", 0), ("sgd_momentum", 1), ("adamw", 2), ("adam", 2)]
)
def test_optimizer_state(optimizer: str, state_factor: int) -> None:
    if optimizer == "adamw":  # the default
        est = _plain()
    else:
        est = fsdp2.estimate_memory(
            _llama(), _tokens(), mesh_shape=2, device="cpu", optimizer=optimizer, compare=False
        )
    shard = est.parts["parameters (sharded)"]
    state = est.parts["optimizer state"]
    # the state is shaped like the local shards (the sharded storage may pad them a bit)
    assert state_factor * shard * 0.98 <= state <= state_factor * shard + 4096  # + steps


def test_build_function_shards_its_own_way() -> None:
    def build(mesh):  # type: ignore[no-untyped-def]
        with torch.device("meta"):  # (an initialization reading values needs real ones)
            model = Llama(
                LlamaConfig(vocab_size=128, dim=128, n_layers=2, n_heads=4, max_seq_len=64)
            )
        fsdp2.fully_shard(model.layers[0], mesh=mesh)  # one block alone, the rest with the root
        fsdp2.fully_shard(model, mesh=mesh)
        return model

    est = fsdp2.estimate_memory(build, _tokens(), mesh_shape=2, device="cpu")
    assert est.settings == "as built"
    names = [a.settings for a in est.alternatives]
    assert names == ["reshard_after_forward=True", "reshard_after_forward=False"]
    assert est.peak_bytes == est.alternatives[0].peak_bytes  # built with the default (True)
    assert sum(est.parts.values()) == est.peak_bytes


def test_kept_unsharded_storage_is_counted() -> None:
    """``set_keep_unsharded_storage(True)`` (torch main's) in a ``build``: every group keeps
    its unsharded storage, so the unsharded parameters at the peak are the whole model's
    bytes, and the peak grows by what the default frees."""
    cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=32)

    def build(keep: bool) -> Callable[[object], nn.Module]:
        def b(mesh):  # type: ignore[no-untyped-def]
            with torch.device("meta"):
                model = Llama(cfg)
            for block in model.layers:
                fsdp2.fully_shard(block, mesh=mesh)
            fsdp2.fully_shard(model, mesh=mesh)
            model.set_keep_unsharded_storage(keep)
            return model

        return b

    tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
    freed, kept = (
        fsdp2.estimate_memory(build(k), (tokens, tokens), mesh_shape=2, device="cpu", compare=False)
        for k in (False, True)
    )
    with torch.device("meta"):
        whole = sum(p.numel() * p.element_size() for p in Llama(cfg).parameters())
    assert kept.parts["parameters (unsharded)"] == whole, (kept.parts, whole)
    assert freed.parts["parameters (unsharded)"] < whole
    grown = kept.parts["parameters (unsharded)"] - freed.parts["parameters (unsharded)"]
    assert kept.peak_bytes == freed.peak_bytes + grown


def test_custom_step_and_shard_selection() -> None:
    from fsdp2.models.llama import TransformerBlock

    def step(model, batch):  # type: ignore[no-untyped-def]
        tokens, targets = batch
        return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())

    est = fsdp2.estimate_memory(
        _llama(), _tokens(), mesh_shape=2, device="cpu", shard=TransformerBlock, step_fn=step,
        compare=False,
    )  # fmt: skip
    assert est.peak_bytes > 0


def _odd_llama() -> Llama:
    """Shapes that do not divide: rank 0's shards and their pieces are rounded up."""
    cfg = LlamaConfig(vocab_size=129, dim=38, n_layers=1, n_heads=1, max_seq_len=16)
    with torch.device("meta"):
        return Llama(cfg)


def _odd_estimate(shape: tuple[int, int], flag: bool) -> fsdp2.MemoryEstimate:
    return fsdp2.estimate_memory(
        _odd_llama(), _tokens(2, 16), mesh_shape=shape, device="cpu", compare=False,
        shard_over_replicas=flag,
    )  # fmt: skip


@pytest.mark.parametrize("shape", [(2, 2), (4, 2)])
def test_shard_over_replicas_divides_gradients_and_optimizer_state(
    shape: tuple[int, int],
) -> None:
    replicas, shards = shape
    plain, est = (_odd_estimate(shape, flag) for flag in (False, True))
    params = list(_odd_llama().parameters())
    # rank 0's local shard of each parameter (ceil(rows / S) rows), and its piece of it
    local = [-(-p.shape[0] // shards) * p[0].numel() for p in params]
    pieces = [-(-n // replicas) for n in local]
    assert sum(pieces) > sum(local) / replicas  # some pieces are rounded up
    steps = 4 * len(params)  # AdamW's fp32 step counter of each parameter (or piece)
    assert plain.held == {
        "parameters": 4 * sum(local),
        "gradients": 4 * sum(local),
        "optimizer state": 8 * sum(local) + steps,
    }
    assert est.held == {
        "parameters": 4 * sum(local),
        "gradients": 4 * sum(pieces),
        "optimizer state": 8 * sum(pieces) + steps,
    }
    assert est.parts["parameters (sharded)"] == plain.parts["parameters (sharded)"]
    assert est.peak_bytes < plain.peak_bytes and sum(est.parts.values()) == est.peak_bytes
    assert est.settings == "reshard_after_forward=True, shard_over_replicas"


def test_shard_over_replicas_needs_an_hsdp_mesh() -> None:
    for mesh_shape in (4, (4,)):
        with pytest.raises(ValueError, match=r"needs an HSDP mesh_shape \(R, S\)"):
            fsdp2.estimate_memory(
                _llama(), _tokens(), mesh_shape=mesh_shape, device="cpu", shard_over_replicas=True
            )
    assert not dist.is_initialized()


# ---- errors -----------------------------------------------------------------------------


class _DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": self.lin(x)}


def test_errors() -> None:
    with pytest.raises(ValueError, match="mesh_shape must be"):
        fsdp2.estimate_memory(_llama(), _tokens(), mesh_shape=(2, 2, 2))
    with pytest.raises(ValueError, match="mesh_shape must be"):
        fsdp2.estimate_memory(_llama(), _tokens(), mesh_shape=0)
    with pytest.raises(ValueError, match="mp_policy apply to a model that estimate_memory"):
        fsdp2.estimate_memory(
            lambda mesh: _llama(), _tokens(), mesh_shape=2, mp_policy=fsdp2.MixedPrecisionPolicy()
        )
    if not torch.backends.cuda.is_built():
        with pytest.raises(RuntimeError, match="needs a torch built with CUDA"):
            fsdp2.estimate_memory(_llama(), _tokens(), mesh_shape=2, device="cuda")
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        fsdp2.estimate_memory(_llama(), _tokens(), mesh_shape=2, optimizer="lamb")
    with pytest.raises(TypeError, match="step_fn returned a dict, not the loss"):
        fsdp2.estimate_memory(
            _llama(), _tokens(), mesh_shape=2, device="cpu", step_fn=lambda m, b: {"x": 1}
        )
    with pytest.raises(TypeError, match="pass step_fn="):  # the default step: no loss
        fsdp2.estimate_memory(
            _DictOut(), torch.empty(2, 4, device="meta"), mesh_shape=2, device="cpu"
        )
    model = _llama()
    with pytest.raises(TypeError, match="a module is not a predicate"):  # model.layers
        fsdp2.estimate_memory(model, _tokens(), mesh_shape=2, device="cpu", shard=model.layers)
    assert not dist.is_initialized()
    assert not HUB.observers  # the tracker unsubscribed


def test_a_fake_process_group_of_the_users_is_used_and_kept() -> None:
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=4)
    try:
        est = fsdp2.estimate_memory(_llama(), _tokens(), mesh_shape=(2, 2), device="cpu")
        assert est.world_size == 4 and dist.is_initialized()
        with pytest.raises(RuntimeError, match="fake, 4 ranks"):
            fsdp2.estimate_memory(_llama(), _tokens(), mesh_shape=8, device="cpu")
    finally:
        dist.destroy_process_group()


def _sharded_and_initialized() -> tuple[str, str]:
    mesh = init_device_mesh("cpu", (2,))
    model = _llama()
    fsdp2.fully_shard(model, mesh=mesh)
    with pytest.raises(ValueError, match="already sharded") as sharded:
        fsdp2.estimate_memory(model, _tokens(), mesh_shape=2)
    with pytest.raises(RuntimeError, match="before init_process_group") as initialized:
        fsdp2.estimate_memory(_llama(), _tokens(), mesh_shape=2, device="cpu")
    return str(sharded.value), str(initialized.value)


def test_errors_with_a_process_group() -> None:
    sharded, initialized = run_on_ranks(2, _sharded_and_initialized)[0]
    assert "Llama" in sharded and "build(mesh)" in sharded
    assert "gloo, 2 ranks" in initialized


# ---- a Hugging Face model -----------------------------------------------------------------


def _hf_config():  # type: ignore[no-untyped-def]
    import transformers
    from transformers import LlamaConfig as HFLlamaConfig

    transformers.logging.set_verbosity_error()
    return HFLlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )


def _hf_batch(device: str | None = None) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 2048, (4, 128), device=device)
    return {"input_ids": ids, "labels": ids}


def _measure_hf() -> int:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,))
    model = LlamaForCausalLM(_hf_config())
    for block in model.model.layers:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return _measured_peak(model, lambda: model(**_hf_batch()).loss)


def test_hugging_face_model_within_10_percent() -> None:
    """A transformers ``LlamaForCausalLM`` as users hand it over: built on meta, a dict
    batch, the loss from the output's ``.loss``, blocks found in its ``nn.ModuleList``."""
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(_hf_config())
    est = fsdp2.estimate_memory(model, _hf_batch("meta"), mesh_shape=2, device="cpu")
    assert est.unsharded and all(p.startswith(("the root", "model.layers.")) for p in est.unsharded)
    measured = run_on_ranks(2, _measure_hf, timeout=300)[0]
    error = (est.peak_bytes - measured) / measured
    assert abs(error) < 0.10, f"estimate {est.peak_bytes} vs measured {measured}\n{est}"
