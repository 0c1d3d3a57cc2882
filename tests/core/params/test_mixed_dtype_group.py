"""Parameters of several dtypes in one ``fully_shard`` group (fp32 norms beside bf16 weights):
torch's FSDP2 2.13 and 2.14 assert one dtype (pytorch issue 156784; PR 194434 lifts it, open).
See [Note: other dtypes] and [Note: gradient dtypes] in fsdp2/_core/params/dtypes.py.

* Parity, 2 ranks (and HSDP on 2 x 2): blocks of a bf16 ``Linear`` (7 rows: uneven) and an
  fp32 ``LayerNorm``, each one group, and a root group of an fp32 head and a bf16 scale, train
  as a replica (each rank's batch slice, the gradients averaged by hand in the reduction's
  dtype and cast to the parameter's; teacher-forced: the replica starts each step from the
  sharded parameters): losses and gradients each step, the parameters after the replica's SGD
  step of the same gradients (within a bf16 rounding); every gradient in its parameter's
  dtype. Each group does one all-gather per unshard and one reduce-scatter per backward, in
  the gradients' promoted dtype (fp32), or in ``reduce_dtype`` (bf16) when set.
* ``module.to(torch.bfloat16)`` makes such a group uniform; it trains on, every gradient bf16.
* torch's FSDP2 (2.13, 2.14) raises ``AssertionError`` on the same block at its first forward.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from comm_counter import spy_all_gathers, spy_reduce_scatters
from helpers import hsdp_mesh, mine, world_mesh
from models import full_grads, full_params
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fsdp2 import MixedPrecisionPolicy, fully_shard
from fsdp2._core.support.compat import TORCH_VERSION

BF16, FP32 = torch.bfloat16, torch.float32
STEPS = 3


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(7, 7).to(BF16)
        self.norm = nn.LayerNorm(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.lin(x.to(self.lin.weight.dtype))).to(self.norm.weight.dtype))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(7, 1)
        self.scale = nn.Parameter(torch.rand(7).to(BF16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.scale.to(x.dtype))


def _shard(model: _Net, mp: MixedPrecisionPolicy, hsdp: bool) -> None:
    mesh = hsdp_mesh((2, 2)) if hsdp else world_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 7, generator=g), torch.randn(4, 1, generator=g)


def _reference_grads(
    ref: nn.Module, x: torch.Tensor, y: torch.Tensor, reduce_dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """Each rank's slice through the replica, the gradients averaged in the reduction's dtype
    (``reduce_dtype``, else fp32: the promoted dtype of bf16 and fp32) and cast back."""
    world = torch.distributed.get_world_size()
    n = x.size(0) // world
    total: dict[str, torch.Tensor] = {}
    for r in range(world):
        ref.zero_grad(set_to_none=True)
        F.mse_loss(ref(x[r * n : (r + 1) * n]), y[r * n : (r + 1) * n]).backward()
        for name, p in ref.named_parameters():
            g = p.grad.to(reduce_dtype or FP32)
            total[name] = g if name not in total else total[name] + g
    return {
        name: (g / world).to(dict(ref.named_parameters())[name].dtype) for name, g in total.items()
    }


def _train(reduce_dtype: torch.dtype | None, hsdp: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    _shard(model, MixedPrecisionPolicy(reduce_dtype=reduce_dtype), hsdp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    wires: list[torch.dtype] = []
    gathers: list[torch.dtype] = []
    out: dict[str, Any] = {"losses": [], "ref_losses": [], "grads": [], "ref_grads": []}
    for step in range(STEPS):
        x, y = _batch(step)
        # teacher forcing: the replica starts each step from the sharded parameters (an
        # update of a bf16 shard, a view at an offset of the flat buffer, may round the other
        # way than the whole tensor's: CPU kernels take a scalar path for unaligned heads)
        ref.load_state_dict(full_params(model))
        with (
            spy_reduce_scatters(lambda t, op, group: wires.append(t.dtype)),
            spy_all_gathers(lambda t, group: gathers.append(t.dtype)),
        ):
            loss = F.mse_loss(model(mine(x)), mine(y))
            loss.backward()
        out["losses"].append(loss.detach())
        ref_grads = _reference_grads(ref, x, y, reduce_dtype)
        with torch.no_grad():
            out["ref_losses"].append(F.mse_loss(ref(mine(x)), mine(y)))
        for name, p in model.named_parameters():
            assert p.grad.dtype == p.dtype, (name, p.grad.dtype, p.dtype)
            assert p.grad._spec.tensor_meta.dtype == p.dtype, name
        out["grads"].append(full_grads(model))
        out["ref_grads"].append(ref_grads)
        for name, p in ref.named_parameters():
            p.grad = ref_grads[name].clone()  # (kept apart: .to() converts grads in place)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    # 3 groups reduce-scatter once per step; the blocks gather in forward and backward, the
    # root (kept unsharded from forward to backward) once
    assert len(wires) == 3 * STEPS and len(gathers) == 5 * STEPS, (wires, gathers)
    out["wires"] = sorted({str(d) for d in wires})
    out["params"] = full_params(model)
    out["ref_params"] = {n: p.detach() for n, p in ref.named_parameters()}
    out["converted"] = _converted(model, ref)
    out["torch"] = _torch_refuses() if not hsdp and reduce_dtype is None else None
    return out


def _torch_refuses() -> str:
    """torch's FSDP2 on the same block: its lazy init asserts one dtype (2.13, 2.14)."""
    block = _Block()
    torch_fully_shard(block, mesh=world_mesh())
    try:
        block(torch.ones(2, 7))
    except AssertionError as e:
        return str(e)
    return ""


def _converted(model: nn.Module, ref: nn.Module) -> dict[str, torch.Tensor | None]:
    """``.to(bf16)``: the groups become uniform and train on (a step's gradients, bf16)."""
    ref.load_state_dict(full_params(model))
    model.to(BF16)
    ref.to(BF16)
    x, y = _batch(STEPS)
    F.mse_loss(model(mine(x.to(BF16))), mine(y.to(BF16))).backward()
    grads = full_grads(model)
    want = _reference_grads(ref, x.to(BF16), y.to(BF16), None)
    for name, g in grads.items():
        assert g is not None and g.dtype == BF16, name
        torch.testing.assert_close(g, want[name], rtol=2**-6, atol=2**-7)
    return grads


@pytest.mark.parametrize(
    "reduce_dtype, hsdp",
    [(None, False), (BF16, False), (None, True)],
    ids=["promoted", "reduce_bf16", "hsdp_promoted"],
)
def test_mixed_dtype_group_trains_as_reference(
    reduce_dtype: torch.dtype | None, hsdp: bool
) -> None:
    for res in run_on_ranks(4 if hsdp else 2, _train, reduce_dtype, hsdp):
        assert res["wires"] == [str(reduce_dtype or FP32)], res["wires"]
        if res["torch"] is not None and TORCH_VERSION <= (2, 14):
            assert "uniform original parameter dtype" in res["torch"], res["torch"]
        torch.testing.assert_close(res["losses"], res["ref_losses"], rtol=1e-6, atol=0)
        for got, want in zip(res["grads"], res["ref_grads"], strict=True):
            assert list(got) == list(want)
            for name, g in got.items():
                # the same per-rank gradients, averaged in another order (fp32 or bf16)
                tol = 2**-6 if want[name].dtype == BF16 or reduce_dtype else 1e-5
                torch.testing.assert_close(g, want[name], rtol=tol, atol=tol)
        for name, want in res["ref_params"].items():
            tol = 2**-6 if want.dtype == BF16 or reduce_dtype else 1e-5
            torch.testing.assert_close(res["params"][name], want, rtol=tol, atol=tol)
