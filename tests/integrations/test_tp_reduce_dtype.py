"""The tensor-parallel ``Partial`` gradient's all-reduce in the policy's ``reduce_dtype``
(pytorch issue 190626, PR 190627), on a 2x2 ``(dp, tp)`` gloo mesh with sequence-parallel
norms (their gradients come out of backward ``Partial`` over the TP mesh, which fsdp2
all-reduces before its reduce-scatter).

With ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` every all-reduce a
synced backward issues over the TP mesh sums fp32 gradients, as the reduce-scatter does
(torch 2.13's FSDP2 sums them in bf16); a no-sync backward all-reduces nothing (the sums stay
``Partial``, fp32) and the next synced one all-reduces them in fp32. The reduce-scatter then
packs fp32 and bf16 gradients of one group: checked against packing them all as fp32.
"""

from __future__ import annotations

from typing import Any

import torch
from _harness import run_on_ranks
from models import shard_model
from torch.utils._python_dispatch import TorchDispatchMode
from tp_models import TPModel, make_meshes, parallelize, tp_batch, tp_loss

import fsdp2
from fsdp2._core.comm.transport import pack_for_reduce_scatter

WORLD_SIZE = 4


class _AllReduceDtypes(TorchDispatchMode):
    """The dtypes of the functional all-reduces (DTensor's redistributions) run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops._c10d_functional.all_reduce.default:
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def _dtypes() -> dict[str, list[str]]:
    _, dp_mesh, tp_mesh = make_meshes("fsdp2x2")
    torch.manual_seed(0)
    model = parallelize(TPModel(), tp_mesh, "tp_sp")
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_model(model, fsdp2.fully_shard, dp_mesh, mp_policy=policy)
    out = {}
    for i, sync in enumerate((True, False, True)):  # the no-sync sum reduced by the last
        model.set_requires_gradient_sync(sync)
        x, y = tp_batch(i)
        loss = tp_loss(model, x, y)
        with _AllReduceDtypes() as spy:
            loss.backward()
        out[f"{i}: sync={sync}"] = sorted({str(d) for d in spy.dtypes})
    return out


def test_tp_partial_all_reduce_in_reduce_dtype() -> None:
    fp32 = ["torch.float32"]
    for out in run_on_ranks(WORLD_SIZE, _dtypes):
        # no-sync backwards keep the Partial sums: the next synced one all-reduces them
        assert out == {"0: sync=True": fp32, "1: sync=False": [], "2: sync=True": fp32}, out


def test_pack_gradients_of_several_dtypes() -> None:
    """The reduce-scatter's packing with fp32 (all-reduced in fp32) and bf16 gradients in one
    group: the same rows as packing them all cast to fp32 first."""
    torch.manual_seed(0)
    grads = [
        torch.randn(5, 3).bfloat16(),
        torch.randn(4).float(),
        torch.randn(3, 2).float(),
        torch.randn(7).bfloat16(),
    ]
    got = pack_for_reduce_scatter(grads, 2, torch.float32)
    want = pack_for_reduce_scatter([g.float() for g in grads], 2, torch.float32)
    assert torch.equal(got, want)
