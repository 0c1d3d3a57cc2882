"""The shared test helpers' own promises, on 2 and 4 gloo ranks, per engine.

``models.full_params`` / ``full_grads`` gather the DTensors sharded on dim 0 in one all-gather
per process group and dtype (``models.full_values``): their values must equal DTensor's
``full_tensor()`` bitwise (same dtype, same shape, contiguous) for FSDP and HSDP meshes, uneven
and empty shards, fp32 and bf16 parameters, gradients that are ``None`` (a frozen block), and
tensor-parallel parameters (which go through ``full_tensor()`` itself). They must issue no
collective ``comm_counter.CommCounter`` sees, since tests compare gradients inside counted
regions.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from comm_counter import CommCounter
from helpers import ENGINES, hsdp_mesh, mine, world_mesh
from models import build, full_grads, full_params, local_loss, make_batch, shard_model
from tp_models import build_tp_model, make_meshes, parallelize


def _check_against_full_tensor(model: nn.Module, what: str) -> None:
    with CommCounter() as counter:
        params, grads = full_params(model), full_grads(model)
    assert not counter.calls, f"{what}: collectives seen by CommCounter: {counter.calls}"
    for n, p in model.named_parameters():
        pairs = [("param", params[n], p.full_tensor())]
        if p.grad is None:
            assert grads[n] is None, f"{what}: grad of {n} is not None"
        else:
            pairs.append(("grad", grads[n], p.grad.full_tensor()))
        for kind, got, want in pairs:
            assert got.dtype == want.dtype and got.shape == want.shape, (
                f"{what}: {kind} of {n} is {got.dtype} {tuple(got.shape)}, "
                f"want {want.dtype} {tuple(want.shape)}"
            )
            assert got.is_contiguous(), f"{what}: {kind} of {n} is not contiguous"
            assert torch.equal(got, want), f"{what}: {kind} of {n} differs from full_tensor()"


def _full_values(engine: str) -> None:
    ws = dist.get_world_size()
    meshes = {"fsdp": world_mesh()}
    if ws == 4:
        meshes["hsdp"] = hsdp_mesh((2, 2))
    for mesh_name, mesh in meshes.items():
        for name in ("mlp_head", "transformer"):
            what = f"{engine} {mesh_name} {name}"
            model = build(name)
            model.layers[0].requires_grad_(False)  # None gradients in the middle
            shard_model(model, ENGINES[engine], mesh)
            x, y = make_batch(name, 0)
            local_loss(model, name, mine(x), mine(y)).backward()
            _check_against_full_tensor(model, what)
        bf16 = shard_model(build("mlp").to(torch.bfloat16), ENGINES[engine], mesh)
        _check_against_full_tensor(bf16, f"{engine} {mesh_name} bf16")
    if ws == 4:  # FSDP + TP: strided and TP placements go through full_tensor()
        mesh, dp_mesh, tp_mesh = make_meshes("fsdp2x2")
        tp = shard_model(parallelize(build_tp_model(), tp_mesh, "tp"), ENGINES[engine], dp_mesh)
        _check_against_full_tensor(tp, f"{engine} fsdp+tp")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_full_params_and_grads_equal_full_tensor(engine: str, world_size: int) -> None:
    run_on_ranks(world_size, _full_values, engine)
