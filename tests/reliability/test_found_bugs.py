"""Regression tests for three traps a new user met (issue 30), each against torch's FSDP2
where torch has the feature. 2 gloo CPU ranks, ``MLPStack`` from ``helpers.NAME``.

* ``set_all_reduce_hook(hook, stream=torch.cpu.Stream())`` on a CPU mesh: the hook runs, on
  the given stream (``torch.cpu.current_stream()`` inside it is that stream), once per
  backward per module, and the gradients equal the replicated reference's and torch's
  bitwise (torch's FSDP2 runs such a hook too). It once failed in backward with
  "Accelerator expected" (the current stream was asked of ``torch.accelerator``).
* A 2D mesh without ``mesh_dim_names``: torch's ``fully_shard`` refuses it (an
  ``AssertionError``), fsdp2 raises ``ValueError`` naming ``mesh_dim_names`` and the fix,
  before any collective (only rank 0 calls it); the same mesh with names trains
  (see [Note: unnamed 2D meshes] in fsdp2/_core/support/mesh.py).
* ``save_full_checkpoint`` of a Hugging Face model writes its ``config.json`` beside the
  weights, so ``from_pretrained(path)`` builds the saved model (here a tiny Llama, hidden
  size 32), not transformers' default configuration (a 7B Llama, which was OOM-killed);
  ``config=False`` writes weights only; a model without a config writes none.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks
from helpers import (
    ENGINES,
    NAME,
    check_grads,
    check_same,
    expect_raises,
    fsdp_modules,
    grads_of,
    sharded,
    step_all,
    world_mesh,
)
from models import build, hf_llama_config
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.checkpoint import save_full_checkpoint


def _cpu_stream_hook() -> None:
    ref = build(NAME)
    models = {engine: sharded(engine, NAME, world_mesh()) for engine in ENGINES}
    on_stream: dict[str, list[bool]] = {}
    for engine, model in models.items():
        seen = on_stream[engine] = []
        for m in fsdp_modules(model):
            stream = torch.cpu.Stream()

            def hook(t: torch.Tensor, s: torch.cpu.Stream = stream, seen=seen) -> None:
                seen.append(torch.cpu.current_stream() is s)

            m.set_all_reduce_hook(hook, stream=stream)
    for step in range(2):
        step_all(models, ref, NAME, step)
        grads = check_grads(models, grads_of(ref), f"step {step}")
        check_same(grads["fsdp2"], grads["torch"], f"step {step} fsdp2 vs torch", bitwise=True)
        for model in (ref, *models.values()):
            model.zero_grad()
    n = len(fsdp_modules(models["fsdp2"]))
    for engine, seen in on_stream.items():
        assert seen == [True] * (2 * n), (
            f"{engine}: hook calls on the given stream: {seen}, want {2 * n} calls, all on it"
        )


def test_all_reduce_hook_on_cpu_stream() -> None:
    run_on_ranks(2, _cpu_stream_hook)


def _unnamed_2d_mesh() -> None:
    unnamed = init_device_mesh("cpu", (1, 2))
    named = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    if dist.get_rank() == 0:  # no collective may run: rank 1 is not in the call
        with expect_raises("torch", AssertionError, match="mesh_dim_names"):
            ENGINES["torch"](build(NAME), mesh=unnamed)
        with expect_raises("fsdp2", ValueError, match=r"without mesh_dim_names.*'replicate'"):
            fsdp2.fully_shard(build(NAME), mesh=unnamed)
        with expect_raises("fsdp2 block", ValueError, match="mesh_dim_names"):
            fsdp2.fully_shard(build(NAME).layers[0], mesh=unnamed)
    dist.barrier()
    model = fsdp2.fully_shard(build(NAME), mesh=named)
    model(torch.randn(4, 7)).sum().backward()


def test_unnamed_2d_mesh_rejected_like_torch() -> None:
    run_on_ranks(2, _unnamed_2d_mesh, timeout=60)


def _hf_config_saved(root: str) -> None:
    import transformers
    from transformers import LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    cfg = hf_llama_config(99)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        fsdp2.fully_shard(layer, mesh=world_mesh())
    fsdp2.fully_shard(model, mesh=world_mesh())
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    with_cfg, without = os.path.join(root, "with"), os.path.join(root, "without")
    save_full_checkpoint(model, with_cfg)
    save_full_checkpoint(model, without, config=False)
    plain = os.path.join(root, "plain")
    save_full_checkpoint(sharded("fsdp2", NAME), plain)
    if dist.get_rank() == 0:
        assert "config.json" not in os.listdir(without), os.listdir(without)
        assert "config.json" not in os.listdir(plain), os.listdir(plain)
        with open(os.path.join(with_cfg, "config.json")) as f:
            assert json.load(f)["hidden_size"] == 32
        loaded = LlamaForCausalLM.from_pretrained(with_cfg)
        assert loaded.config.hidden_size == 32 and loaded.config.num_hidden_layers == 2
        for name, p in loaded.named_parameters():
            assert torch.equal(p, full[name]), f"from_pretrained: {name} differs"
    dist.barrier()


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="a test extra")
def test_save_full_checkpoint_writes_hf_config(tmp_path) -> None:
    run_on_ranks(2, _hf_config_saved, str(tmp_path))
