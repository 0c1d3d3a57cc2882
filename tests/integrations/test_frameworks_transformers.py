"""transformers' own FSDP2 loading on fsdp2 (``fsdp2.integrations.using_fsdp2``): bitwise
torch's FSDP2.

``from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2))`` builds the
model, shards it with the ``fully_shard`` that transformers' ``distributed.fsdp`` imported
when it loaded (by the model's ``_fsdp_plan``: each decoder layer and the embedding free
their full weights after forward, the final norm and ``lm_head`` are one unit that keeps
them; then the root), and loads the checkpoint into the shards. One spawned 2-rank run loads
a tiny ``LlamaForCausalLM`` saved by rank 0 that way with torch's FSDP2 and then with fsdp2
under the switch, in fp32 and with ``fsdp_mixed_precision=True`` (transformers builds torch's
``MixedPrecisionPolicy``: bf16 compute, fp32 reduction), and checks:

* every unit is fsdp2's (``fsdp2.FSDPModule``) under the switch, torch's without, the same
  modules with either engine;
* the loaded parameters equal the saved ones;
* 2 steps of forward / backward / AdamW: the rank-averaged losses and the final full
  parameters are bitwise equal to torch's;
* ``save_pretrained`` (transformers gathers the full weights through torch's
  ``get_model_state_dict``) writes the trained weights, the same file as torch's.

No shim: transformers builds its mesh on the accelerator torch reports (the CPU here) and
uses the process group already initialized (the harness's gloo group).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks
from frameworks_common import ENGINES, mean_loss, rank_env, record, tiny_llama, tokens
from helpers import check_same, check_same_run
from models import full_params

import fsdp2
from fsdp2.integrations import using_fsdp2

pytest.importorskip("transformers", reason="transformers is a test extra")

STEPS = 2


def _units(model: Any) -> dict[str, str]:
    """The sharded modules and the engine of each."""
    from torch.distributed.fsdp import FSDPModule

    return {
        name: "fsdp2" if isinstance(m, fsdp2.FSDPModule) else "torch"
        for name, m in model.named_modules()
        if isinstance(m, (FSDPModule, fsdp2.FSDPModule))
    }


def _case(tmp: str, mixed_precision: bool) -> dict[str, Any]:
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    path = os.path.join(tmp, "llama")
    if dist.get_rank() == 0:
        tiny_llama().save_pretrained(path)
    dist.barrier()
    out: dict[str, Any] = {"saved": tiny_llama().state_dict()}
    for engine in ENGINES:
        with rank_env(), using_fsdp2() if engine == "fsdp2" else contextlib.nullcontext():
            config = DistributedConfig(fsdp_size=2, fsdp_mixed_precision=mixed_precision)
            model = LlamaForCausalLM.from_pretrained(path, distributed_config=config)
            out[f"{engine}-units"] = _units(model)
            out[f"{engine}-loaded"] = full_params(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = []
            for step in range(STEPS):
                ids = tokens(step)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(mean_loss(loss))
            out[engine] = record(losses, model)
            model.save_pretrained(os.path.join(tmp, engine))  # gathers the full weights
            dist.barrier()
            if dist.get_rank() == 0:
                out[f"{engine}-saved"] = load_file(os.path.join(tmp, engine, "model.safetensors"))
    return out


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["fp32", "bf16"])
def test_from_pretrained_distributed_config(tmp_path, mixed_precision: bool) -> None:
    out = run_on_ranks(2, _case, str(tmp_path), mixed_precision)[0]
    units = ["", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    for engine in ENGINES:
        assert out[f"{engine}-units"] == dict.fromkeys(units, engine), out[f"{engine}-units"]
        loaded = out[f"{engine}-loaded"]
        check_same(loaded, {n: out["saved"][n] for n in loaded}, f"{engine} loaded", bitwise=True)
    check_same_run(out["fsdp2"], out["torch"])
    check_same(out["fsdp2-saved"], out["torch-saved"], "save_pretrained", bitwise=True)
    saved, trained = out["torch-saved"], out["torch"]["params"]  # the trained weights
    assert sorted(saved) == sorted(trained), (sorted(saved), sorted(trained))
    check_same(saved, {n: trained[n] for n in saved}, "saved", bitwise=True)
