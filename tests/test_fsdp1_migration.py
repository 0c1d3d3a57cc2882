"""The FSDP1 migration layer (``fsdp2.fsdp1``): ``shard_model`` with FSDP1's vocabulary.

* Parity: for ``FULL_SHARD``, ``SHARD_GRAD_OP``, ``NO_SHARD`` and ``HYBRID_SHARD`` (4 ranks,
  ``LOCAL_WORLD_SIZE=2``), an MLP wrapped with a module-class policy trains 3 AdamW steps; the
  rank-averaged losses and the full parameters after every step match a replicated reference
  and torch's FSDP1 (``FullyShardedDataParallel`` with ``ModuleWrapPolicy``, CPU/gloo).
* Policies: ``size_based_policy`` and a callable wrap exactly the expected modules.
* ``MixedPrecision(bf16, fp32, buffer_dtype=bf16)`` trains; buffers are bf16, except in the
  ``BatchNorm`` (its own unit, full precision).
* Errors: ``HYBRID_SHARD`` on 4 ranks with ``LOCAL_WORLD_SIZE=3``; a bad policy.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from models import (
    MLPBlock,
    build,
    local_loss,
    make_batch,
    make_optimizer,
    mean_over_ranks,
    rank_slice,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp2 import FSDPModule
from fsdp2.fsdp1 import (
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    shard_model,
    size_based_policy,
)

STEPS = 3
TOL = {"atol": 1e-5, "rtol": 1e-5}
MODEL = "mlp_head"  # blocks 7->5->3->1 (40, 18, 4 params) and a root head 1->2 (4 params)


def _check_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


def _set_local_world_size(value: int | None) -> None:
    if value is None:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    else:
        os.environ["LOCAL_WORLD_SIZE"] = str(value)


def _torch_fsdp1(model: nn.Module, strategy: str) -> nn.Module:
    kw: dict[str, object] = {}
    if strategy == "HYBRID_SHARD":
        ws = dist.get_world_size()
        kw["device_mesh"] = init_device_mesh(
            "cpu", (ws // 2, 2), mesh_dim_names=("replicate", "shard")
        )
    return FSDP1(
        model,
        auto_wrap_policy=ModuleWrapPolicy({MLPBlock}),
        sharding_strategy=TorchShardingStrategy[strategy],
        use_orig_params=True,
        device_id=torch.device("cpu"),
        **kw,
    )


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("_fsdp_wrapped_module.", "")] = t.detach().clone()
    return out


def _parity(strategy: str) -> list[tuple[str, float, float]]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    _set_local_world_size(2 if strategy == "HYBRID_SHARD" else None)
    try:
        ref = build(MODEL)
        ours = shard_model(
            build(MODEL),
            auto_wrap_policy={MLPBlock},
            sharding_strategy=ShardingStrategy[strategy],
        )
    finally:
        _set_local_world_size(None)
    models = {"ref": ref, "fsdp2": ours}
    models["torch"] = _torch_fsdp1(build(MODEL), strategy)
    opts = {k: make_optimizer("adamw", m.parameters()) for k, m in models.items()}
    units = sorted(n or "<root>" for n, m in ours.named_modules() if isinstance(m, FSDPModule))
    assert units == ["<root>", "layers.0", "layers.1", "layers.2"], units
    for step in range(STEPS):
        x, y = make_batch(MODEL, step)
        losses = {}
        for key, model in models.items():
            if key == "ref":
                loss = local_loss(model, MODEL, x, y)
                loss.backward()
                losses[key] = loss.detach()
            else:
                xs, ys = rank_slice(x, rank, ws), rank_slice(y, rank, ws)
                loss = local_loss(model, MODEL, xs, ys)
                loss.backward()
                losses[key] = mean_over_ranks(loss)
            opts[key].step()
            opts[key].zero_grad()
        for key in ("fsdp2", "torch"):
            _check_close(losses[key], losses["ref"], f"{key} loss step {step}")
        want = _full_params(ref)
        for key in ("fsdp2", "torch"):
            if key == "torch":
                with FSDP1.summon_full_params(models[key]):
                    got = _full_params(models[key])
            else:
                got = _full_params(models[key])
            assert got.keys() == want.keys(), (key, got.keys(), want.keys())
            for name in want:
                _check_close(got[name], want[name], f"{key} {name} step {step}")
    return [(k, float(v)) for k, v in losses.items()]


@pytest.mark.parametrize(
    ("world_size", "strategy"),
    [
        (ws, strategy)
        for ws in (2, 4)
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
        if strategy != "HYBRID_SHARD" or ws == 4  # 2 nodes of LOCAL_WORLD_SIZE=2 ranks
    ],
)
def test_parity_with_fsdp1(world_size: int, strategy: str) -> None:
    run_on_ranks(world_size, _parity, strategy)


def _wrapped_units(policy_name: str) -> list[str]:
    policy = {
        # children first, as FSDP1: the Linears of layers.0 (40) and layers.1 (18) are wrapped,
        # which leaves their blocks with no unwrapped parameters; layers.2 (4) stays in the root
        "size": size_based_policy(18),
        "callable": lambda m: isinstance(m, nn.Linear) and m.out_features == 2,  # the head
    }[policy_name]
    model = shard_model(build(MODEL), auto_wrap_policy=policy)
    x, y = make_batch(MODEL, 0)
    local_loss(model, MODEL, x, y).backward()
    return sorted(n or "<root>" for n, m in model.named_modules() if isinstance(m, FSDPModule))


@pytest.mark.parametrize(
    ("policy", "want"),
    [
        ("size", ["<root>", "layers.0.lin", "layers.1.lin"]),
        ("callable", ["<root>", "head"]),
    ],
)
@pytest.mark.parametrize("world_size", [2, 4])
def test_policies(world_size: int, policy: str, want: list[str]) -> None:
    assert run_on_ranks(world_size, _wrapped_units, policy) == [want] * world_size


class _ScaledBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("scale", torch.full((d,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * self.scale


class _BNNet(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ScaledBlock(d) for _ in range(2))
        self.norm = nn.BatchNorm1d(d)
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)  # its own full-precision unit; blocks cast its output back to bf16
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _mixed_precision(offload: bool) -> dict[str, str]:
    torch.manual_seed(0)
    model = shard_model(
        _BNNet(),
        auto_wrap_policy={_ScaledBlock},
        mixed_precision=MixedPrecision(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            buffer_dtype=torch.bfloat16,
            cast_forward_inputs=True,
        ),
        cpu_offload=CPUOffload(offload_params=offload),
        forward_prefetch=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert torch.isfinite(loss), loss
    assert isinstance(model.norm, FSDPModule), "BatchNorm must be its own (full precision) unit"
    for p in model.parameters():
        assert p.dtype == torch.float32, p.dtype
    return {n: str(b.dtype) for n, b in model.named_buffers()}


@pytest.mark.parametrize("offload", [False, True])
def test_mixed_precision_buffers(offload: bool) -> None:
    (bufs, _) = run_on_ranks(2, _mixed_precision, offload)
    assert bufs["blocks.0.scale"] == "torch.bfloat16", bufs
    assert bufs["blocks.1.scale"] == "torch.bfloat16", bufs
    assert bufs["norm.running_mean"] == "torch.float32", bufs  # _module_classes_to_ignore


def _hybrid_bad_split() -> str:
    _set_local_world_size(3)
    try:
        with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=3") as e:
            shard_model(build(MODEL), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    finally:
        _set_local_world_size(None)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        shard_model(build(MODEL), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    with pytest.raises(ValueError, match="auto_wrap_policy"):
        shard_model(build(MODEL), auto_wrap_policy=42)  # type: ignore[arg-type]
    return str(e.value)


def test_bad_combinations() -> None:
    msgs = run_on_ranks(4, _hybrid_bad_split)
    assert "4 ranks" in msgs[0], msgs[0]


def test_vocabulary_matches_torch() -> None:
    from torch.distributed.fsdp import api as torch_api

    assert [s.name for s in ShardingStrategy] == [s.name for s in torch_api.ShardingStrategy]
    from dataclasses import fields

    def names_defaults(cls: type) -> list[tuple[str, object]]:
        return [(f.name, f.default) for f in fields(cls)]

    assert names_defaults(MixedPrecision) == names_defaults(torch_api.MixedPrecision)
    assert names_defaults(CPUOffload) == names_defaults(torch_api.CPUOffload)
    with pytest.raises(ValueError, match="buffer_dtype"):
        MixedPrecision(buffer_dtype=torch.int32)


def test_core_does_not_import_fsdp1() -> None:
    import subprocess
    import sys

    code = (
        "import sys, fsdp2; "
        "assert 'fsdp2.fsdp1' not in sys.modules and 'fsdp1' not in fsdp2.__all__"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _ignored_and_meshes() -> dict[str, object]:
    model = build(MODEL)
    shard_model(
        model,
        auto_wrap_policy={MLPBlock},
        sharding_strategy=ShardingStrategy.NO_SHARD,
        ignored_modules=[model.head],
    )
    x, y = make_batch(MODEL, 0)
    local_loss(model, MODEL, x, y).backward()
    w = model.layers[0].lin.weight
    return {
        "head_is_dtensor": hasattr(model.head.weight, "full_tensor"),
        "head_has_grad": model.head.weight.grad is not None,
        "mesh_shape": tuple(w.device_mesh.shape),
    }


def test_ignored_modules_and_no_shard_mesh() -> None:
    out = run_on_ranks(2, _ignored_and_meshes)[0]
    assert out == {"head_is_dtensor": False, "head_has_grad": True, "mesh_shape": (2, 1)}, out
