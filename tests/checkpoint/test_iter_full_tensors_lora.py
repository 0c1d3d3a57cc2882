"""``iter_full_tensors(merge_lora=True)``: a PEFT LoRA model streamed as PEFT's
``merge_and_unload()`` would leave it, without unsharding the model (issue 39).

Each case builds one PEFT model, keeps an unsharded copy, shards the other with
``fully_shard`` (2 and 3 ranks: the rank-4 adapters split 2/2/0 over 3), and checks that
the stream yields the merged copy's ``state_dict()``: the same names in the same order,
every tensor PEFT did not touch bitwise, every merged one within fp32 rounding (each rank
multiplies only its own rows, a different matmul shape than PEFT's); in bf16 the merged
copy cast. The model itself is left unmerged. Cases:

* Llama, LoRA on every linear and on the embedding (transposed terms), ``lm_head`` in
  ``modules_to_save``, random non-zero ``B`` (``init_lora_weights=False``), tied and
  untied embeddings;
* LoRA biases (``lora_bias=True``, attention biases on);
* two active adapters (both merged, in order) and an adapter merged beforehand (not
  added twice);
* GPT-2 (``Conv1D``: ``fan_in_fan_out``), where each rank's rows are columns of ``A``;
* errors before any collective: DoRA, a model with no LoRA layer.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks
from comm_counter import CommCounter
from helpers import world_mesh
from models import hf_llama_config

from fsdp2 import fully_shard
from fsdp2.checkpoint import iter_full_tensors

pytest.importorskip("transformers", reason="transformers is a test extra")
if importlib.util.find_spec("peft") is None:  # (importing it here costs the collection ~1 s)
    pytest.skip("peft is a test extra", allow_module_level=True)

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llama(case: str) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    tied = case == "tied"
    cfg = hf_llama_config(
        251,
        intermediate_size=66,
        tie_word_embeddings=tied,
        attention_bias=case == "bias",
        mlp_bias=case == "bias",
    )
    model = LlamaForCausalLM(cfg)
    lora = {
        "r": 4,
        "lora_alpha": 8,
        "init_lora_weights": False,  # B random: the merge changes every weight
        "target_modules": LINEARS + ([] if tied or case == "bias" else ["embed_tokens"]),
        "modules_to_save": [] if tied or case == "two" else ["lm_head"],
        "lora_bias": case == "bias",
    }
    model = get_peft_model(model, LoraConfig(**lora))
    if case == "two":
        model.add_adapter("second", LoraConfig(**(lora | {"r": 2, "lora_alpha": 6})))
        model.base_model.set_adapter(["default", "second"])
        model.base_model.model.model.layers[0].self_attn.q_proj.merge(adapter_names=["second"])
    return model


def _gpt2() -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=251, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    lora = LoraConfig(
        r=4,
        target_modules=["c_attn", "c_proj", "c_fc"],
        fan_in_fan_out=True,
        init_lora_weights=False,
    )
    return get_peft_model(GPT2LMHeadModel(cfg), lora)


def _blocks(model: Any) -> list[Any]:
    base = model.base_model.model
    return list(base.transformer.h) if hasattr(base, "transformer") else list(base.model.layers)


def _check(model: Any, case: str) -> dict[str, Any]:
    ref_model = copy.deepcopy(model).merge_and_unload()
    ref = ref_model.state_dict()
    unmerged = copy.deepcopy(model).unload().state_dict()  # what the merge changed:
    changed = sum(not torch.equal(ref[k], unmerged[k]) for k in ref)
    mesh = world_mesh()
    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = {k: v.full_tensor() for k, v in model.state_dict().items()}
    with CommCounter() as counter:
        got = list(iter_full_tensors(model, merge_lora=True))
    names = [n for n, _ in got]
    first: dict[int, str] = {}
    tied = {}  # a tied name -> its first name, which it comes right after
    for name, t in ref_model.state_dict(keep_vars=True).items():
        if id(t) in first:
            tied[name] = first[id(t)]
        first.setdefault(id(t), name)
    for name, to in tied.items():
        assert names[names.index(to) + 1] == name, (case, name)
    assert [n for n in names if n not in tied] == [n for n in ref if n not in tied], case
    assert sorted(names) == sorted(ref), case
    for name, t in got:
        assert t.dtype == ref[name].dtype and t.shape == ref[name].shape, (case, name)
        torch.testing.assert_close(t, ref[name], rtol=1e-5, atol=1e-6, msg=f"{case} {name}")
    for name, t in iter_full_tensors(model, merge_lora=True, dtype=torch.bfloat16):
        torch.testing.assert_close(t, ref[name].to(torch.bfloat16), msg=f"{case} bf16 {name}")
    small = dict(iter_full_tensors(model, merge_lora=True, bucket_bytes=2048, ranks=[0]))
    if dist.get_rank() == 0:
        for name, t in small.items():
            torch.testing.assert_close(t, ref[name], rtol=1e-5, atol=1e-6)
    else:
        assert not small
    after = {k: v.full_tensor() for k, v in model.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before), "the model was changed"
    return {"changed": changed, "gathers": len([c for c in counter.calls if c.kind == "AG"])}


def _cases() -> dict[str, Any]:
    out = {case: _check(_llama(case), case) for case in ("untied", "tied", "bias", "two")}
    out["gpt2"] = _check(_gpt2(), "gpt2")
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_merged_lora_equals_peft_merge_and_unload(world_size: int) -> None:
    for out in run_on_ranks(world_size, _cases):
        # every LoRA'd weight changed (2 layers x 7 linears, + the embedding untied);
        # one all-gather for the adapters, one for the model
        assert out["untied"]["changed"] >= 15, out
        assert out["tied"]["changed"] >= 14, out
        assert out["gpt2"]["changed"] >= 6, out
        for case, counts in out.items():
            assert counts["gathers"] <= 3, (case, counts)


def _errors() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    plain = LlamaForCausalLM(hf_llama_config(64))
    dora = get_peft_model(
        LlamaForCausalLM(hf_llama_config(64)),
        LoraConfig(r=2, target_modules=LINEARS, use_dora=True),
    )
    for model in (plain, dora):
        fully_shard(model, mesh=world_mesh())
    with CommCounter() as counter:
        with pytest.raises(ValueError, match="has no PEFT LoRA layer"):
            iter_full_tensors(plain, merge_lora=True)
        with pytest.raises(ValueError, match=r"q_proj uses a LoRA variant \(DoraLinearVariant"):
            iter_full_tensors(dora, merge_lora=True)
    assert not counter.calls


def test_errors_before_any_collective() -> None:
    run_on_ranks(2, _errors)
