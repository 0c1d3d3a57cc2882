"""Behaviours torch's own FSDP2 tests check, each a real user path, each compared with torch's
``fully_shard`` in the same worker and with a replicated reference where one applies:

* a parameter replaced after ``fully_shard`` and before the first forward (the meta-init
  pattern ``model.w = nn.Parameter(f(other DTensor params))`` after ``to_empty``) is adopted;
  a plain tensor or a DTensor of another layout there raises ValueError naming it (torch's
  FSDP2 fails with AttributeError on a plain tensor);
* ``load_state_dict(sharded_sd, assign=True)`` into a model built on meta and sharded, where
  the root group's parameters belong to several modules loaded one after another;
* activation checkpointing: the recompute in backward applies ``output_dtype`` like the
  forward did;
* a group mixing frozen parameters of other dtypes (bf16, float8) with fp32 trainable ones
  trains, with and without mixed precision; trainable parameters of two dtypes still raise.
"""

from __future__ import annotations

import models
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from helpers import check_close_run, check_same_run, world_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

import fsdp2

ENGINES = {
    "fsdp2": (fsdp2.fully_shard, fsdp2.MixedPrecisionPolicy),
    "torch": (torch_fully_shard, TorchMP),
}
STEPS = 3


def _steps(model: nn.Module, name: str, run=None, params=None) -> list[float]:
    """AdamW steps on each rank's slice of the global batches; rank-averaged losses."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    opt = models.make_optimizer("adamw", params if params is not None else model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = models.make_batch(name, step)
        x, y = models.rank_slice(x, rank, ws), models.rank_slice(y, rank, ws)
        loss = models.local_loss(run or model, name, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(models.mean_over_ranks(loss).item())
    return losses


def _reference(model: nn.Module, name: str) -> list[float]:
    """The same steps unsharded on the global batch (equal to averaging the ranks' grads)."""
    opt = models.make_optimizer("adamw", model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = models.make_batch(name, step)
        loss = models.local_loss(model, name, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _copy_from(model: nn.Module, source: nn.Module) -> None:
    """Give a sharded model ``source``'s values (works for both engines' DTensors)."""
    src = dict(source.named_parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(distribute_tensor(src[n].detach(), p.device_mesh, p.placements))


# ---------------------------------------------------------------------------------------------
# A parameter replaced after fully_shard, before the first forward


def _replaced(engine: str) -> dict:
    shard, _ = ENGINES[engine]
    torch.manual_seed(0)
    source = models.TinyTransformer(tied=False)
    with torch.device("meta"):
        model = models.TinyTransformer(tied=False)
    models.shard_model(model, shard, world_mesh())
    model.to_empty(device="cpu")
    _copy_from(model, source)
    # The meta-init pattern: a parameter computed from other (sharded) parameters.
    with torch.no_grad():
        new = nn.Parameter(model.norm.weight.detach() * 2 + model.head.weight[0, 0])
        source.norm.weight.mul_(2).add_(source.head.weight[0, 0])
    assert isinstance(new, DTensor)
    model.norm.weight = new
    losses = _steps(model, "transformer")  # the optimizer is built before the first forward
    assert model.norm.weight is new, "the assigned parameter object is the one trained"
    return {
        "losses": losses,
        "params": models.full_params(model),
        "ref": _reference(source, "transformer"),
    }


def _replaced_both() -> dict:
    return {e: _replaced(e) for e in ENGINES}


def test_param_replaced_before_first_forward() -> None:
    res = run_on_ranks(2, _replaced_both)[0]
    check_close_run(res["fsdp2"], {"losses": res["fsdp2"]["ref"]}, "fsdp2 vs reference")
    check_same_run(res["fsdp2"], res["torch"])


def _replaced_badly(how: str) -> str:
    model = models.build("transformer")
    models.shard_model(model, fsdp2.fully_shard, world_mesh())
    if how == "plain":
        model.norm.weight = nn.Parameter(torch.ones(24))
    else:  # a DTensor replicated instead of sharded
        model.norm.weight = nn.Parameter(distribute_tensor(torch.ones(24), world_mesh()))
    try:
        _steps(model, "transformer")
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("how", ["plain", "replicated"])
def test_param_replaced_by_other_layout_raises(how: str) -> None:
    for msg in run_on_ranks(2, _replaced_badly, how):
        assert "norm.weight" in msg and "Shard(dim=0)" in msg, msg


# ---------------------------------------------------------------------------------------------
# load_state_dict(assign=True) into a meta-device sharded model


def _assign_into_meta(engine: str) -> dict:
    shard, _ = ENGINES[engine]
    mesh = world_mesh()
    torch.manual_seed(0)
    src = models.TinyTransformer(tied=False)
    ref = models.TinyTransformer(tied=False)
    ref.load_state_dict(src.state_dict())
    models.shard_model(src, shard, mesh)
    sd = {k: v.detach().clone() for k, v in src.state_dict().items()}
    with torch.device("meta"):
        model = models.TinyTransformer(tied=False)
    models.shard_model(model, shard, mesh)
    # The root group's parameters live on tok_emb, pos_emb, norm and head, whose load
    # hooks run one after another: the first runs while the others are still on meta.
    model.load_state_dict(sd, assign=True)
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor) and not p.is_meta, n
    losses = _steps(model, "transformer")
    return {
        "losses": losses,
        "params": models.full_params(model),
        "ref": _reference(ref, "transformer"),
    }


def _assign_both() -> dict:
    return {e: _assign_into_meta(e) for e in ENGINES}


def test_load_state_dict_assign_into_meta_sharded_model() -> None:
    res = run_on_ranks(2, _assign_both)[0]
    check_same_run(res["fsdp2"], res["torch"])
    check_close_run(res["fsdp2"], {"losses": res["fsdp2"]["ref"]}, "fsdp2 vs reference")


# ---------------------------------------------------------------------------------------------
# Activation checkpointing and output_dtype


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * x)  # saves x: its dtype must match between forward and recompute


class _ACNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(7, 8), nn.GELU())
        self.head = _Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda t: self.head(self.block(t)), x, use_reentrant=False)


def _ac_output_dtype(engine: str) -> dict:
    shard, mp = ENGINES[engine]
    torch.manual_seed(0)
    model = _ACNet()
    seen: list[torch.dtype] = []
    shard(
        model.block,
        mesh=world_mesh(),
        mp_policy=mp(param_dtype=torch.bfloat16, output_dtype=torch.float32),
    )
    shard(model, mesh=world_mesh())
    model.head.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    losses = _steps(model, "mlp")
    return {"losses": losses, "params": models.full_params(model), "seen": seen}


def _ac_both() -> dict:
    return {e: _ac_output_dtype(e) for e in ENGINES}


def test_activation_checkpoint_recompute_applies_output_dtype() -> None:
    res = run_on_ranks(2, _ac_both)[0]
    ours, theirs = res["fsdp2"], res["torch"]
    # forward and recompute of each step both see fp32 (output_dtype)
    assert ours["seen"] == [torch.float32] * (2 * STEPS), ours["seen"]
    assert ours["seen"] == theirs["seen"], f"fsdp2 {ours['seen']}, torch {theirs['seen']}"
    check_same_run(ours, theirs)


# ---------------------------------------------------------------------------------------------
# Frozen parameters of another dtype in a group


class _Frozen(nn.Module):
    """Trainable fp32 Linears and, in the same group, frozen weights of other dtypes
    (an uneven 5-row bf16 one, and a float8 one)."""

    def __init__(self, frozen_dtype: torch.dtype) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 5)
        self.frozen = nn.Parameter(torch.randn(5, 5).to(frozen_dtype), requires_grad=False)
        self.scale = nn.Parameter(torch.rand(5).to(torch.bfloat16), requires_grad=False)
        self.out = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h @ self.frozen.to(h.dtype) * self.scale.to(h.dtype)
        return self.out(F.gelu(h))


def _frozen_other_dtype(engine: str, frozen_dtype: torch.dtype, bf16: bool) -> dict:
    shard, mp = ENGINES[engine]
    torch.manual_seed(0)
    model = _Frozen(frozen_dtype)
    kw = {"mp_policy": mp(param_dtype=torch.bfloat16)} if bf16 else {}
    shard(model, mesh=world_mesh(), **kw)
    before = _local_bytes(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    losses = _steps(model, "mlp", params=trainable)
    after = _local_bytes(model)
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor), n
        if not p.requires_grad:
            assert torch.equal(after[n], before[n]), f"frozen {n} changed"
    return {"losses": losses, "params": after}


def _local_bytes(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's local shard as bytes (gloo cannot gather float8)."""
    return {
        n: p.to_local().detach().clone().contiguous().view(torch.uint8)
        for n, p in model.named_parameters()
    }


def _frozen_both(frozen_dtype: torch.dtype, bf16: bool) -> dict:
    return {e: _frozen_other_dtype(e, frozen_dtype, bf16) for e in ENGINES}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "frozen_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16w", "f8w"]
)
def test_frozen_params_of_other_dtypes(frozen_dtype: torch.dtype, bf16: bool) -> None:
    for rank, res in enumerate(run_on_ranks(2, _frozen_both, frozen_dtype, bf16)):
        check_same_run(res["fsdp2"], res["torch"], f"rank {rank} fsdp2 vs torch")
    if not bf16:  # the unsharded reference (mixed precision is covered by torch's numbers)
        torch.manual_seed(0)
        ref = _Frozen(frozen_dtype)
        want = _reference_frozen(ref)
        check_close_run(res["fsdp2"], {"losses": want}, "fsdp2 vs reference")


def _reference_frozen(model: nn.Module) -> list[float]:
    opt = models.make_optimizer("adamw", [p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(STEPS):
        x, y = models.make_batch("mlp", step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
