"""Hugging Face transformers and PEFT models under ``fsdp2.fully_shard``: parity with torch's.

transformers and peft (test extras, pinned in pyproject.toml) build tiny models from configs
(nothing is downloaded). Each case builds the same model twice in one worker with the same
seed, shards one copy with ``fsdp2.fully_shard`` and one with torch's (per decoder block,
then at the root), trains both for a few AdamW steps, each rank on its own slice of a global
batch, and checks that the rank-averaged losses are bitwise equal every step and the full
parameters at the end, and that they are close to an unsharded reference trained on the
global batch (fp32 throughout; with bf16 compute only the losses, within 5e-3). Cases:

* ``LlamaForCausalLM`` with PEFT LoRA adapters on ``q_proj`` / ``v_proj`` (base frozen, the
  root is the ``PeftModelForCausalLM``), fp32 and ``MixedPrecisionPolicy(bf16, fp32)``;
* ``generate`` (greedy) after that training: the same tokens on both engines, on every rank,
  and as the reference. ``PeftModelForCausalLM.generate`` calls the inner model's ``generate``,
  which never enters the sharded root's ``forward``, so the root's parameters stay sharded
  and the embedding fails on a DTensor weight ("mixed torch.Tensor and DTensor") with either
  engine: ``register_fsdp_forward_method(model, "generate")`` is needed there. With the inner
  ``LlamaForCausalLM`` as the root, a plain ``generate`` works;
* ``LlamaForCausalLM`` built on the meta device, sharded, ``to_empty`` and re-initialised
  with transformers' ``init_weights()`` (the sharded DTensors are initialised in place, the
  non-persistent rotary buffers recomputed): equal to torch's bitwise, then trains equal to
  it and close to a reference loaded with the initialised full parameters (on a CPU mesh
  DTensor's RNG tracker is off, so every rank draws the same numbers for its shard, with
  either engine);
* ``GPT2LMHeadModel`` with tied input / output embeddings: the tie survives ``fully_shard``
  (one parameter object, in the root's group; the head computes with the unsharded
  embedding) and trains equal to torch's, in fp32 and with ``MixedPrecisionPolicy(bf16,
  fp32)``.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
from _harness import run_on_ranks
from helpers import check_close_run, check_same_run, mine, world_mesh
from models import full_params, hf_llama_config, mean_over_ranks
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import register_fsdp_forward_method as torch_register_method
from torch.distributed.tensor import DTensor

import fsdp2

pytest.importorskip("transformers", reason="transformers is a test extra: pip install -e '.[test]'")
if importlib.util.find_spec("peft") is None:  # (importing it here costs the collection ~1 s)
    pytest.skip("peft is a test extra: pip install -e '.[test]'", allow_module_level=True)

ENGINES = ("fsdp2", "torch")
STEPS = 4
VOCAB = 128
BATCH, SEQ = 4, 16  # the global batch: BATCH sequences of SEQ tokens, split over the ranks


def _fully_shard(engine: str):
    return fsdp2.fully_shard if engine == "fsdp2" else torch_fully_shard


def _register_method(engine: str):
    return fsdp2.register_fsdp_forward_method if engine == "fsdp2" else torch_register_method


def _mp(engine: str, bf16: bool):
    cls = fsdp2.MixedPrecisionPolicy if engine == "fsdp2" else TorchMP
    return cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else cls()


def _quiet() -> None:
    """Silence transformers' logging (in this worker) before building a model."""
    import transformers

    transformers.logging.set_verbosity_error()


def _llama_config():
    return hf_llama_config(VOCAB)


def _lora_llama() -> nn.Module:
    """A ``PeftModelForCausalLM``: tiny Llama, LoRA (r=4) on q_proj / v_proj, base frozen."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    _quiet()
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft calls deprecated transformers properties
        return get_peft_model(LlamaForCausalLM(_llama_config()), config)


def _tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _train(model: nn.Module, steps: int, *, sharded: bool) -> list[torch.Tensor]:
    """``steps`` AdamW steps of the model's own causal-LM loss (``labels=input_ids``) over the
    trainable parameters; a sharded model sees this rank's slice of each global batch, the
    unsharded reference the whole batch. Returns the (rank-averaged) losses."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(steps):
        ids = _tokens(step)
        if sharded:
            ids = mine(ids)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(mean_over_ranks(loss) if sharded else loss.detach())
        opt.step()
        opt.zero_grad()
    return losses


def _run(model: nn.Module, steps: int, *, sharded: bool) -> dict[str, Any]:
    """``_train``, then the full parameters: ``{"losses": ..., "params": ...}``."""
    return {"losses": _train(model, steps, sharded=sharded), "params": full_params(model)}


def _compare(
    results: dict[str, dict[str, Any]],
    reference: dict[str, Any] | None = None,
    *,
    tol: float = 1e-5,
    param_tol: float | None = 1e-3,
) -> None:
    """Both engines' runs (losses, full params) agree bitwise, and with ``reference`` (trained
    unsharded on the global batch) within ``tol`` (losses) and ``param_tol`` (parameters, max
    abs, unless None: AdamW's normalized step turns rounding-level gradient differences into
    parameter ones of up to ~1e-4 where a gradient is near zero)."""
    check_same_run(results["fsdp2"], results["torch"])
    if reference is not None:
        ours = results["fsdp2"]
        assert ours["params"].keys() == reference["params"].keys(), "parameter names differ"
        check_close_run(
            ours,
            reference,
            "fsdp2 vs reference",
            tol={"atol": tol, "rtol": tol},
            param_tol=None if param_tol is None else {"atol": param_tol, "rtol": 0.0},
        )


def _record_weight_dtypes(modules: dict[str, nn.Module]) -> dict[str, list[torch.dtype]]:
    """Record each module's ``weight`` dtype at every forward: the compute dtype."""
    seen: dict[str, list[torch.dtype]] = {name: [] for name in modules}
    for name, module in modules.items():
        module.register_forward_pre_hook(lambda m, _, name=name: seen[name].append(m.weight.dtype))
    return seen


def _shard_lora_llama(model: nn.Module, engine: str, mesh, bf16: bool, root: str) -> None:
    """Per decoder layer, then at ``root``: the PEFT wrapper or the inner LlamaForCausalLM."""
    fs, mp = _fully_shard(engine), _mp(engine, bf16)
    llama = model.base_model.model  # PeftModelForCausalLM -> LoraModel -> LlamaForCausalLM
    for layer in llama.model.layers:
        fs(layer, mesh=mesh, mp_policy=mp)
    fs(model if root == "peft" else llama, mesh=mesh, mp_policy=mp)


# ---- LoRA Llama: training ------------------------------------------------------------------


def _lora_llama_case(bf16: bool) -> None:
    mesh = world_mesh()
    results = {}
    for engine in ENGINES:
        torch.manual_seed(0)
        model = _lora_llama()
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), (
            engine,
            trainable,
        )
        _shard_lora_llama(model, engine, mesh, bf16, root="peft")
        attn = model.base_model.model.model.layers[0].self_attn
        dtypes = _record_weight_dtypes(
            {"base": attn.q_proj.base_layer, "lora_A": attn.q_proj.lora_A["default"]}
        )
        before = full_params(model)
        results[engine] = _run(model, STEPS, sharded=True)
        want = torch.bfloat16 if bf16 else torch.float32
        assert dtypes == {k: [want] * STEPS for k in dtypes}, (engine, dtypes)
        for name, t in results[engine]["params"].items():  # only the adapters moved
            assert torch.equal(t, before[name]) != (name in trainable), (engine, name)
            assert t.dtype == torch.float32, (engine, name)
    torch.manual_seed(0)
    reference = _run(_lora_llama(), STEPS, sharded=False)
    # The reference computes in fp32: with bf16 compute, only the losses are compared, loosely.
    _compare(results, reference, tol=5e-3 if bf16 else 1e-5, param_tol=None if bf16 else 1e-3)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_lora_llama_parity(bf16: bool) -> None:
    run_on_ranks(2, _lora_llama_case, bf16)


# ---- LoRA Llama: generate after training -----------------------------------------------------


def _generate(model: nn.Module) -> torch.Tensor:
    """Greedy decoding of 5 tokens from the same two prompts on every rank."""
    prompts = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(9))
    out = model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=5,
        min_new_tokens=5,  # no early end-of-sequence: every rank runs 5 decoding steps
        do_sample=False,
    )
    assert out.shape == (2, 11), out.shape
    return out


def _lora_llama_generate_case(root: str) -> list[torch.Tensor]:
    mesh = world_mesh()
    tokens = {}
    for engine in ENGINES:
        torch.manual_seed(0)
        model = _lora_llama()
        _shard_lora_llama(model, engine, mesh, bf16=False, root=root)
        if root == "peft":
            # generate() bypasses the root's forward, whose parameters stay sharded: register
            # it to run the root's hooks around it.
            with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
                _generate(model)
            _register_method(engine)(model, "generate")
        _train(model, 2, sharded=True)
        tokens[engine] = _generate(model)
        # Training goes on after generate (after a no-grad forward torch leaves the root's
        # parameters unsharded, fsdp2 reshards them: see docs/migration.md).
        _train(model, 1, sharded=True)
    assert torch.equal(tokens["fsdp2"], tokens["torch"]), tokens
    torch.manual_seed(0)
    reference = _lora_llama()
    _train(reference, 2, sharded=False)
    assert torch.equal(tokens["fsdp2"], _generate(reference)), tokens
    return tokens["fsdp2"]


@pytest.mark.parametrize("root", ["peft", "llama"])
def test_lora_llama_generate(root: str) -> None:
    tokens = run_on_ranks(2, _lora_llama_generate_case, root)
    assert torch.equal(tokens[0], tokens[1]), "ranks generated different tokens"


# ---- Llama: meta-device init -----------------------------------------------------------------


def _meta_llama_case() -> None:
    from transformers import LlamaForCausalLM

    _quiet()
    mesh = world_mesh()
    torch.manual_seed(1)
    eager = LlamaForCausalLM(_llama_config())
    eager_buffers = {n: b.clone() for n, b in eager.named_buffers()}
    assert eager_buffers, "expected the rotary inv_freq buffers"

    def build(engine: str) -> nn.Module:
        with torch.device("meta"):
            model = LlamaForCausalLM(_llama_config())
        assert all(p.is_meta for p in model.parameters()), engine
        fs = _fully_shard(engine)
        for layer in model.model.layers:
            fs(layer, mesh=mesh)
        fs(model, mesh=mesh)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with warnings.catch_warnings():
            # "DTensor random operators may not have complete support on cpu device mesh"
            warnings.simplefilter("ignore", UserWarning)
            model.init_weights()  # transformers 5: initialize_weights(), then tie_weights()
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) and not p.is_meta, (engine, name)
        for name, b in model.named_buffers():  # non-persistent, garbage after to_empty
            assert torch.equal(b, eager_buffers[name]), (engine, name)
        return model

    inits, results = {}, {}
    for engine in ENGINES:
        model = build(engine)
        inits[engine] = full_params(model)
        for name, t in inits[engine].items():
            if name.endswith("norm.weight"):
                assert torch.equal(t, torch.ones_like(t)), (engine, name)
            else:  # normal(0, initializer_range=0.02)
                assert 0.01 < t.std().item() < 0.03, (engine, name, t.std().item())
        results[engine] = _run(model, STEPS, sharded=True)
    for name, t in inits["torch"].items():
        assert torch.equal(inits["fsdp2"][name], t), f"initialised {name} differs from torch's"
    # The reference starts from the initialised full parameters.
    eager.load_state_dict(inits["fsdp2"])
    _compare(results, _run(eager, STEPS, sharded=False))


def test_meta_init_llama_parity() -> None:
    run_on_ranks(2, _meta_llama_case)


# ---- GPT-2: tied embeddings ------------------------------------------------------------------


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet()
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    )
    return GPT2LMHeadModel(config)


def _gpt2_tied_case(bf16: bool) -> None:
    mesh = world_mesh()

    def tied(model: nn.Module) -> bool:
        return model.lm_head.weight is model.transformer.wte.weight

    results = {}
    for engine in ENGINES:
        torch.manual_seed(0)
        model = _gpt2()
        assert tied(model), f"{engine}: GPT2LMHeadModel built untied"
        fs, mp = _fully_shard(engine), _mp(engine, bf16)
        for block in model.transformer.h:
            fs(block, mesh=mesh, mp_policy=mp)
        fs(model, mesh=mesh, mp_policy=mp)
        assert tied(model), f"{engine}: fully_shard untied lm_head.weight and wte.weight"
        assert isinstance(model.transformer.wte.weight, DTensor), engine
        assert "lm_head.weight" not in dict(model.named_parameters()), engine
        dtypes = _record_weight_dtypes(
            {"c_attn": model.transformer.h[0].attn.c_attn, "lm_head": model.lm_head}
        )
        tied_in_forward: list[bool] = []  # the head computes with the unsharded embedding
        model.lm_head.register_forward_pre_hook(
            lambda m, _, seen=tied_in_forward, wte=model.transformer.wte: seen.append(
                m.weight is wte.weight and not isinstance(m.weight, DTensor)
            )
        )
        results[engine] = _run(model, STEPS, sharded=True)
        want = torch.bfloat16 if bf16 else torch.float32
        assert dtypes == {k: [want] * STEPS for k in dtypes}, (engine, dtypes)
        assert tied_in_forward == [True] * STEPS, (engine, tied_in_forward)
        assert tied(model), f"{engine}: training untied lm_head.weight and wte.weight"
    torch.manual_seed(0)
    reference = _run(_gpt2(), STEPS, sharded=False)
    _compare(results, reference, tol=5e-3 if bf16 else 1e-5, param_tol=None if bf16 else 1e-3)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_gpt2_tied_embeddings_parity(bf16: bool) -> None:
    run_on_ranks(2, _gpt2_tied_case, bf16)
