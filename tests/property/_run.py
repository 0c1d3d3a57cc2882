"""Rank side of the property-based parity suite: run one ``Spec`` and say what is wrong.

``check_spec(spec, meshes)`` builds the spec's model on every rank (same seed), shards it as
``_spec.plan`` says and either

* expects the documented error ``_spec.expected_error`` names: raised by ``fully_shard`` on
  every rank with that message, before fsdp2 issued any collective; or
* trains two steps (each of one or two microbatches) with SGD or AdamW next to a replicated
  ``Reference`` and compares, every step, the rank-averaged loss of each microbatch, the
  full gradients and, after the optimizer step, the full parameters.

It returns a list of problems (empty: all good) instead of raising, so that the ranks can
agree on the outcome before anyone raises (``agree``): hypothesis then sees the same result
on every rank and every rank moves to the same next example. An exception the spec did not
call for is different: it is raised at once, past hypothesis (``Unexpected``).

# [Note: the replicated reference]
# ``Reference`` keeps fp32 master weights and a ``low`` copy whose parameters are cast to the
# param_dtype of the fully_shard call that manages them, with the policy's input and output
# casts as forward hooks. Each microbatch it runs every data-parallel rank's slice of the
# global batch through ``low`` (the very ops a sharded rank runs on its slice), casts each
# rank's gradients to the reduce dtype and accumulates them per rank (a no-sync microbatch);
# a sync averages over ranks in float64 and rounds once to the reduce dtype. The tolerance of
# a gradient bounds the collective's rounding: each of its N - 1 additions in the reduce
# dtype rounds by half an ulp of a partial sum, plus one rounding for a division by a world
# size that is not a power of two. fp32 runs get the same bound with fp32's epsilon, i.e.
# tight. The reference then steps its masters on fsdp2's gradients (teacher forcing, as
# tests/core/params/test_mixed_precision.py does), so that a gradient rounded the other way cannot
# flip AdamW's first update; each step's gradients are still checked against its own.
"""

from __future__ import annotations

import copy
import hashlib
import re
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _spec import POLICIES, Block, Spec, build, expected_error, mesh_shapes, plan
from models import full_grads, full_params, mean_over_ranks, rank_slice
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2._core.support.observe import HUB, Collective, Observer

STEPS = 2
ROWS_PER_RANK = 2
FP32 = torch.float32


def make_meshes(world_size: int) -> dict[tuple[int, int] | None, DeviceMesh]:
    """Every mesh a spec for ``world_size`` may name, made once (collective)."""
    meshes: dict[tuple[int, int] | None, DeviceMesh] = {}
    for shape in mesh_shapes(world_size):
        if shape is None:
            meshes[shape] = init_device_mesh("cpu", (world_size,))
        else:
            meshes[shape] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    return meshes


# ---------------------------------------------------------------------------------------------
# Sharding


class _Count(Observer):
    def __init__(self) -> None:
        self.collectives = 0

    def collective(self, c: Collective) -> None:
        self.collectives += 1


def shard(spec: Spec, model: Block, mesh: DeviceMesh) -> None:
    """Apply ``plan(spec, model)``'s ``fully_shard`` calls, then the bucket budget."""
    for label, modules, call in plan(spec, model):
        target: Any = modules if label.startswith("[") else modules[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # reshard_after_forward=1 warns that it means False
            fsdp2.fully_shard(
                target,
                mesh=mesh,
                reshard_after_forward=call.reshard,
                mp_policy=fsdp2.MixedPrecisionPolicy(**POLICIES[call.policy]),
            )
    if spec.bucket_bytes is not None:
        model.set_bucket_bytes(spec.bucket_bytes)  # type: ignore[operator]


# ---------------------------------------------------------------------------------------------
# The reference


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return torch.utils._pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        tree,
    )


def _grad_tol(per_rank: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Element-wise bound on |collective average - exactly rounded average|; see
    [Note: the replicated reference]."""
    n = len(per_rank)
    mean_abs = torch.stack([g.double().abs() for g in per_rank]).mean(0)
    info = torch.finfo(dtype)
    return (2 * (n + 1) * info.eps * mean_abs + 2 * n * info.smallest_normal).float()


class Reference:
    """Replicated training with the policies' casts done by hand; see
    [Note: the replicated reference]."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.dp = spec.world_size
        self.master = build(spec)
        self.low = copy.deepcopy(self.master)
        self.policy: dict[int, dict[str, Any]] = {}  # id(low param) -> its call's policy
        for _, modules, call in plan(spec, self.low):
            kw = POLICIES[call.policy]
            for m in modules:
                for p in m.parameters():
                    self.policy.setdefault(id(p), kw)
                if kw.get("param_dtype") is not None and kw.get("cast_forward_inputs", True):
                    m.register_forward_pre_hook(
                        lambda m, a, k, d=kw["param_dtype"]: _cast_floats((a, k), d),
                        with_kwargs=True,
                    )
                if kw.get("output_dtype") is not None:
                    m.register_forward_hook(
                        lambda m, args, out, d=kw["output_dtype"]: _cast_floats(out, d)
                    )
        self.named = list(self.low.named_parameters())
        with torch.no_grad():
            for _, p in self.named:
                p.data = p.data.to(self._param_dtype(p))
        self.opt = make_optimizer(spec.optimizer, self.master.parameters())
        self.acc: list[dict[str, torch.Tensor]] = [{} for _ in range(self.dp)]
        self.synced: dict[str, torch.Tensor] = {}
        self.tols: dict[str, torch.Tensor] = {}

    def _param_dtype(self, p: nn.Parameter) -> torch.dtype:
        return self.policy[id(p)].get("param_dtype") or FP32

    def _reduce_dtype(self, p: nn.Parameter) -> torch.dtype:
        return self.policy[id(p)].get("reduce_dtype") or self._param_dtype(p)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One microbatch on every rank's slice; returns the rank-averaged loss."""
        with torch.no_grad():
            for lp, mp in zip(self.low.parameters(), self.master.parameters(), strict=True):
                lp.copy_(mp)
        losses = []
        for r in range(self.dp):
            loss = loss_fn(self.low, rank_slice(x, r, self.dp), rank_slice(y, r, self.dp))
            loss.backward()
            losses.append(loss.detach())
            for name, p in self.named:
                if p.grad is None:
                    continue
                g, p.grad = p.grad, None
                acc = self.acc[r]  # in place, as fsdp2 and torch: one rounding per microbatch
                acc[name] = g.to(self._reduce_dtype(p)) if name not in acc else acc[name].add_(g)
        return torch.stack(losses).mean()

    def sync(self) -> None:
        """Average the accumulated gradients over ranks into ``synced`` (fp32, summed with
        earlier syncs of the step) and their tolerances into ``tols``."""
        for name, p in self.named:
            if name not in self.acc[0]:
                continue
            per_rank = [acc.pop(name) for acc in self.acc]
            avg = torch.stack([g.double() for g in per_rank]).mean(0)
            avg = avg.to(self._reduce_dtype(p)).float()
            tol = _grad_tol(per_rank, self._reduce_dtype(p))
            if name in self.synced:
                avg, tol = avg + self.synced[name], tol + self.tols[name]
            self.synced[name], self.tols[name] = avg, tol

    def step(self, grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Step the masters on ``grads`` (teacher forcing); return the new masters."""
        for name, p in self.master.named_parameters():
            p.grad = None if grads[name] is None else grads[name].clone()
        self.opt.step()
        self.opt.zero_grad()
        self.synced, self.tols = {}, {}
        return {n: p.detach().clone() for n, p in self.master.named_parameters()}


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y)


def batch(spec: Spec, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a microbatch, identical on every rank."""
    g = torch.Generator().manual_seed(spec.seed * 16 + step * 2 + micro)
    rows = spec.world_size * ROWS_PER_RANK
    return torch.randn(rows, spec.dim, generator=g), torch.randn(rows, spec.dim, generator=g)


# ---------------------------------------------------------------------------------------------
# One example


def _close(got: torch.Tensor, want: torch.Tensor, atol: Any, what: str, errors: list[str]) -> None:
    if got.shape != want.shape:
        errors.append(f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}")
        return
    diff = (got.double() - want.double()).abs()
    bound = torch.as_tensor(atol, dtype=torch.float64) + 1e-5 * want.double().abs() + 1e-6
    bad = ~(diff <= bound)  # NaN counts as bad
    if bad.any():
        errors.append(
            f"{what}: differs from the reference by up to {diff.max().item():.3g} at "
            f"{int(bad.sum())} of {diff.numel()} elements"
        )


def _shard_or_error(spec: Spec, model: Block, mesh: DeviceMesh, errors: list[str]) -> bool:
    """Shard; True when training should follow (no error expected, none raised)."""
    expected = expected_error(spec)
    counter = _Count()
    try:
        with HUB.observing(counter):
            shard(spec, model, mesh)
    except Exception as e:
        if expected is None:
            raise
        if not isinstance(e, expected[0]) or not re.search(expected[1], str(e)):
            errors.append(f"fully_shard raised {type(e).__name__}: {e}; expected {expected}")
        elif counter.collectives:
            errors.append(f"{counter.collectives} collectives issued before {e!r}")
        return False
    if expected is not None:
        errors.append(f"fully_shard raised nothing; expected {expected[0].__name__}")
        return False
    return True


def check_spec(
    spec: Spec,
    meshes: dict[tuple[int, int] | None, DeviceMesh],
    stats: dict[str, float] | None = None,
) -> list[str]:
    """Run ``spec`` on this rank; return what is wrong (collective; see the module doc).
    ``stats`` counts the examples that ``"trained"`` and those that ``"raised"`` as expected."""
    errors: list[str] = []
    stats = {} if stats is None else stats
    try:
        model = build(spec)
        if not _shard_or_error(spec, model, meshes[spec.mesh], errors):
            stats["raised"] = stats.get("raised", 0) + (not errors)
            return errors
        _train(spec, model, errors)
        stats["trained"] = stats.get("trained", 0) + 1
    except Exception as e:
        where = f"rank {dist.get_rank()} raised"
        raise Unexpected(f"{spec!r}\n{where}:\n{traceback.format_exc()}") from e
    return errors


class Unexpected(BaseException):
    """An exception the spec did not call for. Raised at once on the rank that saw it, past
    hypothesis (a ``BaseException``: no replay of the example), without agreeing first: the
    other ranks may be blocked in a collective this rank will never join, and any collective
    of ours would meet theirs. The harness then reports this rank's traceback and the other
    ranks' stacks."""


def _any_rank(errors: list[str]) -> bool:
    """Whether any rank has found a problem (collective: the ranks stop together)."""
    flag = torch.tensor([float(bool(errors))])
    dist.all_reduce(flag)
    return bool(flag.item())


def _train(spec: Spec, model: Block, errors: list[str]) -> None:
    rank = dist.get_rank()
    ref = Reference(spec)
    params = list(model.parameters())
    ids = [id(p) for p in params]
    opt = make_optimizer(spec.optimizer, params)
    micros = 1 if spec.accumulation == "none" else 2
    for step in range(STEPS):
        for micro in range(micros):
            x, y = batch(spec, step, micro)
            if spec.accumulation == "nosync":
                model.set_requires_gradient_sync(micro == micros - 1)  # type: ignore[operator]
            ref_loss = ref.forward_backward(x, y)
            if spec.accumulation != "nosync" or micro == micros - 1:
                ref.sync()
            xs, ys = rank_slice(x, rank, spec.world_size), rank_slice(y, rank, spec.world_size)
            loss = loss_fn(model, xs, ys)
            loss.backward()
            _close(mean_over_ranks(loss), ref_loss, 0.0, f"step {step}.{micro} loss", errors)
        grads = full_grads(model)
        for name, g in grads.items():
            want = ref.synced.get(name)
            what = f"step {step} grad of {name}"
            if (g is None) != (want is None):
                errors.append(f"{what}: {'none' if g is None else 'a gradient'}, want the other")
            elif g is not None and want is not None:
                if g.dtype != FP32:
                    errors.append(f"{what}: dtype {g.dtype}")
                _close(g, want, ref.tols[name], what, errors)
        if _any_rank(errors):
            return
        want_params = ref.step(grads)
        opt.step()
        opt.zero_grad()
        got_params = full_params(model)
        if list(got_params) != list(want_params):
            errors.append(f"parameter names {list(got_params)} != {list(want_params)}")
        for name, full in got_params.items():
            _close(full, want_params[name], 0.0, f"step {step} param {name}", errors)
        if [id(p) for p in model.parameters()] != ids:
            errors.append(f"step {step}: the registered parameters are not the optimizer's")
        for mname, m in model.named_modules():
            for pname, p in m._parameters.items():
                if p is not None and not isinstance(p, DTensor):
                    errors.append(f"step {step}: {mname}.{pname} is registered unsharded")
        if _any_rank(errors):
            return


# ---------------------------------------------------------------------------------------------
# Lockstep


def digest(spec: Spec) -> str:
    return hashlib.sha1(repr(spec).encode()).hexdigest()[:12]


def agree(spec: Spec, errors: list[str]) -> None:
    """Gather every rank's problems; raise the same AssertionError on every rank if any (or if
    the ranks drew different specs), naming the spec so it can become a regression test."""
    world_size = dist.get_world_size()
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (digest(spec), errors))
    if len({d for d, _ in gathered}) != 1:
        raise AssertionError(f"ranks drew different specs: {[d for d, _ in gathered]}")
    bad = {r: errs for r, (_, errs) in enumerate(gathered) if errs}
    if bad:
        lines = [f"rank {r}: " + "\n  ".join(errs) for r, errs in bad.items()]
        raise AssertionError(f"{spec!r}\n" + "\n".join(lines))


def run_specs(world_size: int, specs: list[Spec]) -> int:
    """Rank function: check each of ``specs`` (regression tests); returns how many ran."""
    meshes = make_meshes(world_size)
    for spec in specs:
        agree(spec, check_spec(spec, meshes))
    return len(specs)
