"""Tensor-subclass parameters: torch's all-gather extension protocol, and clear errors.

Subclasses used (no torchao needed; see test_torchao.py for the real clients):

* ``TwoTensor`` (torch's test subclass: every op runs on two inner tensors), given the hooks
  for the duration of a rank function, in both forms: ``fsdp_pre_all_gather(self, mesh)`` and
  the 5-argument one;
* ``Bf16Gather``: a wrapper subclass over fp32 data whose all-gather moves bf16 (the hook
  pads uneven shards itself, or leaves it to the engine) and which records the arguments the
  hooks receive;
* hooks set as instance attributes on plain local tensors after ``to_empty``.

Parity: fsdp2 and torch's FSDP2 train the same model in one worker; losses are bitwise equal
every step and the local shards at the end; where a replicated reference exists (TwoTensor:
both halves hold the plain values) losses match it too. What torch's FSDP2 cannot run
(``reshard_after_forward=int`` with extensions, uneven shards without padding hooks) is
compared with the reference or with fsdp2's run of the padding variant.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from _harness import run_on_ranks
from comm_counter import spy_all_gathers
from helpers import world_mesh
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.two_tensor import TwoTensor

import fsdp2

ENGINES = ("fsdp2", "torch")


def _fs(engine: str):
    return fsdp2.fully_shard if engine == "fsdp2" else torch_fully_shard


def _policies(engine: str, param_dtype: torch.dtype | None, offload: bool) -> dict[str, Any]:
    if engine == "fsdp2":
        mp, off = fsdp2.MixedPrecisionPolicy, fsdp2.CPUOffloadPolicy
    else:
        mp, off = TorchMP, TorchOffload
    kw: dict[str, Any] = {"mp_policy": mp(param_dtype=param_dtype)}
    if offload:
        kw["offload_policy"] = off(pin_memory=False)  # no accelerator to pin for
    return kw


# ---- TwoTensor with hooks --------------------------------------------------------------------


def _pre_v1(self, mesh):
    return (self.a, self.b), None


def _pre_v2(self, mesh, outer_size, outer_stride, module, mp_policy):
    return (self.a, self.b), None


def _post(self, outputs, metadata, param_dtype, *, out=None):
    a, b = outputs
    if out is not None:
        if a.dtype == param_dtype:  # no cast: ``out`` still views the outputs
            assert a.untyped_storage().data_ptr() == out.a.untyped_storage().data_ptr()
        else:
            out.a.copy_(a)
            out.b.copy_(b)
        return None
    return TwoTensor(a, b).to(param_dtype), (a, b)


@contextlib.contextmanager
def two_tensor_hooks(version: int):
    """Give ``TwoTensor`` the extension hooks inside the block (all ranks at once)."""
    TwoTensor.fsdp_pre_all_gather = _pre_v1 if version == 1 else _pre_v2
    TwoTensor.fsdp_post_all_gather = _post
    try:
        yield
    finally:
        del TwoTensor.fsdp_pre_all_gather
        del TwoTensor.fsdp_post_all_gather


class _Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.out_proj = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


class _Stack(nn.Module):
    def __init__(self, n: int = 3, dim: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(dim) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _two_tensor_stack() -> _Stack:
    model = _Stack()
    for block in model.layers:
        for lin in (block.in_proj, block.out_proj):
            lin.weight = nn.Parameter(TwoTensor(lin.weight, lin.weight.clone()))
    return model


def _shard(model: nn.Module, engine: str, mesh, **kw) -> nn.Module:
    for layer in model.layers:
        _fs(engine)(layer, mesh=mesh, **kw)
    _fs(engine)(model, mesh=mesh, **kw)
    return model


def _local_a(t: torch.Tensor) -> torch.Tensor:
    t = t.to_local() if isinstance(t, DTensor) else t
    return (t.a if isinstance(t, TwoTensor) else t).detach().clone()


def _chunk(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    chunks = torch.chunk(t, world)
    return chunks[rank] if rank < len(chunks) else t[:0]


def _two_tensor_parity(
    version: int, raf: bool | int, engines: tuple[str, ...], double: bool = False
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = world_mesh()
    with two_tensor_hooks(version):
        torch.manual_seed(42)
        ref = _two_tensor_stack()
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        models = {}
        for engine in engines:
            torch.manual_seed(42)
            models[engine] = _shard(_two_tensor_stack(), engine, mesh, reshard_after_forward=raf)
        if double:  # a dtype change after sharding (torch's FSDP2 cannot)
            ref.double()
            for m in models.values():
                m.double()
        opts = {e: torch.optim.Adam(m.parameters(), lr=1e-2) for e, m in models.items()}
        for e, m in models.items():
            assert type(m.layers[0].in_proj.weight._local_tensor) is TwoTensor, e
        g = torch.Generator().manual_seed(0)
        for step in range(4):
            x = torch.randn(2 * world, 8, generator=g, dtype=torch.float64 if double else None)
            ref_loss = ref(x).sum() / world
            ref_loss.backward()
            losses = {}
            for e, m in models.items():
                losses[e] = m(x[2 * rank : 2 * rank + 2]).sum()
                losses[e].backward()
            for o in (ref_opt, *opts.values()):
                o.step()
                o.zero_grad(set_to_none=step % 2 == 0)
            for e, loss in losses.items():
                total = _local_a(loss)
                dist.all_reduce(total)
                torch.testing.assert_close(
                    total / world,
                    _local_a(ref_loss) * 1.0,
                    atol=1e-5,
                    rtol=1e-5,
                    msg=lambda m, e=e, s=step: f"{e} step {s} loss: {m}",
                )
            if len(models) == 2:
                assert torch.equal(losses["fsdp2"].a, losses["torch"].a), f"step {step}"
        ref_params = dict(ref.named_parameters())
        for e, m in models.items():
            for name, p in m.named_parameters():
                want = _chunk(_local_a(ref_params[name]), rank, world)
                torch.testing.assert_close(
                    _local_a(p),
                    want,
                    atol=1e-5,
                    rtol=1e-5,
                    msg=lambda m, e=e, n=name: f"{e} {n}: {m}",
                )
                assert torch.equal(p.to_local().a, p.to_local().b), f"{e} {name}: halves diverged"
        if len(models) == 2:
            for (n, p), (_, q) in zip(
                models["fsdp2"].named_parameters(),
                models["torch"].named_parameters(),
                strict=True,
            ):
                assert torch.equal(_local_a(p), _local_a(q)), f"{n}: fsdp2 differs from torch"


@pytest.mark.parametrize("version", [1, 2], ids=["pre-v1", "pre-v2"])
@pytest.mark.parametrize("raf", [True, False], ids=["raf", "no-raf"])
def test_two_tensor_parity(version: int, raf: bool) -> None:
    run_on_ranks(2, _two_tensor_parity, version, raf, ENGINES)


def test_two_tensor_reshard_after_forward_int() -> None:
    # torch's FSDP2 raises NotImplementedError here; the reference decides.
    run_on_ranks(4, _two_tensor_parity, 2, 2, ("fsdp2",))


def test_two_tensor_dtype_change_after_sharding() -> None:
    run_on_ranks(2, _two_tensor_parity, 2, True, ("fsdp2",), True)


def _two_tensor_meta(version: int, bf16: bool, offload: bool) -> None:
    mesh = world_mesh()
    losses: dict[str, list[torch.Tensor]] = {}
    finals: dict[str, list[torch.Tensor]] = {}
    with two_tensor_hooks(version):
        for engine in ENGINES:
            with torch.device("meta"):
                model = _two_tensor_stack()
            kw = _policies(engine, torch.bfloat16 if bf16 else None, offload)
            _shard(model, engine, mesh, **kw)
            model.to_empty(device="cpu")
            torch.manual_seed(5)
            for p in model.parameters():
                nn.init.trunc_normal_(p)
            assert type(model.layers[0].in_proj.weight._local_tensor) is TwoTensor, engine
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            torch.manual_seed(42 + dist.get_rank())
            x = torch.randn(2, 8)
            losses[engine] = []
            for _ in range(3):
                loss = model(x).sum()
                loss.backward()
                losses[engine].append(_local_a(loss))
                opt.step()
                opt.zero_grad()
            finals[engine] = [_local_a(p) for p in model.parameters()]
    for step, (a, b) in enumerate(zip(losses["fsdp2"], losses["torch"], strict=True)):
        assert torch.equal(a, b), f"step {step}: fsdp2 {a} != torch {b}"
    for i, (a, b) in enumerate(zip(finals["fsdp2"], finals["torch"], strict=True)):
        assert torch.equal(a, b), f"parameter {i}: fsdp2 differs from torch"


@pytest.mark.parametrize(
    "version, bf16, offload",
    [(1, False, False), (2, True, False), (2, False, True)],
    ids=["v1-fp32", "v2-bf16", "v2-offload"],
)
def test_two_tensor_meta_init(version: int, bf16: bool, offload: bool) -> None:
    run_on_ranks(2, _two_tensor_meta, version, bf16, offload)


# ---- hooks patched onto plain local tensors -------------------------------------------------


def _patched_case(after_steps: int) -> None:
    """Hooks patched onto every weight's local tensor after ``to_empty`` (found at the first
    forward) or after ``after_steps`` training steps (found when the next forward begins)."""
    mesh = world_mesh()
    calls = {"pre": 0}

    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls["pre"] += 1
        return (self.to(torch.bfloat16),), None

    @torch.no_grad()
    def post(self, outputs, metadata, param_dtype, *, out=None):
        (t,) = outputs
        if out is not None:
            with _unsafe_preserve_version_counter(out):  # autograd saved ``out`` in forward
                out.copy_(t)
            return None
        up = t.to(param_dtype)
        return up, (t, up)

    results = {}
    # torch's FSDP2 fails on hooks patched after its first forward (AttributeError:
    # 'FSDPParam' object has no attribute '_extensions_data').
    for engine in ENGINES if after_steps == 0 else ("fsdp2",):
        calls["pre"] = 0
        with torch.device("meta"):
            model = _Stack()
        _shard(model, engine, mesh)
        model.to_empty(device="cpu")
        torch.manual_seed(1)
        for p in model.parameters():
            nn.init.trunc_normal_(p)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(7 + dist.get_rank())
        x = torch.randn(2, 8)
        losses = []
        for step in range(3):
            if step == after_steps:
                for p in model.parameters():
                    local = p._local_tensor
                    local.fsdp_pre_all_gather = pre.__get__(local)
                    local.fsdp_post_all_gather = post.__get__(local)
            loss = model(x).sum()
            loss.backward()
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        # 6 weights gathered in forward and again in backward (blocks reshard), each step
        # from the one that patched them on.
        assert calls["pre"] == (3 - after_steps) * 6 * 2, (engine, calls)
        # The forward computes with the hooks' weights: the shards rounded to bf16.
        seen = {}
        for i, block in enumerate(model.layers):
            block.in_proj.register_forward_pre_hook(
                lambda m, _, i=i, seen=seen: seen.__setitem__(i, m.weight.detach().clone())
            )
        model(x)
        for i, block in enumerate(model.layers):
            want = block.in_proj.weight.full_tensor().bfloat16().float()
            assert torch.equal(seen[i], want), (engine, i)
        results[engine] = (losses, [p.to_local().clone() for p in model.parameters()])
    if after_steps:
        return
    for step, (a, b) in enumerate(zip(results["fsdp2"][0], results["torch"][0], strict=True)):
        assert torch.equal(a, b), f"step {step}: fsdp2 {a} != torch {b}"
    for i, (a, b) in enumerate(zip(results["fsdp2"][1], results["torch"][1], strict=True)):
        assert torch.equal(a, b), f"parameter {i}: fsdp2 differs from torch"


@pytest.mark.parametrize("after_steps", [0, 1], ids=["before_training", "after_a_step"])
def test_hooks_patched_on_local_tensors(after_steps: int) -> None:
    run_on_ranks(2, _patched_case, after_steps)


# ---- a bf16-gathering subclass: hook arguments, padding, one collective per group ------------


class Bf16Gather(torch.Tensor):
    """fp32 data whose all-gather moves bf16; ``calls`` records what the hooks receive."""

    calls: list[dict[str, Any]] = []

    @staticmethod
    def __new__(cls, data: torch.Tensor, pad: bool = True):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, data.stride(), data.storage_offset(), dtype=data.dtype,
            device=data.device,
        )  # fmt: skip

    def __init__(self, data: torch.Tensor, pad: bool = True) -> None:
        self._data = data
        self._pad = pad

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        Bf16Gather.calls.append(
            {"mesh": mesh, "size": outer_size, "stride": outer_stride, "module": module,
             "mp": mp_policy}
        )  # fmt: skip
        rows = math.ceil(outer_size[0] / mesh.size())
        data = self._data.to(torch.bfloat16)
        if self._pad and data.size(0) != rows:
            padded = data.new_zeros((rows, *data.shape[1:]))
            padded[: data.size(0)].copy_(data)
            data = padded
        return (data,), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (t,) = outputs
        if out is not None:  # ``t`` has the padded rows of uneven shards
            with torch.no_grad(), _unsafe_preserve_version_counter(out):
                out.copy_(t[: out.size(0)])
            return None
        up = t.to(param_dtype)
        return up, (t, up)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        pad = True

        def unwrap(x):
            nonlocal pad
            pad = x._pad
            return x._data

        out = func(
            *pytree.tree_map_only(cls, unwrap, args),
            **pytree.tree_map_only(cls, unwrap, kwargs or {}),
        )
        return pytree.tree_map_only(torch.Tensor, lambda x: cls(x, pad), out)

    def __tensor_flatten__(self):
        return ["_data"], self._pad

    @staticmethod
    def __tensor_unflatten__(inner, pad, outer_size, outer_stride):
        return Bf16Gather(inner["_data"], pad)


class _Uneven(nn.Module):
    """Weights with 3 and 5 rows (uneven over 2 ranks) next to plain biases and a norm."""

    def __init__(self, pad: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 5)])
        for lin in (self.layers[0], self.layers[2]):
            lin.weight = nn.Parameter(Bf16Gather(lin.weight.detach().clone(), pad))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _bf16_case(mesh_shape: tuple[int, ...]) -> None:
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    shard_size = mesh_shape[-1]
    runs = {}
    for engine, pad in (("fsdp2", False), ("fsdp2", True), ("torch", True)):
        Bf16Gather.calls.clear()
        torch.manual_seed(0)
        model = _Uneven(pad)
        for layer in model.layers:
            _fs(engine)(layer, mesh=mesh)
        _fs(engine)(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sent: list[tuple[torch.dtype, int]] = []

        def counted(input: torch.Tensor, group: Any, _sent: list[Any] = sent) -> None:
            _sent.append((input.dtype, input.numel()))

        losses = []
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            x = torch.randn(4, 4, generator=g)
            with spy_all_gathers(counted):
                loss = model(x).pow(2).mean()
                loss.backward()
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        params = [p.to_local() for p in model.parameters()]
        runs[(engine, pad)] = (
            losses,
            [p._data if isinstance(p, Bf16Gather) else p for p in params],
        )
        call = Bf16Gather.calls[0]
        what = f"{engine} pad={pad}"
        assert call["mesh"].ndim == 1 and call["mesh"].size() == shard_size, (what, call)
        assert tuple(call["size"]) == (3, 4) and tuple(call["stride"]) == (4, 1), (what, call)
        assert call["module"] is model.layers[0], (what, call)
        assert call["mp"].param_dtype is None, (what, call)
        if engine == "fsdp2":
            # One all-gather per group (3 layers; the root has no parameters) in forward and
            # again in backward; groups with a Bf16Gather weight move bytes (uint8).
            per_step = sent[: len(sent) // 3]
            assert [d for d, _ in per_step] == [torch.uint8, torch.float32, torch.uint8] * 2, (
                what,
                per_step,
            )
    want = runs[("torch", True)]
    for key, (losses, params) in runs.items():
        for a, b in zip(losses, want[0], strict=True):
            assert torch.equal(a, b), key
        for a, b in zip(params, want[1], strict=True):
            assert torch.equal(a, b), key


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["fsdp", "hsdp"])
def test_bf16_gather_hook_arguments_padding_and_hsdp(mesh_shape: tuple[int, ...]) -> None:
    run_on_ranks(math.prod(mesh_shape), _bf16_case, mesh_shape)


# ---- errors ----------------------------------------------------------------------------------


class _OnlyPre(TwoTensor):
    pass


def _error_case(kind: str) -> str:
    mesh = world_mesh()
    model = _Stack(n=1)
    lin = model.layers[0].in_proj
    shard_placement_fn = None
    if kind == "no-hooks":
        lin.weight = nn.Parameter(TwoTensor(lin.weight, lin.weight.clone()))
    elif kind == "one-hook":
        lin.weight = w = nn.Parameter(TwoTensor(lin.weight, lin.weight.clone()))
        w.fsdp_pre_all_gather = _pre_v1.__get__(w)
    elif kind == "arity":
        lin.weight = w = nn.Parameter(TwoTensor(lin.weight, lin.weight.clone()))
        w.fsdp_pre_all_gather = (lambda self, mesh, extra: None).__get__(w)
        w.fsdp_post_all_gather = _post.__get__(w)
    elif kind == "shard-dim":
        lin.weight = nn.Parameter(Bf16Gather(lin.weight.detach().clone()))

        def shard_placement_fn(p):
            return Shard(1)

    try:
        fsdp2.fully_shard(model.layers[0], mesh=mesh, shard_placement_fn=shard_placement_fn)
    except (TypeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(
    "kind, error, words",
    [
        ("no-hooks", "TypeError", ["in_proj.weight", "TwoTensor", "fsdp_pre_all_gather"]),
        ("one-hook", "TypeError", ["in_proj.weight", "only one", "fsdp_post_all_gather"]),
        ("arity", "TypeError", ["in_proj.weight", "(mesh)"]),
        ("shard-dim", "NotImplementedError", ["in_proj.weight", "dim 0"]),
    ],
)
def test_unsupported_subclass_errors(kind: str, error: str, words: list[str]) -> None:
    for msg in run_on_ranks(2, _error_case, kind):
        assert msg.startswith(error), msg
        for w in words:
            assert w in msg, (w, msg)


class _MyParam(nn.Parameter):
    """A plain ``nn.Parameter`` subclass: plain data, sharded in the flat buffer."""


def _plain_subclass_case() -> list[float]:
    mesh = world_mesh()
    out = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = _Stack(n=2)
        if wrap:
            for block in model.layers:
                block.in_proj.weight = _MyParam(block.in_proj.weight.detach())
        _shard(model, "fsdp2", mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1)
        for _ in range(2):
            loss = model(torch.randn(2, 8)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
        out.append(loss.item())
    return out


def test_plain_parameter_subclass_is_sharded_like_a_tensor() -> None:
    for plain_loss, wrapped_loss in run_on_ranks(2, _plain_subclass_case):
        assert plain_loss == wrapped_loss


def _uneven_bad_input_case() -> str:
    # An uneven parameter whose hook returns inputs of an unrelated shape fails on every rank
    # (no rank is left waiting in the all-gather).
    mesh = world_mesh()
    model = _Uneven(pad=True)
    for layer in model.layers:
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    local = model.layers[0].weight._local_tensor
    local.fsdp_pre_all_gather = (lambda self, *args: ((torch.zeros(7),), None)).__get__(local)
    try:
        model(torch.randn(2, 4))
    except ValueError as e:
        return str(e)
    return "no error"


def test_uneven_inputs_of_wrong_shape_fail_on_every_rank() -> None:
    for msg in run_on_ranks(2, _uneven_bad_input_case):
        assert "layers.0.weight" in msg or "weight" in msg, msg
        assert "unevenly" in msg, msg
