"""fully_shard's module structure and parameter registration on 2 and 4 gloo ranks.

Structure: the class swap, slicing a sharded ``nn.Sequential``, the default mesh, buffers,
the list form of ``fully_shard``.
Invariants: unsharded parameters keep their identity across steps; outside forward and
backward every registered parameter is the sharded DTensor the optimizer holds, or what
torch's FSDP2 registers for a group that is not sharded (tests/core/front/test_registration.py).
Training runs (buffers, the list form) are compared with a plain replica as
``residual_training`` describes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from helpers import WORLD_SIZES, mine, world_mesh
from models import ResidualBlock, ResidualNet
from residual_training import (
    IN,
    OUT,
    D,
    _assert_sharded_registered,
    _batch,
    _compare_training,
    _run,
    _shard_net,
)
from torch.distributed.tensor import DTensor, Shard

from fsdp2 import FSDPModule, fully_shard


class Scaled(nn.Module):
    """A Linear next to a persistent and a non-persistent buffer used in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(IN, OUT)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, OUT))
        self.register_buffer("shift", torch.full((OUT,), 0.25), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + self.shift


# ---------------------------------------------------------------------------------------------
# Structure


def _class_swap() -> None:
    mesh = world_mesh()
    model = ResidualNet()
    fully_shard(model.inp, mesh=mesh)
    fully_shard(model.out, mesh=mesh)
    _shard_net(model, mesh)
    assert type(model.inp).__name__ == "FSDPLinear"
    assert isinstance(model.inp, nn.Linear) and isinstance(model.inp, FSDPModule)
    assert type(model.inp) is type(model.out), "two Linear modules must share one FSDP class"
    assert type(model.layers[0]) is type(model.layers[1])
    assert type(model.layers[0]).__name__ == "FSDPResidualBlock"
    assert isinstance(model.layers[0], ResidualBlock)
    assert type(model).__name__ == "FSDPResidualNet" and isinstance(model, ResidualNet)
    assert type(model.layers[0].lin1) is nn.Linear, "submodules are not swapped"
    assert type(model.layers) is nn.ModuleList


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_class_swap(world_size: int) -> None:
    _run(world_size, _class_swap)


def _sequential_slicing() -> None:
    mesh = world_mesh()
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(IN, D), nn.Tanh(), nn.Linear(D, OUT))
    ref = nn.Sequential(nn.Linear(IN, D), nn.Tanh(), nn.Linear(D, OUT))
    ref.load_state_dict(seq.state_dict())
    fully_shard(seq[0], mesh=mesh)
    fully_shard(seq[2], mesh=mesh)
    fully_shard(seq, mesh=mesh)
    assert type(seq).__name__ == "FSDPSequential" and len(seq) == 3
    first = seq[0]
    assert type(first).__name__ == "FSDPLinear"
    head = seq[0:2]
    assert type(head) is nn.Sequential, f"slicing gave {type(head).__name__}"
    assert len(head) == 2 and head[0] is seq[0] and head[1] is seq[1]
    assert list(seq[-2:]) == [seq[1], seq[2]]
    x = mine(_batch(0)[0])
    with torch.no_grad():
        torch.testing.assert_close(seq(x), ref(x))
    _assert_sharded_registered(seq, None)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sequential_slicing(world_size: int) -> None:
    _run(world_size, _sequential_slicing)


def _default_mesh() -> None:
    torch.manual_seed(0)
    model = ResidualNet()
    orig = {n: p.detach().clone() for n, p in model.named_parameters()}
    _shard_net(model)  # mesh=None everywhere
    ws = dist.get_world_size()
    for name, p in model.named_parameters():
        mesh = p.device_mesh
        assert mesh.ndim == 1 and mesh.size() == ws and mesh.device_type == "cpu", name
        assert mesh.mesh.tolist() == list(range(ws)), name
        assert tuple(p.placements) == (Shard(0),), name
        torch.testing.assert_close(p.full_tensor(), orig[name], rtol=0, atol=0)
    model(torch.randn(2, IN)).sum().backward()
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_default_mesh(world_size: int) -> None:
    _run(world_size, _default_mesh)


def _buffers() -> None:
    mesh = world_mesh()
    torch.manual_seed(0)
    probe = Scaled()
    fully_shard(probe, mesh=mesh)
    for name, buf in probe.named_buffers():
        assert not isinstance(buf, DTensor), f"buffer {name} became a DTensor"
        assert buf.device.type == "cpu"
    torch.testing.assert_close(probe.scale, torch.linspace(0.5, 1.5, OUT), rtol=0, atol=0)
    torch.testing.assert_close(probe.shift, torch.full((OUT,), 0.25), rtol=0, atol=0)
    assert "scale" in probe.state_dict() and "shift" not in probe.state_dict()
    _compare_training(Scaled, lambda m: fully_shard(m, mesh=mesh))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_buffers_unsharded_and_used(world_size: int) -> None:
    _run(world_size, _buffers)


def _shard_as_list(model: ResidualNet) -> None:
    mesh = world_mesh()
    blocks = [model.layers[0], model.layers[1]]
    out = fully_shard(blocks, mesh=mesh)
    assert out == blocks and all(a is b for a, b in zip(out, blocks, strict=True))
    assert all(
        isinstance(b, FSDPModule) and type(b).__name__ == "FSDPResidualBlock" for b in blocks
    )
    fully_shard(model, mesh=mesh)


def _list_form() -> None:
    _compare_training(ResidualNet, _shard_as_list)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fully_shard_list_form(world_size: int) -> None:
    _run(world_size, _list_form)


# ---------------------------------------------------------------------------------------------
# Invariants


def _unsharded_identity() -> None:
    mesh = world_mesh()
    torch.manual_seed(0)
    model = _shard_net(ResidualNet(), mesh)
    seen: dict[str, list[tuple[int, bool, tuple[int, ...]]]] = {}

    def record(key: str, module: nn.Module) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any) -> None:
            for pname, p in module.named_parameters():
                seen.setdefault(f"{key}.{pname}", []).append(
                    (id(p), isinstance(p, DTensor), tuple(p.shape))
                )

        return hook

    # Registered after fully_shard: runs after fsdp2's pre-forward (which is prepended).
    model.layers[0].register_forward_pre_hook(record("layers.0", model.layers[0]))
    model.layers[1].lin1.register_forward_pre_hook(record("layers.1.lin1", model.layers[1].lin1))
    model.inp.register_forward_pre_hook(record("inp", model.inp))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = _batch(step)
        F.mse_loss(model(mine(x)), mine(y)).backward()
        opt.step()
        opt.zero_grad()
    assert set(seen) >= {"layers.0.lin1.weight", "layers.1.lin1.bias", "inp.weight"}
    full_shapes = {n: tuple(p.shape) for n, p in ResidualNet().named_parameters()}
    for key, records in seen.items():
        assert len(records) == 3, key
        ids = {r[0] for r in records}
        assert len(ids) == 1, f"{key}: unsharded parameter changed identity across steps"
        assert not any(r[1] for r in records), f"{key}: a DTensor was registered in forward"
        assert records[0][2] == full_shapes[key], f"{key}: shape {records[0][2]} in forward"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_unsharded_param_identity_stable(world_size: int) -> None:
    _run(world_size, _unsharded_identity)


def _registered_are_optimizer_params() -> None:
    mesh = world_mesh()
    torch.manual_seed(0)
    model = _shard_net(ResidualNet(), mesh)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    opt_params = opt.param_groups[0]["params"]
    assert all(p is q for p, q in zip(params, opt_params, strict=True))
    for step in range(3):
        _assert_sharded_registered(model, params)
        x, y = _batch(step)
        loss = F.mse_loss(model(mine(x)), mine(y))
        # Between forward and backward: blocks resharded (default True); the root keeps
        # its unsharded parameters for backward (default False for the root).
        for block in model.layers:
            _assert_sharded_registered(block, None)
        assert not isinstance(model.inp.weight, DTensor)
        loss.backward()
        _assert_sharded_registered(model, params)
        for p in params:
            assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements
            assert p.grad.shape == p.shape
        opt.step()
        opt.zero_grad()
    _assert_sharded_registered(model, opt.param_groups[0]["params"])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_registered_params_are_optimizer_params(world_size: int) -> None:
    _run(world_size, _registered_are_optimizer_params)
