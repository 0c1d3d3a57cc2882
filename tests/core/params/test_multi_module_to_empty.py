"""One ``fully_shard`` call over several sibling modules, converted after sharding.

``fully_shard([model.norm, model.output])`` (torchtitan's ``fully_shard([model.norm,
model.lm_head])``) makes one group over two modules that ``nn.Module._apply`` converts one
after the other, so the group is half converted in between ([Note: conversion across modules]
in fsdp2/_core/runtime/relayout.py). On a tiny ``fsdp2.models.Llama`` built on meta, on 1 and 2 gloo
ranks, with ``fsdp2`` and torch's ``fully_shard`` side by side:

* ``model.to_empty(device="cpu")`` then ``init_weights()`` under one seed gives every
  parameter the same values with both engines (bitwise), keeping each parameter object;
* one AdamW step on the same batch then gives the same loss, full gradients and full
  parameters (bitwise);
* fsdp2 only (torch's FSDP2 fails on ``.to(dtype)`` after sharding): converting the two
  modules one at a time works, ``model.double()`` gives float64 parameters that train, and a
  forward after converting only one of them raises ``ValueError`` naming the group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from helpers import ENGINES, check_same, mine, world_mesh
from models import full_grads, full_params

from fsdp2.models import Llama, LlamaConfig

VOCAB, SEQ, BATCH = 37, 8, 4


def _meta_llama(engine: str) -> nn.Module:
    """A 2-layer Llama on meta, sharded as torchtitan does: each block, then the final norm
    and the output head in one call, then the root."""
    cfg = LlamaConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=16)
    with torch.device("meta"):
        model = Llama(cfg)
    shard, mesh = ENGINES[engine], world_mesh()
    for block in model.layers:
        shard(block, mesh=mesh)
    shard([model.norm, model.output], mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return mine(tokens[:, :-1]), mine(tokens[:, 1:])


def _init_and_step(engine: str) -> dict[str, dict[str, torch.Tensor]]:
    model = _meta_llama(engine)
    before = [id(p) for p in model.parameters()]
    model.to_empty(device="cpu")
    assert [id(p) for p in model.parameters()] == before, f"{engine}: parameters replaced"
    torch.manual_seed(0)
    model.init_weights()
    init = full_params(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    x, y = _batch()
    loss = model(x, y)
    loss.backward()
    grads = full_grads(model)
    optim.step()
    return {
        "init": init,
        "loss": {"loss": loss.detach()},
        "grads": {n: g for n, g in grads.items() if g is not None},
        "params": full_params(model),
    }


def _to_empty_parity() -> None:
    ours, theirs = (_init_and_step(engine) for engine in ("fsdp2", "torch"))
    for what in ("init", "loss", "grads", "params"):
        check_same(ours[what], theirs[what], f"fsdp2 vs torch, {what}", bitwise=True)


def _convert_in_parts() -> None:
    model = _meta_llama("fsdp2")
    for child in model.children():  # the root's own parameters first, then norm, output
        child.to_empty(device="cpu")
    model.to_empty(device="cpu")  # the root's buffers (rope)
    torch.manual_seed(0)
    model.init_weights()
    x, y = _batch()
    loss32 = model(x, y).detach()
    model.norm.double()
    with pytest.raises(ValueError, match="reached only some of the modules"):
        model(x, y)
    model.double()
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    norm, head = model.norm.weight.to_local(), model.output.weight.to_local()
    assert norm.untyped_storage().data_ptr() == head.untyped_storage().data_ptr(), (
        "norm and output should share the group's flat buffer again"
    )
    loss = model(x, y)
    torch.testing.assert_close(loss.detach().float(), loss32, atol=1e-5, rtol=1e-5)
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert all(torch.isfinite(p.full_tensor()).all() for p in model.parameters())
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 2])
def test_to_empty_matches_torch(world_size: int) -> None:
    run_on_ranks(world_size, _to_empty_parity)


def test_conversion_in_parts() -> None:
    run_on_ranks(2, _convert_in_parts)
