"""Mixed precision (``MixedPrecisionPolicy``): numerics, casts and communication volume.

* Parity: training under a policy matches torch's FSDP2 under the same policy bit for bit
  (losses, full gradients, full parameters, every step), and matches a replicated reference
  that performs the same casts by hand (see [Note: mixed-precision reference]). Covered:
  bf16/fp16 compute with fp32 or low-precision reduction (fp16 reduction divides before and
  after the sum), ``reduce_dtype`` alone, per-module policies (fp32 norms or an fp32 block
  inside a bf16 model) and gradient accumulation without sync (accumulated in
  ``reduce_dtype``).
* Forward computes with ``param_dtype`` weights while the registered parameters, their
  gradients and the optimizer state stay fp32 DTensors.
* ``output_dtype`` casts floating outputs; ``cast_forward_inputs=False`` leaves a
  module's inputs alone, the root's included (as torch's FSDP2).
* ``reduce_dtype == param_dtype`` behaves as ``reduce_dtype=None``.
* The all-gather moves ``param_dtype`` bytes: half of fp32's for bf16.

# [Note: mixed-precision reference]
# ``reference`` keeps fp32 master weights. Every step and for every rank's slice of the
# global batch it copies the masters into a ``low`` copy (each parameter cast to its group's
# param_dtype; inputs cast by forward pre-hooks where the policy casts them), runs forward
# and backward there, casts each rank's gradients to the reduce dtype, averages them over
# ranks (in float64, rounded once to the reduce dtype) and casts the average to fp32. Forward
# and backward per rank are the same ops on the same values as in the sharded run, so losses
# agree to the order of a sum over ranks, and gradients to the rounding of the collective
# (gloo's summation order and, for fp16, the pre-division; see _grad_tol).
# The reference then steps fp32 AdamW on fsdp2's gradients (teacher forcing), so the
# parameters are compared with an fp32 tolerance. Without it, one gradient rounded the
# other way can flip the sign of a near-zero gradient, and AdamW's first update
# (lr * g / (|g| + eps), about lr * sign(g)) would then differ by 2 * lr: no tolerance would
# separate that from a bug. Each step's gradients are still checked against the reference's
# own, so an error in them cannot hide behind the forcing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from comm_counter import spy_all_gathers, spy_reduce_scatters
from helpers import check_same, world_mesh
from models import MLPBlock, build, full_grads, full_params, make_batch, mean_over_ranks, rank_slice
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2 import MixedPrecisionPolicy

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
STEPS = 3
ENGINES: dict[str, tuple[Callable[..., Any], type]] = {
    "fsdp2": (fsdp2.fully_shard, MixedPrecisionPolicy),
    "torch": (torch_fully_shard, TorchMixedPrecisionPolicy),
}
# Keyword arguments of MixedPrecisionPolicy (plain data: they travel to the ranks pickled).
POLICIES: dict[str, dict[str, Any]] = {
    "bf16-reduce32": {"param_dtype": BF16, "reduce_dtype": FP32},
    "bf16": {"param_dtype": BF16},
    "fp16-reduce32": {"param_dtype": FP16, "reduce_dtype": FP32},
    "fp16": {"param_dtype": FP16},
    "reduce32": {"reduce_dtype": FP32},
}
# Losses: same per-rank floats, summed over ranks in another order (fp32). Parameters: the
# same fp32 AdamW update of the same gradients on the same masters (see the note). Both are
# far tighter than the bugs they must catch: a missing cast at a module boundary changes a
# loss by ~2^-8 relative (bf16), an update applied in low precision rounds parameters to
# ~2^-8 relative, a missing average scales gradients by the world size.
_LOSS_RTOL = 1e-6
_PARAM_ATOL = 1e-6


def _grad_tol(per_rank: list[torch.Tensor], reduce_dtype: torch.dtype) -> torch.Tensor:
    """Element-wise bound on |collective average - exactly rounded average|.

    Each of the ``N - 1`` additions the collective makes in ``reduce_dtype`` rounds by at
    most half an ulp of a partial sum, bounded by ``sum_r |g_r|``; the division by a power
    of two is exact; our reference rounds once more. So ``N * eps * mean_r |g_r|`` bounds
    the gap (with a factor 2 of slack).
    """
    n = len(per_rank)
    mean_abs = torch.stack([g.double().abs() for g in per_rank]).mean(0)
    # fp16 (pre-divided before the sum) can land in subnormals: an absolute error of up to
    # half their spacing per operation.
    info = torch.finfo(reduce_dtype)
    floor = 2 * n * info.smallest_normal * info.eps
    return (2 * n * info.eps * mean_abs + floor).float()


# ---------------------------------------------------------------------------------------------
# Models, layouts and the reference


class _CastingBlock(nn.Module):
    """``relu(lin(x))`` that casts its input to its weight's dtype itself, so it runs on
    inputs that FSDP did not cast (``cast_forward_inputs=False``)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.lin(x.to(self.lin.weight.dtype)))


class _CastStack(nn.Module):
    """``MLPBlock(7, 5) -> _CastingBlock(5, 3) -> MLPBlock(3, 1, relu=False)``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MLPBlock(7, 5), _CastingBlock(5, 3), MLPBlock(3, 1, False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _TwoOutputs(nn.Module):
    """Returns ``(lin(x), argmax)``: one floating output and one integer output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        return y, y.argmax(-1)


Layout = list[tuple[str, dict[str, Any]]]  # (module path, policy kwargs), bottom-up, root last


def _uniform(model_name: str, policy: dict[str, Any]) -> Layout:
    n = len(build(model_name).layers)
    return [(f"layers.{i}", policy) for i in range(n)] + [("", policy)]


def _fp32_norms_layout(policy: dict[str, Any]) -> Layout:
    """Every norm of the tiny transformer in its own group with the default (fp32) policy,
    inside bf16 blocks: the norms get bf16 inputs and fp32 weights."""
    norms: Layout = []
    for i in range(len(build("transformer").layers)):
        norms += [(f"layers.{i}.attn_norm", {}), (f"layers.{i}.mlp_norm", {})]
    return norms + [("norm", {})] + _uniform("transformer", policy)


def _fp32_block_layout(policy: dict[str, Any]) -> Layout:
    """The middle block of ``mlp_head`` kept fp32 (``param_dtype=fp32`` so it casts its bf16
    input up; the next bf16 block casts it back down)."""
    return [
        ("layers.0", policy),
        ("layers.1", {"param_dtype": FP32}),
        ("layers.2", policy),
        ("", policy),
    ]


def _shard(model: nn.Module, layout: Layout, engine: str, mesh: Any) -> nn.Module:
    fully_shard_fn, policy_cls = ENGINES[engine]
    for path, kw in layout:
        fully_shard_fn(model.get_submodule(path), mesh=mesh, mp_policy=policy_cls(**kw))
    return model


def _loss(model: nn.Module, model_name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The tests' loss, computed in fp32 on the (possibly low-precision) outputs."""
    out = model(x).float()
    if model_name == "transformer":
        return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))
    return F.mse_loss(out, y)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return torch.utils._pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        tree,
    )


class _Reference:
    """Replicated training that performs the policy's casts by hand; see
    [Note: mixed-precision reference]."""

    def __init__(self, model_name: str, layout: Layout, world_size: int) -> None:
        self.model_name = model_name
        self.world_size = world_size
        self.master = build(model_name)
        self.low = copy.deepcopy(self.master)
        self.opt = torch.optim.AdamW(self.master.parameters(), lr=1e-2, weight_decay=0.1)
        self.policy: dict[str, dict[str, Any]] = {}  # param name -> its group's policy
        for path, kw in layout:
            module = self.low.get_submodule(path)
            for name, _ in module.named_parameters(prefix=path):
                self.policy.setdefault(name, kw)
            param_dtype = kw.get("param_dtype")
            if param_dtype is not None and kw.get("cast_forward_inputs", True):
                module.register_forward_pre_hook(
                    lambda m, args, kwargs, d=param_dtype: _cast_floats((args, kwargs), d),
                    with_kwargs=True,
                )
            if kw.get("output_dtype") is not None:
                module.register_forward_hook(
                    lambda m, args, out, d=kw["output_dtype"]: _cast_floats(out, d)
                )
        with torch.no_grad():
            for name, p in self.low.named_parameters():
                p.data = p.data.to(self.param_dtype(name))
        self.acc: list[dict[str, torch.Tensor]] = [{} for _ in range(world_size)]

    def param_dtype(self, name: str) -> torch.dtype:
        return self.policy[name].get("param_dtype") or FP32

    def reduce_dtype(self, name: str) -> torch.dtype:
        return self.policy[name].get("reduce_dtype") or self.param_dtype(name)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One microbatch on every rank's slice; returns the rank-averaged loss. Gradients
        accumulate per rank in the reduce dtype (what a no-sync microbatch does)."""
        with torch.no_grad():
            for lp, mp in zip(self.low.parameters(), self.master.parameters(), strict=True):
                lp.copy_(mp)
        losses = []
        for r in range(self.world_size):
            xs, ys = rank_slice(x, r, self.world_size), rank_slice(y, r, self.world_size)
            loss = _loss(self.low, self.model_name, xs, ys)
            loss.backward()
            losses.append(loss.detach())
            for name, p in self.low.named_parameters():
                g, p.grad = p.grad.to(self.reduce_dtype(name)), None
                acc = self.acc[r]
                acc[name] = g if name not in acc else acc[name] + g
        return torch.stack(losses).mean()

    def sync(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Average the accumulated gradients over ranks; return the fp32 averages and their
        element-wise tolerances."""
        grads, tols = {}, {}
        for name, _ in self.master.named_parameters():
            per_rank = [acc.pop(name) for acc in self.acc]
            avg = torch.stack([g.double() for g in per_rank]).mean(0)
            grads[name] = avg.to(self.reduce_dtype(name)).float()
            tols[name] = _grad_tol(per_rank, self.reduce_dtype(name))
        return grads, tols

    def step(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """fp32 AdamW step of the masters on ``grads``; return the new masters."""
        for name, p in self.master.named_parameters():
            p.grad = grads[name].clone()
        self.opt.step()
        self.opt.zero_grad()
        return {n: p.detach().clone() for n, p in self.master.named_parameters()}


# ---------------------------------------------------------------------------------------------
# Parity


def _check_reference(got: torch.Tensor, want: torch.Tensor, atol: Any, what: str) -> float:
    diff = (got.float() - want.float()).abs()
    bad = diff > atol
    assert not bad.any(), (
        f"{what}: differs from the mixed-precision reference by up to {diff.max().item():.3g} "
        f"at {bad.sum().item()} of {diff.numel()} elements (tolerance there "
        f"{torch.as_tensor(atol).expand_as(diff)[bad].max().item():.3g})"
    )
    return diff.max().item()


def _train_and_compare(model_name: str, layout: Layout, microbatches: int = 1) -> dict:
    """Train reference, fsdp2 and torch for STEPS steps (each of ``microbatches`` microbatches,
    all but the last without gradient sync) and compare every step; return the largest
    differences from the reference (diagnostics)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = world_mesh()
    ref = _Reference(model_name, layout, world_size)
    models = {e: _shard(build(model_name), layout, e, mesh) for e in ENGINES}
    opts = {
        e: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for e, m in models.items()
    }
    # torch first: if it disagrees with the reference too, suspect the reference.
    order = ("torch", "fsdp2")
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(STEPS):
        seen: dict[str, dict[str, torch.Tensor]] = {e: {} for e in ENGINES}
        for micro in range(microbatches):
            x, y = make_batch(model_name, step * microbatches + micro)
            ref_loss = ref.forward_backward(x, y)
            sync = micro == microbatches - 1
            xs, ys = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
            for engine in order:
                model = models[engine]
                model.set_requires_gradient_sync(sync)
                loss = _loss(model, model_name, xs, ys)
                loss.backward()
                seen[engine][f"loss {micro}"] = loss.detach()
                what = f"{engine} step {step} microbatch {micro} loss"
                atol = _LOSS_RTOL * ref_loss.abs()
                d = _check_reference(mean_over_ranks(loss), ref_loss, atol, what)
                worst["loss"] = max(worst["loss"], d)
        ref_grads, grad_tols = ref.sync()
        for engine in order:
            for name, grad in full_grads(models[engine]).items():
                what = f"{engine} step {step} grad of {name}"
                assert grad is not None and grad.dtype == FP32, f"{what}: {grad}"
                d = _check_reference(grad, ref_grads[name], grad_tols[name], what)
                worst["grad"] = max(worst["grad"], d)
                seen[engine][f"grad of {name}"] = grad
        ref_params = ref.step(
            {k[len("grad of ") :]: g for k, g in seen["fsdp2"].items() if k.startswith("grad of ")}
        )
        for engine in order:
            opts[engine].step()
            opts[engine].zero_grad()
            for name, full in full_params(models[engine]).items():
                what = f"{engine} step {step} param {name}"
                assert full.dtype == FP32, f"{what}: dtype {full.dtype}"
                d = _check_reference(full, ref_params[name], _PARAM_ATOL, what)
                worst["param"] = max(worst["param"], d)
                seen[engine][f"param {name}"] = full
        # Same casts, same padding, same divide plan (AVG, or pre/post division for fp16),
        # same optimizer: the two engines compute the same floats on CPU.
        check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch", bitwise=True)
    return worst


WORLD_SIZES = [pytest.param(2, id="ws2"), pytest.param(4, id="ws4")]


@pytest.mark.parametrize("model_name", ["mlp_head", "transformer"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_parity_with_torch_and_reference(world_size: int, policy: str, model_name: str) -> None:
    layout = _uniform(model_name, POLICIES[policy])
    run_on_ranks(world_size, _train_and_compare, model_name, layout)


@pytest.mark.parametrize(
    "layout_name", ["fp32-norms-transformer", "fp32-block-mlp_head"], ids=lambda s: s
)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_per_module_policies(world_size: int, layout_name: str) -> None:
    policy = POLICIES["bf16-reduce32"]
    if layout_name == "fp32-norms-transformer":
        model_name, layout = "transformer", _fp32_norms_layout(policy)
    else:
        model_name, layout = "mlp_head", _fp32_block_layout(policy)
    run_on_ranks(world_size, _train_and_compare, model_name, layout)


@pytest.mark.parametrize("model_name", ["mlp_head", "transformer"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gradient_accumulation_in_reduce_dtype(world_size: int, model_name: str) -> None:
    # Two microbatches with set_requires_gradient_sync(False), then one with True: the
    # unsharded bf16 gradients are summed in fp32 (the reference sums the bf16 gradients
    # cast to fp32), and torch does the same.
    layout = _uniform(model_name, POLICIES["bf16-reduce32"])
    run_on_ranks(world_size, _train_and_compare, model_name, layout, 3)


# ---------------------------------------------------------------------------------------------
# Dtypes seen by forward, the parameters, their gradients and the optimizer


def _dtypes_inside_and_outside_forward() -> None:
    world_size = dist.get_world_size()
    mesh = world_mesh()
    model = build("mlp_head")
    _shard(model, _uniform("mlp_head", POLICIES["bf16-reduce32"]), "fsdp2", mesh)
    seen: list[tuple[torch.dtype, bool]] = []
    inner = model.layers[1].lin  # not itself an FSDP module: sees its group's unsharded params
    inner.register_forward_pre_hook(
        lambda m, args: seen.append((m.weight.dtype, isinstance(m.weight, DTensor)))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x, y = make_batch("mlp_head", step)
        out = model(rank_slice(x, dist.get_rank(), world_size))
        assert out.dtype == BF16, f"step {step}: output {out.dtype}, want bf16 compute"
        assert seen == [(BF16, False)], f"step {step}: inner Linear saw weight {seen}"
        seen.clear()
        F.mse_loss(out.float(), rank_slice(y, dist.get_rank(), world_size)).backward()
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) and p.dtype == FP32, f"{name}: {type(p)} {p.dtype}"
            g = p.grad
            assert isinstance(g, DTensor), f"{name}.grad is {type(g).__name__}, not a DTensor"
            assert g.dtype == FP32 and g.placements == p.placements, f"{name}.grad: {g}"
        opt.step()
        opt.zero_grad()
        for p in model.parameters():
            for key, s in opt.state[p].items():
                if key != "step":
                    assert s.dtype == FP32, f"optimizer state {key}: {s.dtype}, want fp32"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_forward_sees_low_precision_weights(world_size: int) -> None:
    run_on_ranks(world_size, _dtypes_inside_and_outside_forward)


def _record_casts(engine: str, cast_forward_inputs: bool) -> dict[str, Any]:
    """dtypes seen at module boundaries of ``_CastStack`` (bf16 policy; block 0 outputs fp32,
    block 1 casts its inputs or not) and of ``_TwoOutputs`` as a root with ``output_dtype``."""
    mesh = world_mesh()
    fully_shard_fn, policy_cls = ENGINES[engine]
    seen: dict[str, Any] = {}
    model = _CastStack()
    fully_shard_fn(model.layers[0], mesh=mesh, mp_policy=policy_cls(BF16, output_dtype=FP32))
    fully_shard_fn(
        model.layers[1],
        mesh=mesh,
        mp_policy=policy_cls(BF16, cast_forward_inputs=cast_forward_inputs),
    )
    fully_shard_fn(model.layers[2], mesh=mesh, mp_policy=policy_cls(BF16))
    fully_shard_fn(model, mesh=mesh, mp_policy=policy_cls(BF16))
    # Hooks registered after fully_shard run after its pre-forward (casts) and post-forward.
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(f"in {i}", a[0].dtype))
        layer.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(f"out {i}", o.dtype))
    x, y = make_batch("mlp", 0)
    out = model(x)
    F.mse_loss(out.float(), y).backward()
    seen["out"] = out.dtype
    root = _TwoOutputs()
    fully_shard_fn(root, mesh=mesh, mp_policy=policy_cls(BF16, output_dtype=FP32))
    y, idx = root(x)
    seen["two outputs"] = (y.dtype, idx.dtype)
    y.sum().backward()
    # A root with cast_forward_inputs=False does not cast either: the fp32 batch reaches
    # the bf16 Linear, which rejects it (as with torch's FSDP2).
    root = _CastStack()
    fully_shard_fn(root, mesh=mesh, mp_policy=policy_cls(BF16, cast_forward_inputs=False))
    root.register_forward_pre_hook(lambda m, a: seen.__setitem__("root in", a[0].dtype))
    try:
        seen["root out"] = root(x).dtype
    except RuntimeError as e:  # Linear rejects fp32 @ bf16
        seen["root out"] = f"raised {type(e).__name__}"
    return seen


@pytest.mark.parametrize("cast_forward_inputs", [True, False], ids=["cast", "nocast"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_output_dtype_and_cast_forward_inputs(world_size: int, cast_forward_inputs: bool) -> None:
    ours = run_on_ranks(world_size, _record_casts, "fsdp2", cast_forward_inputs)[0]
    theirs = run_on_ranks(world_size, _record_casts, "torch", cast_forward_inputs)[0]
    block1_in = BF16 if cast_forward_inputs else FP32
    want = {
        "in 0": BF16,  # the root cast the fp32 batch
        "out 0": FP32,  # output_dtype
        "in 1": block1_in,
        "out 1": BF16,
        "in 2": BF16,
        "out 2": BF16,
        "out": BF16,
        "two outputs": (FP32, torch.int64),  # integer outputs are left alone
    }
    for key, dtype in want.items():
        assert ours[key] == dtype, f"fsdp2 {key}: {ours[key]}, want {dtype}"
        assert theirs[key] == dtype, f"torch {key}: {theirs[key]}, want {dtype}"
    # cast_forward_inputs=False holds at the root too: it sees the fp32 batch.
    for res in (ours, theirs):
        assert (res["root in"], res["root out"]) == (FP32, "raised RuntimeError"), res


# ---------------------------------------------------------------------------------------------
# reduce_dtype == param_dtype


def _same_as_none(model_name: str) -> dict:
    """fsdp2 with (bf16, reduce bf16), fsdp2 with (bf16, None) and torch with (bf16, reduce
    bf16), with one no-sync microbatch per step: bitwise equal; reduce-scatters in bf16."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = world_mesh()
    both = {"param_dtype": BF16, "reduce_dtype": BF16}
    runs = {
        "fsdp2 reduce=bf16": ("fsdp2", both),
        "fsdp2 reduce=None": ("fsdp2", {"param_dtype": BF16}),
        "torch reduce=bf16": ("torch", both),
    }
    models = {
        k: _shard(build(model_name), _uniform(model_name, kw), e, mesh)
        for k, (e, kw) in runs.items()
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    rs_dtypes: dict[str, set[torch.dtype]] = {k: set() for k in runs}
    for step in range(2):
        seen: dict[str, dict[str, torch.Tensor]] = {k: {} for k in runs}
        for micro in range(2):
            x, y = make_batch(model_name, 2 * step + micro)
            xs, ys = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
            for key, model in models.items():
                model.set_requires_gradient_sync(micro == 1)
                record = rs_dtypes[key].add
                with spy_reduce_scatters(lambda t, op, g, rec=record: rec(t.dtype)):
                    loss = _loss(model, model_name, xs, ys)
                    loss.backward()
                seen[key][f"loss {micro}"] = loss.detach()
        for key, model in models.items():
            seen[key].update({f"grad {n}": g for n, g in full_grads(model).items()})
            opts[key].step()
            opts[key].zero_grad()
            seen[key].update({f"param {n}": p for n, p in full_params(model).items()})
        for key in ("fsdp2 reduce=None", "torch reduce=bf16"):
            for name, want in seen[key].items():
                got = seen["fsdp2 reduce=bf16"][name]
                assert torch.equal(got, want), (
                    f"step {step} {name}: fsdp2 reduce=bf16 differs from {key} "
                    f"(max abs diff {(got - want).abs().max().item():.3g})"
                )
    for key in ("fsdp2 reduce=bf16", "fsdp2 reduce=None"):
        assert rs_dtypes[key] == {BF16}, f"{key}: reduce-scatter inputs in {rs_dtypes[key]}"
    return {k: sorted(map(str, v)) for k, v in rs_dtypes.items()}


@pytest.mark.parametrize("model_name", ["mlp_head", "transformer"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_dtype_equal_to_param_dtype_is_none(world_size: int, model_name: str) -> None:
    run_on_ranks(world_size, _same_as_none, model_name)


# ---------------------------------------------------------------------------------------------
# Communication volume


def _comm_bytes(model_name: str) -> dict[str, dict[str, int]]:
    """Bytes (and calls) into all-gather and reduce-scatter for one training step under
    fp32, bf16-compute/fp32-reduce and bf16 policies."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = world_mesh()
    x, y = make_batch(model_name, 0)
    xs, ys = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
    result = {}
    for name, kw in (
        ("fp32", {}),
        ("bf16-reduce32", POLICIES["bf16-reduce32"]),
        ("bf16", POLICIES["bf16"]),
    ):
        model = _shard(build(model_name), _uniform(model_name, kw), "fsdp2", mesh)
        counts = {"ag_bytes": 0, "ag_calls": 0, "rs_bytes": 0, "rs_calls": 0}

        def count(prefix: str, t: torch.Tensor, counts: dict[str, int] = counts) -> None:
            counts[f"{prefix}_bytes"] += t.numel() * t.element_size()
            counts[f"{prefix}_calls"] += 1

        with spy_all_gathers(lambda t, g: count("ag", t)):
            with spy_reduce_scatters(lambda t, op, g: count("rs", t)):
                _loss(model, model_name, xs, ys).backward()
        result[name] = counts
    return result


@pytest.mark.parametrize("model_name", ["mlp_head", "transformer"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_bytes_halve_with_bf16(world_size: int, model_name: str) -> None:
    for rank, r in enumerate(run_on_ranks(world_size, _comm_bytes, model_name)):
        fp32, mixed, bf16 = r["fp32"], r["bf16-reduce32"], r["bf16"]
        assert fp32["ag_calls"] > 0 and fp32["rs_calls"] > 0, f"rank {rank}: no comms {fp32}"
        for name, c in (("bf16-reduce32", mixed), ("bf16", bf16)):
            assert c["ag_calls"] == fp32["ag_calls"], f"rank {rank} {name}: {c} vs fp32 {fp32}"
            assert c["rs_calls"] == fp32["rs_calls"], f"rank {rank} {name}: {c} vs fp32 {fp32}"
            assert 2 * c["ag_bytes"] == fp32["ag_bytes"], f"rank {rank} {name}: {c}, fp32 {fp32}"
        # Reduction in fp32 moves fp32 bytes; reduction in the compute dtype halves them too.
        assert mixed["rs_bytes"] == fp32["rs_bytes"], f"rank {rank}: {mixed} vs fp32 {fp32}"
        assert 2 * bf16["rs_bytes"] == fp32["rs_bytes"], f"rank {rank}: {bf16} vs fp32 {fp32}"
