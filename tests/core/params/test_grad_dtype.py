"""Gradient dtypes: ``Tensor.grad_dtype`` captured at ``fully_shard`` and
``MixedPrecisionPolicy(grad_dtype=...)`` (torch main's open PRs 197203, 194434 and 197368;
not in torch 2.13 or 2.14). See [Note: gradient dtypes] in fsdp2/_core/params/dtypes.py.

* The policy's field: the fifth of the frozen dataclass (torch's positional order), a
  ``ValueError`` naming "floating-point dtype" for anything else (upstream
  ``TestGradientDtypePolicy``); read from a look-alike policy.
* ``explicit_override`` tells an explicit ``grad_dtype`` from the default on torch 2.13 (which
  has no ``Tensor._has_grad_dtype_override``) without changing the tensor.
* Parity, 2 ranks: bf16 parameters with fp32 gradients (``grad_dtype`` set on the tensors, or by
  the policy) train as a replica with the same ``grad_dtype`` (each rank's batch slice,
  gradients averaged by hand): losses each step, gradients (fp32, the DTensor spec's dtype
  too, the unsharded parameter's gradient fp32 already) and the parameters at the end. Without
  sync the gradients accumulate in fp32: contributions 3 (synced), 256, 1 (not synced), -256
  (synced) give 4, where the default's bf16 sum rounds 256 + 1 and gives 3. With an explicit
  ``reduce_dtype`` (bf16 or fp32) the reduce-scatter runs in it and the gradients still land
  in fp32; an unused parameter (``set_reduce_scatter_unused_params(True)``) gets fp32 zeros.
* torch main's ``test_fully_shard_conversion.py`` (CPU, one rank), with fsdp2's imports and
  ``explicit_override`` for ``Tensor._has_grad_dtype_override``: ``.to()`` matches a plain
  module (default, explicit fp32, explicit None; with and without existing gradients); a
  conversion that would put a gradient in another dtype than its policy, or move a pending one,
  is refused (``zero_grad(set_to_none=True)``) before anything changes, in nested and grouped
  modules and for a tied parameter; a no-op conversion keeps the pending gradient;
  ``grad_dtype`` changed after ``fully_shard`` raises at the next forward, conversion or load;
  the captured policy survives ``.to()`` and ``load_state_dict(assign=True)`` of a parameter
  carrying its own.
* torch main's ``test_fully_shard_grad_dtype.py`` (``TestFullyShardGradientDtype``, PR
  197368; CUDA-only upstream), with fsdp2's imports: every case on 2 CPU ranks (gloo; HSDP as
  a 2x1 mesh), the projection's fp32 weight gradient computed as the test's reference does;
  ``gpu``-marked (``make gpu-check``), on one GPU with its CUDA-only kernel
  (``torch.mm(out_dtype=torch.float32)``), eager and under ``torch.compile``, and the
  conversions between the GPU and the host. bf16 compute with an fp32 ``grad_dtype`` and no
  ``reduce_dtype``: the unsharded parameter receives the fp32 gradient bit for bit, the
  sharded one is fp32 and bit-equal to the sum (sync, no sync, activation checkpointing;
  ``reshard_after_forward`` True / False; bf16 / fp32 storage); an explicit ``reduce_dtype``
  and an unused parameter; conversions with gradients, where fsdp2 keeps 197203's rules
  (a gradient left in another dtype than its policy, or beside a parameter of another dtype,
  asks for ``zero_grad(set_to_none=True)``) and PR 197368's test carries it along.
* ``estimate_memory`` counts gradient bytes in the gradients' dtype.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from devices import REPEATS, require_cuda
from helpers import mine, world_mesh
from models import full_grads, full_params
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import fsdp2
from fsdp2 import FSDPModule, MixedPrecisionPolicy, fully_shard
from fsdp2._core.params.group import Sharded
from fsdp2._core.params.param import FSDPParam, explicit_override
from fsdp2.api import as_mixed_precision_policy

BF16, FP32 = torch.bfloat16, torch.float32
CLEAR = r"zero_grad\(set_to_none=True\)"

# ---------------------------------------------------------------------------------------------
# The policy (no process group)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64, "float32"])
def test_policy_grad_dtype_must_be_floating(dtype: Any) -> None:
    with pytest.raises(ValueError, match="floating-point dtype"):
        MixedPrecisionPolicy(grad_dtype=dtype)


def test_policy_positional_compatibility() -> None:
    policy = MixedPrecisionPolicy(BF16, FP32, None, False)
    assert policy.grad_dtype is None and policy.cast_forward_inputs is False
    names = [f.name for f in dataclasses.fields(MixedPrecisionPolicy)]
    assert names == [
        "param_dtype",
        "reduce_dtype",
        "output_dtype",
        "cast_forward_inputs",
        "grad_dtype",
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.grad_dtype = FP32  # type: ignore[misc]

    class LookAlike:  # torch main's policy, read by field (accelerate builds torch's)
        param_dtype, reduce_dtype, output_dtype, cast_forward_inputs = BF16, None, None, True
        grad_dtype = FP32

    LookAlike.__name__ = "MixedPrecisionPolicy"
    assert as_mixed_precision_policy(LookAlike()).grad_dtype == FP32


def test_explicit_override_without_changing_the_tensor() -> None:
    cases = {"default": ..., "same": FP32, "none": None, "other": torch.float64}
    for name, grad_dtype in cases.items():
        p = nn.Parameter(torch.arange(3.0))
        if grad_dtype is not ...:
            p.grad_dtype = grad_dtype
        ptr, version = p.data_ptr(), p._version
        assert explicit_override(p) is (name != "default"), name
        assert (p.data_ptr(), p._version, p.dtype) == (ptr, version, FP32), name
        assert p.grad_dtype == (FP32 if grad_dtype is ... else grad_dtype), name
        assert torch.equal(p, torch.arange(3.0)), name
        p.data = p.data.to(BF16)  # the default still follows a conversion, an explicit one not
        assert p.grad_dtype == (BF16 if grad_dtype is ... else grad_dtype), name


# ---------------------------------------------------------------------------------------------
# Parity on 2 ranks: fp32 gradients of bf16 parameters


class _Net(nn.Module):
    """Two bf16 blocks and a bf16 head, each with 7 rows (uneven over 2 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(7, 7) for _ in range(2))
        self.head = nn.Linear(7, 1)
        self.to(BF16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = F.gelu(block(x))
        return self.head(x)


def _fp32_grads(how: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model, ref = _Net(), _Net()
    ref.load_state_dict(model.state_dict())
    for p in ref.parameters():
        p.grad_dtype = FP32
    if how == "tensor":
        for p in model.parameters():
            p.grad_dtype = FP32
    mp = MixedPrecisionPolicy(grad_dtype=FP32 if how == "policy" else None)
    for block in model.blocks:
        fully_shard(block, mesh=world_mesh(), mp_policy=mp)
    fully_shard(model, mesh=world_mesh(), mp_policy=mp)
    seen: list[torch.dtype] = []  # the unsharded parameters' gradients, as backward leaves them
    for fp in _fsdp_params(model):
        assert fp.unsharded is not None
        fp.unsharded.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.dtype))
    world = torch.distributed.get_world_size()
    losses, ref_losses = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 7, generator=g).to(BF16), torch.randn(4, 1, generator=g)
        loss = F.mse_loss(model(mine(x)).float(), mine(y))
        loss.backward()
        losses.append(loss.detach())
        ref_grads: dict[str, torch.Tensor] = {}
        for r in range(world):  # each rank's slice, averaged by hand (fp32, as the reduction)
            ref.zero_grad(set_to_none=True)
            n = x.size(0) // world
            ref_loss = F.mse_loss(ref(x[r * n : (r + 1) * n]).float(), y[r * n : (r + 1) * n])
            ref_loss.backward()
            if r == torch.distributed.get_rank():
                ref_losses.append(ref_loss.detach())
            for name, p in ref.named_parameters():
                ref_grads[name] = ref_grads.get(name, 0) + p.grad  # type: ignore[operator]
        grads = full_grads(model)
        for name, p in model.named_parameters():
            assert p.dtype == BF16 and p.grad.dtype == FP32, name
            assert p.grad._spec.tensor_meta.dtype == FP32, name
            torch.testing.assert_close(grads[name], ref_grads[name] / world, rtol=1e-5, atol=1e-6)
        with torch.no_grad():  # the same SGD update of bf16 weights from fp32 gradients
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                p.add_(p.grad.to(BF16), alpha=-0.1)
                q.add_((ref_grads[_name(ref, q)] / world).to(BF16), alpha=-0.1)
        model.zero_grad(set_to_none=True)
    assert set(seen) == {FP32}, seen
    return {
        "losses": torch.stack(losses),
        "ref_losses": torch.stack(ref_losses),
        "params": full_params(model),
        "ref_params": dict(ref.named_parameters()),
        "accumulated": {policy: _accumulate(policy) for policy in ("default", "fp32")},
        "unused": {str(rd): _explicit_reduce_dtype(rd) for rd in (BF16, FP32)},
    }


def _name(model: nn.Module, param: torch.Tensor) -> str:
    return next(n for n, p in model.named_parameters() if p is param)


def _accumulate(policy: str) -> tuple[torch.dtype, list[float]]:
    """Gradient contributions 3 (synced), 256 and 1 (not synced), -256 (synced) into a bf16
    weight: fp32 accumulation gives 4; the default's bf16 sum rounds 256 + 1 to 256 (3)."""
    lin = nn.Linear(1, 2, bias=False, dtype=BF16)
    if policy == "fp32":
        lin.weight.grad_dtype = FP32
    fully_shard(lin, mesh=world_mesh())
    for v, sync in ((3.0, True), (256.0, False), (1.0, False), (-256.0, True)):
        lin.set_requires_gradient_sync(sync)
        lin(torch.full((1, 1), v, dtype=BF16)).sum().backward()
    grad = lin.weight.grad
    return grad.dtype, grad.full_tensor().flatten().tolist()


class _UsedUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4, bias=False, dtype=BF16)
        self.unused = nn.Linear(4, 4, bias=False, dtype=BF16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _explicit_reduce_dtype(reduce_dtype: torch.dtype) -> tuple[list[str], list[str], bool]:
    """``MixedPrecisionPolicy(reduce_dtype=..., grad_dtype=fp32)`` (upstream
    ``test_explicit_reduction_dtype_and_unused_parameter``): reduced in ``reduce_dtype``, landed
    in fp32; an unused parameter (``set_reduce_scatter_unused_params(True)``) gets fp32 zeros."""
    from comm_counter import spy_reduce_scatters

    model = _UsedUnused()
    used, unused = model.used, model.unused
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype, grad_dtype=FP32)
    fully_shard(model, mesh=world_mesh(), mp_policy=mp)
    model.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
    wires: list[str] = []
    with spy_reduce_scatters(lambda t, op, group: wires.append(str(t.dtype))):
        model(torch.ones(2, 4, dtype=BF16)).sum().backward()
    zeros = unused.weight.grad.full_tensor()
    dtypes = [str(used.weight.grad.dtype), str(unused.weight.grad.dtype)]
    return wires, dtypes, bool(torch.all(zeros == 0))


@pytest.mark.parametrize("how", ["tensor", "policy"])
def test_fp32_gradients_of_bf16_parameters(how: str) -> None:
    for res in run_on_ranks(2, _fp32_grads, how):
        torch.testing.assert_close(res["losses"], res["ref_losses"], rtol=1e-6, atol=0)
        for name, want in res["ref_params"].items():
            torch.testing.assert_close(res["params"][name], want.detach(), rtol=0, atol=2**-7)
        assert res["accumulated"] == {"default": (BF16, [3.0, 3.0]), "fp32": (FP32, [4.0, 4.0])}
        for rd, (wires, dtypes, zeros) in res["unused"].items():
            assert (wires, dtypes, zeros) == ([rd], [str(FP32)] * 2, True), rd


# ---------------------------------------------------------------------------------------------
# torch main's test_fully_shard_conversion.py, one rank (fsdp2's override flag: explicit_override)


def _fsdp_params(model: nn.Module) -> list[FSDPParam]:
    out: list[FSDPParam] = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            out += [p for g in m._fsdp_state().groups for p in g.params if p not in out]
    return out


def _mesh() -> Any:
    return init_device_mesh("cpu", (1,))


def _assert_parity(model: nn.Module, reference: nn.Module, *, check_override: bool = False) -> None:
    for actual, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert isinstance(actual, DTensor)
        assert (actual.dtype, actual.device) == (expected.dtype, expected.device)
        assert actual.requires_grad == expected.requires_grad and actual.is_leaf
        assert actual.grad_dtype == expected.grad_dtype, (actual.grad_dtype, expected.grad_dtype)
        if check_override:
            assert explicit_override(actual) == explicit_override(expected)
        torch.testing.assert_close(actual.full_tensor(), expected.detach())
        if expected.grad is None:
            assert actual.grad is None
        else:
            assert isinstance(actual.grad, DTensor)
            assert actual.grad.dtype == expected.grad.dtype
            assert actual.grad._spec.tensor_meta.dtype == expected.grad.dtype
            torch.testing.assert_close(actual.grad.full_tensor(), expected.grad)


def _assert_conversion_requires_clear(model: nn.Module, target: Any) -> None:
    saved = [
        (
            p,
            p.detach().clone(),
            p.grad,
            None if p.grad is None else p.grad.clone(),
            p.grad_dtype,
            explicit_override(p),
        )
        for p in model.parameters()
    ]
    with pytest.raises(RuntimeError, match=CLEAR):
        model.to(target)
    for actual, (p, value, grad, grad_value, grad_dtype, override) in zip(
        model.parameters(), saved, strict=True
    ):
        assert actual is p and actual.dtype == value.dtype and torch.equal(actual, value)
        assert actual.grad is grad
        if grad is not None:
            assert grad.dtype == grad_value.dtype and torch.equal(grad, grad_value)
        assert actual.grad_dtype == grad_dtype and explicit_override(actual) == override


def _linear(bias: bool = True, dtype: torch.dtype = FP32) -> nn.Linear:
    lin = nn.Linear(4, 4, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.fill_(0.25)
        if bias:
            lin.bias.fill_(0.125)
    return lin


def _to_matches_plain_module(grad_dtype: Any, existing_grad: bool) -> None:
    reference = _linear()
    reference.bias.requires_grad_(False)
    model = copy.deepcopy(reference)
    for module in (model, reference):
        if grad_dtype != "default":
            for param in module.parameters():
                param.grad_dtype = grad_dtype
    fully_shard(model, mesh=_mesh())
    inp = torch.arange(8, dtype=FP32).view(2, 4) / 8
    if existing_grad:
        for module in (model, reference):
            for param in module.parameters():
                if param.requires_grad:
                    param.grad = torch.ones_like(param)
    if existing_grad and grad_dtype == FP32:
        _assert_conversion_requires_clear(model, BF16)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    for module in (model, reference):
        module.to(BF16)
    _assert_parity(model, reference, check_override=True)
    assert [p.grad_policy.explicit for p in _fsdp_params(model)] == [grad_dtype != "default"] * 2
    inp = inp.to(BF16)
    for iteration in range(2):
        if iteration:
            model.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
        expected, actual = reference(inp), model(inp)
        torch.testing.assert_close(actual, expected)
        expected.sum().backward()
        actual.sum().backward()
        del actual, expected
        _assert_parity(model, reference)
        optimizers: list[type[torch.optim.Optimizer]] = [torch.optim.SGD]
        if all(p.grad is None or p.dtype == p.grad.dtype for p in reference.parameters()):
            optimizers += [torch.optim.Adam, torch.optim.AdamW]
        for optimizer in optimizers:
            for module in (model, reference):
                optimizer(module.parameters(), lr=0.01).step()
            _assert_parity(model, reference)


@pytest.mark.parametrize("existing_grad", [False, True])
@pytest.mark.parametrize("grad_dtype", ["default", FP32, None], ids=["default", "fp32", "none"])
def test_to_matches_plain_module(grad_dtype: Any, existing_grad: bool) -> None:
    run_on_ranks(1, _to_matches_plain_module, grad_dtype, existing_grad)


def _conversions_require_clear() -> None:
    # a bf16 parameter with an fp32 gradient: .to(bf16) too, even after zeroing in place
    reference = _linear(bias=False, dtype=BF16)
    model = copy.deepcopy(reference)
    for module in (model, reference):
        module.weight.grad_dtype = FP32
    fully_shard(model, mesh=_mesh())
    inp = torch.ones(2, 4, dtype=BF16)
    for module in (model, reference):
        module(inp).sum().backward()
    _assert_conversion_requires_clear(model, BF16)
    model.zero_grad(set_to_none=False)
    _assert_conversion_requires_clear(model, BF16)
    for module in (model, reference):
        module.zero_grad(set_to_none=True)
        module.to(BF16)
    _assert_parity(model, reference, check_override=True)
    for module in (model, reference):
        module(inp).sum().backward()
    _assert_parity(model, reference, check_override=True)

    # a device-only conversion (the same device) with an fp32 gradient of a bf16 parameter
    for grad_dtype in (FP32, None):
        reference = _linear(bias=False, dtype=BF16)
        model = copy.deepcopy(reference)
        for module in (model, reference):
            module.weight.grad_dtype = grad_dtype
        fully_shard(model, mesh=_mesh())
        for module in (model, reference):
            module.weight.grad = torch.ones_like(module.weight, dtype=FP32)
        _assert_conversion_requires_clear(model, torch.device("cpu"))
        for module in (model, reference):
            module.zero_grad(set_to_none=True)
            module.to(device="cpu")
        _assert_parity(model, reference, check_override=True)
        for module in (model, reference):
            module(inp).sum().backward()
        _assert_parity(model, reference, check_override=True)

    # nested and grouped modules: the check covers every group below, before any converts
    for grouped in (False, True):
        model = nn.Sequential(_linear(), _linear())
        model[1].weight.grad_dtype = FP32
        if grouped:
            fully_shard(list(model), mesh=_mesh())
        else:
            for layer in model:
                fully_shard(layer, mesh=_mesh())
        fully_shard(model, mesh=_mesh())
        model[1].weight.grad = torch.ones_like(model[1].weight)
        _assert_conversion_requires_clear(model, BF16)
        model.zero_grad(set_to_none=True)
        model.to(BF16)
        model(torch.ones(2, 4, dtype=BF16)).sum().backward()
        for param in model.parameters():
            assert param.dtype == BF16 and param.grad is not None
            assert param.grad.dtype == param.grad_dtype, (param.grad.dtype, param.grad_dtype)
        assert model[1].weight.grad.dtype == FP32

    # a tied parameter: converting the other module is refused, nothing converted
    first, second = _linear(bias=False), _linear(bias=False)
    second.weight = first.weight
    first.weight.grad_dtype = FP32
    fully_shard([first, second], mesh=_mesh())
    first.weight.grad = torch.ones_like(first.weight)
    _assert_conversion_requires_clear(second, BF16)
    assert first.weight is second.weight and first.weight.dtype == FP32


def test_conversions_require_clear() -> None:
    run_on_ranks(1, _conversions_require_clear)


def _pending_grads() -> None:
    # a pending (not reduced) gradient blocks a conversion that changes its parameter's dtype
    for grad_dtype in ("default", None):
        model = _linear(bias=False)
        if grad_dtype is None:
            model.weight.grad_dtype = None
        fully_shard(model, mesh=_mesh(), mp_policy=MixedPrecisionPolicy(BF16, FP32))
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        inp = torch.ones(2, 4, dtype=BF16)
        model(inp).sum().backward()
        group = model._fsdp_state().groups[0]
        fp = group.params[0]
        assert group.sharded_state is Sharded.UNSHARDED
        pending, partial = model.get_pending_gradients()[fp.sharded]
        assert partial is None and pending.dtype == FP32 and not isinstance(pending, DTensor)
        assert fp.unsharded is not None
        storage = fp.unsharded.untyped_storage().nbytes()
        value = pending.clone()
        _assert_conversion_requires_clear(model, BF16)
        assert group.sharded_state is Sharded.UNSHARDED  # refused before resharding
        assert fp.unsharded.untyped_storage().nbytes() == storage
        assert model.get_pending_gradients()[fp.sharded][0] is pending
        assert torch.equal(pending, value)
        model.zero_grad(set_to_none=True)
        model.to(BF16)
        model.set_requires_gradient_sync(True)
        model(inp).sum().backward()
        model.reshard()
        assert model.weight.dtype == BF16 and model.weight.grad is not None

    # a conversion that changes nothing keeps the pending gradient
    model = _linear(bias=False)
    fully_shard(model, mesh=_mesh(), mp_policy=MixedPrecisionPolicy(BF16, BF16))
    sharded = model.weight
    model.set_requires_gradient_sync(False)
    inp = torch.ones(2, 4, dtype=BF16)
    model(inp).sum().backward()
    assert model.weight is sharded and sharded.dtype == FP32 and sharded.grad is None
    pending, partial = model.get_pending_gradients()[sharded]
    assert partial is None and pending.dtype == BF16
    value = pending.clone()
    model.float()
    assert model.weight is sharded
    assert model.get_pending_gradients()[sharded][0] is pending and torch.equal(pending, value)
    model.set_requires_gradient_sync(True)
    model(inp).sum().backward()
    assert sharded.grad.dtype == FP32
    assert torch.equal(sharded.grad.full_tensor(), torch.full((4, 4), 4.0))


def test_pending_grads_and_conversions() -> None:
    run_on_ranks(1, _pending_grads)


_CHANGES = [
    ("default", FP32, "forward"),
    (FP32, None, "forward"),
    (None, FP32, "forward"),
    ("default", BF16, "forward_after_warmup"),
    ("default", FP32, "conversion"),
    (FP32, None, "load_state_dict"),
]


def _change_rejected(initial: Any, replacement: Any, boundary: str) -> None:
    from fsdp2._core.support.observe import HUB, Collective, Observer

    class Count(Observer):
        n = 0

        def collective(self, c: Collective) -> None:
            Count.n += 1

    model = _linear(bias=False)
    if initial != "default":
        model.weight.grad_dtype = initial
    fully_shard(model, mesh=_mesh())
    inp = torch.ones(2, 4)
    if boundary == "forward_after_warmup":
        model(inp).sum().backward()
        model.zero_grad(set_to_none=True)
    state_dict = model.state_dict() if boundary == "load_state_dict" else None
    # setting the default's own dtype explicitly changes the policy too: later conversions
    # would stop following the dtype
    model.weight.grad_dtype = replacement
    with HUB.observing(Count()), pytest.raises(RuntimeError, match=r"grad_dtype.*fully_shard"):
        if boundary == "conversion":
            model.to(BF16)
        elif boundary == "load_state_dict":
            model.load_state_dict(state_dict, assign=True)
        else:
            model(inp)
    assert Count.n == 0, f"{Count.n} collectives before the error"
    assert model.weight.dtype == FP32


@pytest.mark.parametrize(
    "initial, replacement, boundary", _CHANGES, ids=[f"{a}-{b}-{c}" for a, b, c in _CHANGES]
)
def test_grad_dtype_change_after_fully_shard_rejected(
    initial: Any, replacement: Any, boundary: str
) -> None:
    run_on_ranks(1, _change_rejected, initial, replacement, boundary)


def _policy_kept(grad_dtype: Any) -> None:
    reference = _linear(bias=False)
    model = copy.deepcopy(reference)
    if grad_dtype != "default":
        for module in (model, reference):
            module.weight.grad_dtype = grad_dtype
    reduce_dtype = None if grad_dtype == "default" else grad_dtype
    fully_shard(model, mesh=_mesh(), mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype))
    for module in (model, reference):
        module.to(BF16)
    _assert_parity(model, reference, check_override=True)
    previous = model.weight
    state_dict = model.state_dict()
    replacement = nn.Parameter(state_dict["weight"])
    replacement.grad_dtype = torch.float64
    state_dict["weight"] = replacement
    model.load_state_dict(state_dict, assign=True)
    assert model.weight is not previous and model.weight is replacement
    override = grad_dtype != "default"
    _assert_parity(model, reference, check_override=override)
    for module in (model, reference):
        module.to(FP32)
    _assert_parity(model, reference, check_override=override)
    inp = torch.arange(8, dtype=FP32).view(2, 4) / 8
    for _ in range(2):
        for module in (model, reference):
            module.zero_grad(set_to_none=True)
            module(inp).sum().backward()
        _assert_parity(model, reference, check_override=override)
        assert [p.grad_policy.explicit for p in _fsdp_params(model)] == [override]


@pytest.mark.parametrize("grad_dtype", ["default", FP32, None], ids=["default", "fp32", "none"])
def test_grad_dtype_policy_kept_across_conversion_and_replacement(grad_dtype: Any) -> None:
    run_on_ranks(1, _policy_kept, grad_dtype)


# ---------------------------------------------------------------------------------------------
# torch main's test_fully_shard_grad_dtype.py (TestFullyShardGradientDtype, PR 197368), ported:
# CUDA-only upstream (2+ GPUs). Every case runs on 2 CPU ranks here (gloo; HSDP as a 2x1
# mesh), its projection's fp32 weight gradient computed as the test's own reference computes
# it; under `make gpu-check` on one GPU (NCCL, 1D), with the CUDA-only kernel
# (torch.mm(out_dtype=torch.float32)), torch.compile of the projection, and the conversions
# moving between the GPU and the host.

SCHEDULES = ("sync", "no_sync", "checkpoint")


class _FP32WGrad(torch.autograd.Function):
    """torch's test projection: bf16 operands, an fp32 weight gradient out of backward. On
    CUDA by torch's test's kernel, ``torch.mm(..., out_dtype=torch.float32)``
    (``NotImplementedError`` on the CPU); on the CPU as that test's reference computes it, fp32
    arithmetic on the same bf16 operands."""

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inp, weight)
        return inp @ weight.T

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inp, weight = ctx.saved_tensors
        if grad_output.is_cuda:
            grad_weight = torch.mm(grad_output.T.contiguous(), inp, out_dtype=FP32)
        else:
            grad_weight = grad_output.float().T @ inp.float()
        return grad_output @ weight, grad_weight


class _Projection(nn.Module):
    """torch's test ``_Linear``: a 32x32 weight of 0.125 through ``_FP32WGrad``."""

    def __init__(self, device: torch.device, dtype: torch.dtype, compile_projection: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.full((32, 32), 0.125, device=device, dtype=dtype))
        apply = _FP32WGrad.apply
        self.projection = torch.compile(apply, fullgraph=True) if compile_projection else apply

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return self.projection(inp, self.weight)


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    if dist.get_world_size() > 1:  # (one rank on a GPU: nothing to sum)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def _port_meshes(device: str) -> tuple[torch.device, dict[str, Any]]:
    """The test device and meshes: every rank (1D) and HSDP 2 x world/2 on the CPU; one GPU's
    1-rank NCCL mesh (tests/devices.py; HSDP needs 4 GPUs upstream)."""
    if device == "cuda":
        from devices import one_rank_mesh

        return torch.device("cuda", 0), {"1d": one_rank_mesh()}
    world = dist.get_world_size()
    meshes = {"1d": init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))}
    if world % 2 == 0:
        names = ("replicate", "shard")
        meshes["hsdp"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=names)
    return torch.device("cpu"), meshes


def _fp32_gradient(
    dev: torch.device,
    storage: torch.dtype,
    raf: bool,
    schedule: str,
    mesh: Any,
    compile_projection: bool,
) -> None:
    """``test_fp32_gradient``: ``MixedPrecisionPolicy(param_dtype=bf16, grad_dtype=fp32)``
    without ``reduce_dtype`` (it must not fall back to bf16): the unsharded parameter receives
    the projection's fp32 gradient bit for bit, the sharded gradient is fp32 (its spec too)
    and bit-equal to the summed gradients' chunk, the storage keeps its dtype."""
    case = (storage, raf, schedule, mesh.ndim, compile_projection)
    rank = dist.get_rank()
    projection = _Projection(dev, storage, compile_projection)
    model = nn.Sequential(projection)
    policy = MixedPrecisionPolicy(param_dtype=BF16, grad_dtype=FP32)
    fully_shard(projection, mesh=mesh, mp_policy=policy, reshard_after_forward=raf)
    fully_shard(model, mesh=mesh)
    projection.set_gradient_divide_factor(1.0)  # type: ignore[operator]
    projection.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    fsdp_param = _fsdp_params(projection)[0]
    shard_size, shard_rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    for step in range(2):
        model.zero_grad(set_to_none=step == 0)
        expected = torch.zeros((32, 32), device=dev, dtype=FP32)
        for microbatch in range(2):
            projection.set_requires_gradient_sync(  # type: ignore[operator]
                schedule != "no_sync" or microbatch == 1
            )
            inp = torch.full(
                (2 + microbatch, 32), 1.0078125, device=dev, dtype=BF16, requires_grad=True
            )
            if schedule == "checkpoint":
                output = checkpoint(model, inp, use_reentrant=False)
            else:
                output = model(inp)
            unsharded = fsdp_param.unsharded
            assert unsharded is not None and unsharded.dtype == BF16, case
            grad_output = torch.full_like(output, 1.0078125 * (rank + 1))
            # fp32 arithmetic on the same bf16 operands: the reference for the mixed GEMM
            local_grad = grad_output.float().T @ inp.detach().float()
            assert not torch.equal(local_grad, local_grad.bfloat16().float()), case
            received: list[torch.Tensor] = []
            handle = unsharded.register_hook(
                lambda g, seen=received: seen.append(g.detach().clone())
            )
            output.backward(grad_output)
            handle.remove()
            assert len(received) == 1 and received[0].dtype == FP32, (case, received)
            assert torch.equal(received[0], local_grad), case
            expected.add_(_sum_over_ranks(local_grad))
            if schedule == "no_sync" and microbatch == 0:
                continue
            grad = projection.weight.grad
            assert projection.weight.dtype == storage, case
            assert grad.dtype == FP32 and grad._spec.tensor_meta.dtype == FP32, case
            assert torch.equal(grad.to_local(), expected.chunk(shard_size)[shard_rank]), case
        with torch.no_grad():
            projection.weight.add_(projection.weight.grad.to(storage), alpha=-0.001)


def _default_and_explicit(dev: torch.device, mesh: Any) -> None:
    """``test_default_gradient_dtype`` and ``test_explicit_reduction_dtype_and_unused_parameter``.

    Without ``grad_dtype`` (``reduce_dtype=fp32``) the unsharded parameter receives its bf16
    gradient and the sharded one is in the storage dtype. With
    ``reduce_dtype`` bf16 or fp32 and ``grad_dtype=fp32``: reduced in ``reduce_dtype``,
    landed in fp32, bit-equal to the sum; an unused parameter gets fp32 zeros."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for storage in (BF16, FP32):
        projection = _Projection(dev, storage)
        mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
        fully_shard(projection, mesh=mesh, mp_policy=mp)
        inp = torch.full((2, 32), 1.0078125, device=dev, dtype=BF16)
        output = projection(inp)
        unsharded = _fsdp_params(projection)[0].unsharded
        assert unsharded is not None
        received: list[torch.dtype] = []
        handle = unsharded.register_hook(lambda g, seen=received: seen.append(g.dtype))
        output.backward(torch.full_like(output, 1.0078125))
        handle.remove()
        assert received == [BF16], (storage, received)
        assert projection.weight.grad.dtype == storage, storage
    for reduce_dtype in (BF16, FP32):
        projection = _Projection(dev, BF16)
        projection.register_parameter("unused", nn.Parameter(torch.zeros_like(projection.weight)))
        mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype, grad_dtype=FP32)
        fully_shard(projection, mesh=mesh, mp_policy=mp)
        projection.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
        projection.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        projection.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        output = projection(inp)
        grad_output = torch.full_like(output, 1.0078125)
        expected = _sum_over_ranks((grad_output.float().T @ inp.float()).to(reduce_dtype))
        output.backward(grad_output)
        grad = projection.weight.grad
        assert grad.dtype == FP32, reduce_dtype
        assert torch.equal(grad.to_local(), expected.float().chunk(world)[rank]), reduce_dtype
        unused = projection.unused.grad
        assert unused.dtype == FP32 and torch.count_nonzero(unused.to_local()) == 0


def _fail_on_parameter(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.requires_grad:
        raise RuntimeError("parameter conversion failed")
    return tensor.clone()


def _fail_on_buffer(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel() == 1:
        raise RuntimeError("buffer conversion failed")
    return tensor.cpu()


def _conversions(dev: torch.device, mesh: Any) -> None:
    """``test_parameter_conversion_with_gradient``, ``test_partial_parameter_conversion_failure``
    and ``test_parameter_dtype_conversion_preserves_gradient``, with fsdp2's rules (torch
    main's PR 197203; docs/migration.md): PR 197368's tests carry an existing gradient through
    any conversion; fsdp2 does where the gradient stays in its parameter's gradient dtype and
    beside a parameter of that dtype (a device move of fp32 parameters), and otherwise refuses
    before anything converts and asks for ``zero_grad(set_to_none=True)`` (a bf16 parameter
    holding an fp32 gradient; a dtype conversion with an explicit fp32 ``grad_dtype``)."""
    host = torch.device("cpu")
    inp = torch.full((3, 32), 1.0078125, device=dev, dtype=BF16)

    def step(model: nn.Module) -> None:
        model(inp).backward(torch.full_like(inp, 1.0078125))

    for storage in (BF16, FP32):
        for grad_dtype in (None, FP32):
            case = (storage, grad_dtype)
            model = nn.Sequential(_Projection(dev, storage))
            mp = MixedPrecisionPolicy(param_dtype=BF16, grad_dtype=grad_dtype)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            step(model)
            param = model[0].weight
            expected_param = param.to_local().detach().clone()
            expected_grad = param.grad.to_local().clone()
            expected_dtype = grad_dtype or storage
            original_grad = param.grad
            if expected_dtype != storage:  # fsdp2: a bf16 parameter with an fp32 gradient
                with pytest.raises(RuntimeError, match=CLEAR):
                    model._apply(_fail_on_parameter)
                _assert_conversion_requires_clear(model, host)
                assert param.grad is original_grad and param.device == dev, case
                continue
            with pytest.raises(RuntimeError, match="parameter conversion failed"):
                model._apply(_fail_on_parameter)
            assert param.grad is original_grad, case
            del original_grad
            model.cpu()
            assert model[0].weight is param and param.device.type == "cpu", case
            assert param.grad.device.type == "cpu", case
            assert param.grad_dtype == param.grad.dtype == expected_dtype, case
            assert param.grad._spec.tensor_meta.dtype == expected_dtype, case
            assert torch.equal(param.to_local(), expected_param.cpu()), case
            assert torch.equal(param.grad.to_local(), expected_grad.cpu()), case
            model.to(device=dev)
            assert param.grad.dtype == expected_dtype, case
            assert torch.equal(param.grad.to_local(), expected_grad), case
            step(model)
            assert torch.equal(param.grad.to_local(), expected_grad * 2), case

    for storage in (BF16, FP32):  # a buffer's conversion fails midway
        model = nn.Sequential(_Projection(dev, storage), _Projection(dev, storage))
        model[0].register_buffer("conversion_sentinel", torch.ones(1, device=dev))
        fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(BF16, grad_dtype=FP32))
        step(model)
        params = list(model.parameters())
        expected_grads = [p.grad.to_local().clone() for p in params]
        if storage == BF16:  # fsdp2: refused before anything converts
            with pytest.raises(RuntimeError, match=CLEAR):
                model._apply(_fail_on_buffer)
            assert [p.device for p in params] == [dev, dev], storage
            for p, expected in zip(params, expected_grads, strict=True):
                assert torch.equal(p.grad.to_local(), expected), storage
            continue
        with pytest.raises(RuntimeError, match="buffer conversion failed"):
            model._apply(_fail_on_buffer)
        assert params[0].device.type == "cpu" and params[1].device == dev, storage
        for p, expected in zip(params, expected_grads, strict=True):
            assert p.grad is not None and p.grad.device == p.device, storage
            assert p.grad.dtype == FP32, storage
            assert torch.equal(p.grad.to_local(), expected.to(p.device)), storage
        model.to(device=dev)
        step(model)
        for p, expected in zip(params, expected_grads, strict=True):
            assert torch.equal(p.grad.to_local(), expected * 2), storage

    for storage in (BF16, FP32):  # dtype conversions with an explicit fp32 grad_dtype
        for conversion in ("bfloat16", "half", "to_bfloat16", "to_cpu_bfloat16"):
            case = (storage, conversion)
            model = _Projection(dev, storage)
            fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(BF16, grad_dtype=FP32))
            step(model)
            expected = model.weight.grad.to_local().clone()
            assert not torch.equal(expected, expected.bfloat16().float()), case
            assert not torch.equal(expected, expected.half().float()), case
            target_dtype = torch.float16 if conversion == "half" else BF16
            target_device = host if conversion == "to_cpu_bfloat16" else dev

            def convert(
                model: nn.Module = model,
                conversion: str = conversion,
                device: torch.device = target_device,
                dtype: torch.dtype = target_dtype,
            ) -> None:
                if conversion in ("bfloat16", "half"):
                    getattr(model, conversion)()
                else:
                    model.to(device=device, dtype=dtype)

            original = model.weight.grad
            with pytest.raises(RuntimeError, match=CLEAR):  # fsdp2: clear first
                convert()
            assert model.weight.dtype == storage and model.weight.grad is original, case
            model.zero_grad(set_to_none=True)
            convert()
            assert model.weight.dtype == target_dtype, case
            assert model.weight.device == target_device and model.weight.grad is None, case
            assert model.weight.grad_dtype == FP32, case
            model.to(device=dev, dtype=storage)
            step(model)
            assert torch.equal(model.weight.grad.to_local(), expected), case


def _grad_dtype_port(device: str, compile_projection: bool) -> None:
    dev, meshes = _port_meshes(device)
    for storage, raf, schedule, mesh in itertools.product(
        (BF16, FP32), (False, True), SCHEDULES, meshes.values()
    ):
        _fp32_gradient(dev, storage, raf, schedule, mesh, compile_projection)
    if not compile_projection:  # (upstream compiles the projection in test_fp32_gradient only)
        _default_and_explicit(dev, meshes["1d"])
        _conversions(dev, meshes["1d"])


def test_torch_grad_dtype_cases() -> None:
    run_on_ranks(2, _grad_dtype_port, "cpu", False)


@pytest.mark.gpu
@pytest.mark.parametrize("compile_projection", [False, True], ids=["eager", "compiled"])
def test_torch_grad_dtype_cases_cuda(compile_projection: bool) -> None:
    require_cuda("torch.mm(out_dtype=torch.float32)")  # tests/devices.py
    if compile_projection:
        from torch.utils._triton import has_triton

        if not has_triton():
            pytest.skip("torch.compile on CUDA needs triton")
    for _ in range(REPEATS):
        run_on_ranks(1, _grad_dtype_port, "cuda", compile_projection)


# ---------------------------------------------------------------------------------------------
# Planning: gradient bytes in the gradients' dtype


def test_estimate_counts_gradients_in_their_dtype() -> None:
    def estimate(mp: MixedPrecisionPolicy) -> int:
        with torch.device("meta"):
            model = _Net()
        batch = torch.empty(4, 7, dtype=BF16, device="meta")
        est = fsdp2.estimate_memory(
            model, batch, mesh_shape=2, device="cpu", mp_policy=mp, optimizer="sgd", compare=False
        )
        return est.held["gradients"]

    bf16, fp32 = estimate(MixedPrecisionPolicy()), estimate(MixedPrecisionPolicy(grad_dtype=FP32))
    # rank 0's rows of each parameter: 4 of 7 rows of the blocks' weights and biases, the head's
    # one row and its bias
    elements = 2 * (4 * 7 + 4) + 7 + 1
    assert (bf16, fp32) == (2 * elements, 4 * elements)
