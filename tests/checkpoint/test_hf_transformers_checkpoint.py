"""``fsdp2.checkpoint`` with real Hugging Face transformers checkpoints (``LlamaForCausalLM``).

transformers (a test extra, pinned in pyproject.toml) builds a tiny Llama from a config
(nothing is downloaded): 2 decoder layers, hidden 32, vocab 99 (so the embedding and head
shard unevenly over 2 and 4 ranks), with untied and with tied input / output embeddings.
Every case runs on 2 and 4 gloo CPU ranks, the model sharded with ``fsdp2.fully_shard`` per
decoder layer, then at the root; the reference is the same model built unsharded with the
same seed, in the same worker (so its logits come from the same kernels and threads).

* HF -> fsdp2: ``save_pretrained`` (one ``model.safetensors``, or with a small
  ``max_shard_size`` an index and several files, also of the model cast to bf16, loaded
  into the fp32 model as the bf16 values cast back) on rank 0; every rank builds the model on
  the meta device, shards it, builds the non-persistent rotary tables for real (without
  them ``load_full_checkpoint`` raises ``ValueError`` naming them and leaves the model on
  meta), then ``load_full_checkpoint``: nothing missing or unexpected, the tie kept, the
  full parameters and the rotary buffers bitwise equal to the reference's, and the logits
  on a fixed batch bitwise equal to the unsharded model's (fsdp2 computes with the
  all-gathered full weights, so the matmuls are the reference's: no tolerance).
* fsdp2 -> HF: ``save_full_checkpoint`` of the sharded model (small ``max_shard_size``: the
  same files and ``weight_map`` as ``save_pretrained`` writes; default: one file; and
  ``dtype=torch.bfloat16``), plus ``config.save_pretrained`` (``save_full_checkpoint``
  writes weights only; it keeps ``config.json``); rank 0 then ``from_pretrained``: no
  missing / unexpected / mismatched keys in ``output_loading_info`` and no transformers
  warning (no load report), parameters and logits bitwise equal to the reference's; the
  bf16 file loaded with ``dtype=torch.bfloat16`` equals the reference cast to bf16
  (parameters and logits).
* Round trip after training, as when fine-tuning a Hub model: ``save_pretrained`` (one file),
  ``load_full_checkpoint`` into the meta-device sharded model, 2 AdamW steps (each rank on
  its slice of the batch), ``save_full_checkpoint`` over that directory (sharded, then one
  file again: stale weight files and index removed, config kept); after each save
  ``from_pretrained`` on rank 0 gives the sharded model's full parameters and logits
  bitwise, and at the end ``load_full_checkpoint`` into a fresh meta-device sharded model
  on every rank gives them too.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import os
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from helpers import WORLD_SIZES, mine, world_mesh
from models import full_params, hf_llama_config
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2.checkpoint import LoadResult, load_full_checkpoint, save_full_checkpoint

# Only the workers import transformers (~3 s a process): the parent just checks it is there.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is a test extra: pip install -e '.[test]'",
)

VOCAB = 99  # uneven shards of the embedding and the head: 50/49 on 2 ranks, 25x3/24 on 4
SMALL = 20_000  # bytes: 6 (tied) or 7 (untied) files; no single tensor exceeds it
BATCH, SEQ = 4, 12
INDEX = "model.safetensors.index.json"
TIED = pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])


# ---- building blocks (run in the workers) -----------------------------------------------------


def _quiet() -> None:
    """transformers' logging to errors only and no progress bars (in this worker)."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def _config(tied: bool):
    return hf_llama_config(VOCAB, tie_word_embeddings=tied)


def _llama(tied: bool, seed: int = 0) -> nn.Module:
    """A randomly initialised tiny ``LlamaForCausalLM`` (same on every rank for one seed)."""
    from transformers import LlamaForCausalLM

    _quiet()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_config(tied))
    assert _is_tied(model) == tied, f"LlamaForCausalLM built with tied={_is_tied(model)}"
    return model


def _is_tied(model: nn.Module) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight


def _shard(model: nn.Module) -> nn.Module:
    """As tests/integrations/test_hf.py: ``fully_shard`` every decoder layer, then the root."""
    mesh = world_mesh()
    for layer in model.model.layers:
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model


def _meta_sharded(tied: bool) -> nn.Module:
    """The model built on the meta device (no memory, no init) and sharded there."""
    from transformers import LlamaForCausalLM

    _quiet()
    with torch.device("meta"):
        model = LlamaForCausalLM(_config(tied))
    _shard(model)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert _is_tied(model) == tied, "fully_shard changed the tie"
    return model


def _build_rotary(model: nn.Module) -> None:
    """Give the meta-device model real rotary tables.

    ``rotary_emb.inv_freq`` and ``original_inv_freq`` are non-persistent buffers: in no
    checkpoint, computed from the config in ``LlamaRotaryEmbedding.__init__`` (with
    ``attention_scaling``, a plain attribute). The least awkward correct way in
    transformers 5 is a fresh module built outside the meta-device context (so on the
    CPU): it holds no parameters, so swapping it after ``fully_shard`` touches no sharded
    state. The alternatives are worse: ``model.init_weights()`` recomputes the buffers but
    also draws every parameter at random (to be overwritten), and ``to_empty`` plus
    re-running the rope init function repeats transformers' private logic."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model.model.rotary_emb = LlamaRotaryEmbedding(config=model.config)


def _batch() -> torch.Tensor:
    """The fixed batch the logits are compared on (the same on every rank)."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _logits(model: nn.Module, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logits on ``ids`` (the fixed batch by default); collective for a sharded model."""
    with torch.no_grad():
        return model(input_ids=_batch() if ids is None else ids).logits


def _check_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, want {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    assert torch.equal(got, want), (
        f"{what}: differs (max abs diff {(got.double() - want.double()).abs().max().item():.3g})"
    )


def _check_params(got: dict[str, torch.Tensor], want: nn.Module, what: str) -> None:
    """``got`` (full parameters by name) bitwise equal to ``want``'s, same names, same order."""
    ref = {n: p.detach() for n, p in want.named_parameters()}
    assert list(got) == list(ref), f"{what}: names {list(got)} != {list(ref)}"
    for name, t in got.items():
        _check_equal(t, ref[name], f"{what}: {name}")


@contextlib.contextmanager
def _transformers_warnings() -> Iterator[list[logging.LogRecord]]:
    """Record what transformers logs at WARNING and above (its load report of missing,
    unexpected, mismatched or newly initialised weights is such a warning); other tests'
    ``_quiet`` in this worker would hide it, so the verbosity is raised meanwhile."""
    import transformers

    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = _Keep(level=logging.WARNING)
    logger = logging.getLogger("transformers")
    before = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        transformers.logging.set_verbosity(before)


def _load_with_report(path: str, **kw) -> tuple[nn.Module, dict, list[str]]:
    """``LlamaForCausalLM.from_pretrained(path, **kw)``, the non-empty entries of its loading
    info (missing / unexpected / mismatched keys, errors) and what transformers warned (its
    logging, and Python warnings)."""
    from transformers import LlamaForCausalLM

    with _transformers_warnings() as records, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, info = LlamaForCausalLM.from_pretrained(path, output_loading_info=True, **kw)
    problems = {k: v for k, v in info.items() if v}
    messages = [f"{r.name}: {r.getMessage()}" for r in records]
    messages += [f"{w.category.__name__}: {w.message}" for w in caught]
    return model, problems, messages


def _from_pretrained(path: str, **kw) -> nn.Module:
    """``LlamaForCausalLM.from_pretrained(path)`` that must load every weight cleanly."""
    model, problems, messages = _load_with_report(path, **kw)
    assert not problems, f"from_pretrained({path}): {problems}"
    assert not messages, f"from_pretrained({path}) warned:\n" + "\n".join(messages)
    return model


def _weight_files(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def _check_layout(path: str, layout: str, what: str) -> dict[str, str] | None:
    """The directory holds one ``model.safetensors`` (``single``) or an index and several
    ``model-0000i-of-0000n.safetensors`` (``sharded``); returns the index's weight_map."""
    files = _weight_files(path)
    leftovers = [f for f in os.listdir(path) if f.endswith(".partial")]
    assert not leftovers, f"{what}: temporary files left: {leftovers}"
    if layout == "single":
        assert files == ["model.safetensors"], f"{what}: {files}"
        assert not os.path.exists(os.path.join(path, INDEX)), f"{what}: an index for one file"
        return None
    n = len(files)
    assert n > 1, f"{what}: expected several files, got {files}"
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)], files
    with open(os.path.join(path, INDEX)) as f:
        weight_map: dict[str, str] = json.load(f)["weight_map"]
    assert sorted(set(weight_map.values())) == files, f"{what}: index {weight_map}"
    return weight_map


# ---- 1. HF -> fsdp2 -----------------------------------------------------------------------------


def _hf_to_fsdp2_case(tmp: str, tied: bool, layout: str) -> None:
    ref = _llama(tied)
    saved = ref
    if layout == "bf16":
        # A bf16 checkpoint (as most on the Hub) into the fp32 model: loaded cast to fp32, so
        # the reference is the fp32 model with its parameters rounded to bf16.
        saved = copy.deepcopy(ref).to(torch.bfloat16)
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(p.to(torch.bfloat16))
    ckpt = os.path.join(tmp, "hf")
    if dist.get_rank() == 0:  # transformers 5 always writes safetensors (no safe_serialization)
        saved.save_pretrained(ckpt, max_shard_size="5GB" if layout == "single" else SMALL)
    dist.barrier()
    _check_layout(ckpt, "single" if layout == "single" else "sharded", "save_pretrained")

    model = _meta_sharded(tied)
    with pytest.raises(ValueError, match=r"model\.rotary_emb\.inv_freq"):
        load_full_checkpoint(model, ckpt)  # the rotary tables would be uninitialised memory
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()]), "half loaded"
    _build_rotary(model)
    result = load_full_checkpoint(model, ckpt)
    assert result == LoadResult([], []), result

    assert _is_tied(model) == tied, "load_full_checkpoint changed the tie"
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and not p.to_local().is_meta, name
    _check_params(full_params(model), ref, "loaded parameter")
    ref_buffers = dict(ref.named_buffers())
    buffers = dict(model.named_buffers())
    assert list(buffers) == list(ref_buffers), (list(buffers), list(ref_buffers))
    for name, b in buffers.items():
        _check_equal(b, ref_buffers[name], f"buffer {name}")
    _check_equal(_logits(model), _logits(ref), "logits of the loaded sharded model")


@pytest.mark.parametrize("layout", ["sharded", "single", "bf16"])
@TIED
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_hf_to_fsdp2(tmp_path, world_size: int, tied: bool, layout: str) -> None:
    run_on_ranks(world_size, _hf_to_fsdp2_case, str(tmp_path), tied, layout)


# ---- 2. fsdp2 -> HF -----------------------------------------------------------------------------


def _fsdp2_to_hf_case(tmp: str, tied: bool) -> list[list[str]]:
    ref = _llama(tied)
    model = _shard(_llama(tied))
    rank = dist.get_rank()
    names = ("sharded", "single", "bf16", "no_norm", "hf")
    dirs = {name: os.path.join(tmp, name) for name in names}
    if rank == 0:
        ref.save_pretrained(dirs["hf"], max_shard_size=SMALL)  # for its weight_map
        for name in ("sharded", "single", "bf16", "no_norm"):
            # save_full_checkpoint writes weights only; it must leave config.json alone.
            model.config.save_pretrained(dirs[name])
    dist.barrier()
    written = [
        save_full_checkpoint(model, dirs["sharded"], max_shard_size=SMALL),
        save_full_checkpoint(model, dirs["single"]),
        save_full_checkpoint(model, dirs["bf16"], max_shard_size=SMALL, dtype=torch.bfloat16),
    ]
    # A checkpoint lacking a weight, to show that _from_pretrained's checks see a bad one.
    save_full_checkpoint(model, dirs["no_norm"], key_map={"model.norm.weight": None})
    _check_equal(_logits(model), _logits(ref), "logits of the sharded model")
    for name, files in zip(("sharded", "single", "bf16"), written, strict=True):
        path = dirs[name]
        assert os.path.exists(os.path.join(path, "config.json")), f"{name}: config.json removed"
        weight_map = _check_layout(path, "single" if name == "single" else "sharded", name)
        want = [os.path.join(path, f) for f in _weight_files(path)]
        if weight_map is not None:
            want.append(os.path.join(path, INDEX))  # the index last
        assert files == want, f"{name}: returned {files}, want {want}"
        if name == "sharded":
            hf_map = _check_layout(dirs["hf"], "sharded", "save_pretrained")
            assert weight_map == hf_map, f"weight_map {weight_map}, save_pretrained's {hf_map}"

    if rank == 0:
        # The checks of _from_pretrained are not vacuous: a missing weight shows in both.
        _, problems, messages = _load_with_report(dirs["no_norm"])
        assert problems == {"missing_keys": {"model.norm.weight"}}, problems
        assert any("model.norm.weight" in m for m in messages), f"no load report: {messages}"
        for name in ("sharded", "single"):
            loaded = _from_pretrained(dirs[name])
            assert _is_tied(loaded) == tied, name
            _check_params(dict(loaded.named_parameters()), ref, f"{name}: from_pretrained")
            _check_equal(_logits(loaded), _logits(ref), f"{name}: from_pretrained logits")
        loaded = _from_pretrained(dirs["bf16"], dtype=torch.bfloat16)
        # The reference cast to bf16: its parameters. from_pretrained(dtype=bf16) keeps the
        # rotary tables in fp32 (computed in __init__), where .to(bf16) would round them.
        ref_bf16 = copy.deepcopy(ref).to(torch.bfloat16)
        ref_bf16.model.rotary_emb = copy.deepcopy(ref.model.rotary_emb)
        for (name, b), want in zip(loaded.named_buffers(), ref_bf16.buffers(), strict=True):
            _check_equal(b, want, f"bf16: from_pretrained buffer {name}")
        assert _is_tied(loaded) == tied and _is_tied(ref_bf16) == tied
        _check_params(dict(loaded.named_parameters()), ref_bf16, "bf16: from_pretrained")
        _check_equal(_logits(loaded), _logits(ref_bf16), "bf16: from_pretrained logits")
    return written


@TIED
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fsdp2_to_hf(tmp_path, world_size: int, tied: bool) -> None:
    written = run_on_ranks(world_size, _fsdp2_to_hf_case, str(tmp_path), tied)
    assert all(w == written[0] for w in written), f"ranks returned different files: {written}"


# ---- 3. Round trip after training ----------------------------------------------------------------


def _tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _check_trained(path: str, trained: dict[str, torch.Tensor], logits: torch.Tensor) -> None:
    """Rank 0: ``from_pretrained(path)`` has the trained parameters and the same logits."""
    loaded = _from_pretrained(path)
    got = {n: p.detach() for n, p in loaded.named_parameters()}
    assert list(got) == list(trained), (list(got), list(trained))
    for name, t in got.items():
        _check_equal(t, trained[name], f"{path}: from_pretrained {name}")
    _check_equal(_logits(loaded), logits, f"{path}: from_pretrained logits vs the sharded model's")


def _trained_round_trip_case(tmp: str, tied: bool) -> None:
    # Fine-tuning a Hub model: its directory (config, generation config, one weight file)...
    ckpt = os.path.join(tmp, "llama")
    rank = dist.get_rank()
    if rank == 0:
        _llama(tied).save_pretrained(ckpt)
    dist.barrier()
    # ...loaded into the sharded model built on the meta device...
    model = _meta_sharded(tied)
    _build_rotary(model)
    assert load_full_checkpoint(model, ckpt) == LoadResult([], [])
    init = full_params(model)
    # ...trained for 2 AdamW steps, each rank on its slice of the batch...
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        ids = mine(_tokens(step))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    trained = full_params(model)
    same = [n for n in trained if torch.equal(trained[n], init[n])]
    assert not same, f"not trained: {same}"
    assert _is_tied(model) == tied, "training changed the tie"
    logits = _logits(model)

    # ...and saved over that directory: sharded (its model.safetensors removed, config.json
    # kept), then as one file again (the shards and the index removed).
    save_full_checkpoint(model, ckpt, max_shard_size=SMALL)
    _check_layout(ckpt, "sharded", "save_full_checkpoint over save_pretrained's")
    if rank == 0:
        _check_trained(ckpt, trained, logits)
    dist.barrier()  # rank 0 reads the files the next save replaces
    save_full_checkpoint(model, ckpt)
    _check_layout(ckpt, "single", "save_full_checkpoint over a sharded one")
    if rank == 0:
        _check_trained(ckpt, trained, logits)

    # Back into a fresh sharded model.
    fresh = _meta_sharded(tied)
    _build_rotary(fresh)
    assert load_full_checkpoint(fresh, ckpt) == LoadResult([], [])
    reloaded = full_params(fresh)
    for name, t in trained.items():
        _check_equal(reloaded[name], t, f"load_full_checkpoint: {name}")
    _check_equal(_logits(fresh), logits, "reloaded sharded logits vs the sharded model's")


@TIED
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_trained_round_trip(tmp_path, world_size: int, tied: bool) -> None:
    run_on_ranks(world_size, _trained_round_trip_case, str(tmp_path), tied)
