"""Which parameters a sharded module registers, at every point of a step, beside torch's FSDP2.

torch's ``fully_shard`` documents it (``reshard_after_forward``): after forward the registered
parameters are the sharded ones if ``True``, the unsharded ones if ``False``, and those
resharded to the smaller mesh for an ``int``; ``set_reshard_after_backward(False)`` keeps the
unsharded ones registered between micro-batches; ``unshard()`` registers the unsharded ones and
``reshard()`` the sharded ones. fsdp2 registers exactly what torch's FSDP2 registers. Here a
table of points of a step (before the first forward, inside forward and backward, between
forward and backward for each ``reshard_after_forward``, after ``unshard()`` / ``reshard()``,
between no-sync micro-batches, after a ``no_grad`` and an eval forward, after
``state_dict()``) is walked by both engines side by side on the same model, and at each point
what ``named_parameters()``, ``parameters()``, ``get_parameter()``, ``_parameters`` and the
module attributes give (kind, shape, identity with each other and with the sharded parameter
the optimizer holds) must be the same for both, and agree among themselves.

Also here: torch's own ``TestFullyShardRegisteredParams`` (its two tests, written again for
gloo ranks), and the optimizer built while unsharded, which fsdp2 refuses at ``step()``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from helpers import ENGINES, hsdp_mesh, world_mesh
from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2 import FSDPModule

D = 8


class MLP(nn.Module):
    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


class Net(nn.Module):
    """Two MLP blocks and a head at the root; the head's input requires grad and the first
    block's does not (so autograd saves no weight of the first layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MLP(), MLP()])
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _is_fsdp(m: nn.Module) -> bool:
    return isinstance(m, FSDPModule | TorchFSDPModule)


def _kind(t: torch.Tensor) -> str:
    if isinstance(t, DTensor):
        return f"dtensor{tuple(t.shape)}/{tuple(t.to_local().shape)}"
    return f"tensor{tuple(t.shape)}"


def _snapshot(model: nn.Module, sharded: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What every public way of reaching the parameters gives now; the engine-independent
    description of it (kinds, shapes, which of them are the same object)."""
    named = dict(model.named_parameters())
    listed = list(model.parameters())
    out: dict[str, Any] = {}
    for i, (name, p) in enumerate(named.items()):
        owner_path, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_path)
        registered = owner._parameters[attr]
        assert registered is not None
        agree = (
            listed[i] is p
            and model.get_parameter(name) is p
            and getattr(owner, attr) is p
            and registered is p
        )
        assert agree, (
            f"{name}: named_parameters, parameters, get_parameter, _parameters and the "
            "attribute disagree"
        )
        out[name] = (_kind(p), p is sharded[name], p.requires_grad)
    return out


def _released(model: nn.Module) -> set[str]:
    """The parameters whose unsharded storage fsdp2 released early in this backward."""
    names: dict[int, str] = {}
    for path, m in model.named_modules():
        for n, _ in m.named_parameters(recurse=False):
            names[id(m), n] = f"{path}.{n}" if path else n  # type: ignore[index]
    out = set()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for g in m._groups():
                for i in g.released:
                    p = g.flat_params[i]
                    out.update(names[id(o), n] for o, n in p.owners)  # type: ignore[index]
    return out


REPLICATE = {"fsdp2": fsdp2.replicate, "torch": torch_replicate}


def _walk(
    engine: str, raf: bool | int | None, hsdp: bool, replicate: bool = False
) -> list[tuple[str, dict[str, Any]]]:
    """The table: every point of a step, with what the model registers there."""
    torch.manual_seed(0)
    model = Net()
    mesh = hsdp_mesh((2, dist.get_world_size() // 2)) if hsdp else world_mesh()
    shard = (REPLICATE if replicate else ENGINES)[engine]
    kw: dict[str, Any] = {"mesh": mesh}
    if raf is not None:
        kw["reshard_after_forward"] = raf
    for b in model.blocks:
        shard(b.in_proj, **kw)
        shard(b, **kw)
    shard(model, mesh=mesh)  # the root's default: not resharded after forward
    sharded = dict(model.named_parameters())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(dist.get_rank()))
    table: list[tuple[str, dict[str, Any]]] = []

    def at(point: str) -> None:
        table.append((point, _snapshot(model, sharded)))

    at("before the first forward")

    def in_forward(module: nn.Module, args: Any, out: Any) -> None:
        at(f"inside forward, after {type(module).__name__}")

    h = model.blocks[1].out_proj.register_forward_hook(in_forward)
    loss = model(x).sum()
    h.remove()
    at("between forward and backward")

    def in_backward(grad: torch.Tensor) -> None:
        at("inside backward")
        if engine == "fsdp2":  # see [Note: release] in fsdp2/_core/params/group.py
            table[-1][1]["released"] = sorted(_released(model))

    y = model(x)
    at("between a second forward and its backward")
    y.register_hook(in_backward)
    (loss + y.sum()).backward()
    at("after backward")
    optim.step()
    optim.zero_grad()
    at("after the optimizer step")

    model.unshard()
    at("after the root's unshard()")
    model.reshard()
    at("after the root's reshard()")
    for m in model.modules():
        if _is_fsdp(m):
            m.unshard()  # type: ignore[operator]
    at("after unshard() on every module")
    model(x).sum().backward()
    at("after backward from an unshard()")

    for m in model.modules():
        if _is_fsdp(m):
            m.set_reshard_after_backward(False)  # type: ignore[operator]
            m.set_requires_gradient_sync(False)  # type: ignore[operator]
    model(x).sum().backward()
    at("between no-sync micro-batches, reshard_after_backward=False")
    for m in model.modules():
        if _is_fsdp(m):
            m.set_reshard_after_backward(True)  # type: ignore[operator]
            m.set_requires_gradient_sync(True)  # type: ignore[operator]
    model(x).sum().backward()
    at("after the synced micro-batch")
    optim.step()
    optim.zero_grad()

    with torch.no_grad():
        model(x)
    at("after a no_grad forward")
    model.eval()
    model(x)
    at("after an eval forward with grad on")
    model.train()
    model.state_dict()
    at("after state_dict()")
    model(x).sum().backward()
    at("after the next backward")
    optim.step()
    optim.zero_grad()
    loss = model(x).sum()
    model.state_dict()
    at("after state_dict() between forward and backward")
    loss.backward()
    at("after that backward")
    optim.step()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    table.append(("the parameters at the end", full))
    return table


def _both(raf: bool | int | None, hsdp: bool, replicate: bool = False) -> None:
    tables = {e: _walk(e, raf, hsdp, replicate) for e in ENGINES}
    want, got = tables["torch"], tables["fsdp2"]
    assert [p for p, _ in got] == [p for p, _ in want]
    (_, t_end), (_, f_end) = want.pop(), got.pop()
    for name, value in t_end.items():
        torch.testing.assert_close(f_end[name], value, msg=name)
    for (point, t), (_, f) in zip(want, got, strict=True):
        released = f.pop("released", [])
        for name in t:
            if name in released:  # registered sharded while freed: [Note: release]
                kind, is_sharded, rg = f[name]
                assert is_sharded and kind.startswith("dtensor") and rg is t[name][2], name
                continue
            assert f[name] == t[name], (
                f"raf={raf} hsdp={hsdp}, {point}: {name} is {f[name]} under fsdp2 and "
                f"{t[name]} under torch's FSDP2 (kind, is the sharded parameter, requires_grad)"
            )


@pytest.mark.parametrize("raf", [None, True, False, 2])
def test_registration_table(raf: bool | int | None) -> None:
    run_on_ranks(4, _both, raf, False)


def test_registration_table_replicate() -> None:
    """``replicate`` (one shard rank: the unsharded parameters view the replicated storage)
    registers what torch's ``replicate`` registers."""
    run_on_ranks(2, _both, None, False, True)


def test_registration_table_hsdp_int() -> None:
    # (2, 4): reshard_after_forward=2 keeps each block's parameters on 2 of its 4 shard ranks
    run_on_ranks(8, _both, 2, True)


# ---------------------------------------------------------------------------------------------
# torch's TestFullyShardRegisteredParams (test/distributed/_composable/fsdp/
# test_fully_shard_training.py), on CPU ranks, against fsdp2's fully_shard


def _assert_tensor_params(params: Iterable[torch.Tensor]) -> None:
    params = list(params)
    assert len(params) > 0
    for p in params:
        assert not isinstance(p, DTensor) and isinstance(p, torch.Tensor)


def _assert_dtensor_params(params: Iterable[torch.Tensor]) -> None:
    params = list(params)
    assert len(params) > 0
    for p in params:
        assert isinstance(p, DTensor)


def _assert_same_params(params: Iterable[torch.Tensor], ref: Iterable[torch.Tensor]) -> None:
    params, ref = list(params), list(ref)
    assert len(params) == len(ref)
    for p, r in zip(params, ref, strict=True):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        assert full.shape == r.shape
        torch.testing.assert_close(full, r)


def _torch_after_forward() -> None:
    fully_shard: Callable[..., Any] = fsdp2.fully_shard
    for raf in (True, False, 2, None):
        torch.manual_seed(42)
        model = MLP(3)
        for param in model.parameters():
            dist.broadcast(param, src=0)
        ref = copy.deepcopy(model)
        fully_shard(model, reshard_after_forward=raf)  # root only
        inp = torch.randn((2, 3))
        _assert_dtensor_params(model.parameters())
        _assert_same_params(model.parameters(), ref.parameters())
        model(inp)
        if raf:
            _assert_dtensor_params(model.parameters())
        else:
            _assert_tensor_params(model.parameters())
        _assert_same_params(model.parameters(), ref.parameters())
        model.reshard()  # however, we can manually reshard
        _assert_dtensor_params(model.parameters())
        _assert_same_params(model.parameters(), ref.parameters())

    for raf in (True, False, 2, None):
        torch.manual_seed(42)
        model = nn.Sequential(MLP(3), MLP(3))
        for param in model.parameters():
            dist.broadcast(param, src=0)
        ref = copy.deepcopy(model)
        fully_shard(model[0].in_proj, reshard_after_forward=raf)
        fully_shard(model[0].out_proj, reshard_after_forward=raf)
        fully_shard(model, reshard_after_forward=raf)
        _assert_dtensor_params(model.parameters())
        _assert_same_params(model.parameters(), ref.parameters())
        model(inp)
        non_root = list(model[0].in_proj.parameters()) + list(model[0].out_proj.parameters())
        root = list(set(model.parameters()) - set(non_root))
        if raf is None:
            _assert_dtensor_params(non_root)
            _assert_tensor_params(root)
        elif raf:
            _assert_dtensor_params(non_root)
            _assert_dtensor_params(root)
        else:
            _assert_tensor_params(non_root)
            _assert_tensor_params(root)
        _assert_same_params(model.parameters(), ref.parameters())
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()  # however, we can manually reshard
        _assert_dtensor_params(model.parameters())
        _assert_same_params(model.parameters(), ref.parameters())


def _torch_after_backward() -> None:
    fully_shard: Callable[..., Any] = fsdp2.fully_shard
    for raf in (True, False, 2):
        model = MLP(8)
        fully_shard(model, reshard_after_forward=raf)
        inp = torch.randn((2, 8))
        _assert_dtensor_params(model.parameters())
        model(inp).sum().backward()
        _assert_dtensor_params(model.parameters())
    for raf in (True, False, 2):
        model = MLP(8)
        fully_shard(model.in_proj, reshard_after_forward=raf)
        fully_shard(model.out_proj, reshard_after_forward=raf)
        fully_shard(model, reshard_after_forward=raf)
        _assert_dtensor_params(model.parameters())
        model(inp).sum().backward()
        _assert_dtensor_params(model.parameters())


def test_torch_param_registration_after_forward() -> None:
    run_on_ranks(4, _torch_after_forward)


def test_torch_param_registration_after_backward() -> None:
    run_on_ranks(4, _torch_after_backward)
