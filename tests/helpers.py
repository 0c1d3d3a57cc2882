"""Meshes, the two engines and the checks the distributed tests share.

Models, data and the small training helpers are in ``models.py``; counting collectives is in
``comm_counter.py``. Unless said otherwise these run inside a rank function (``run_on_ranks``),
and those that gather full tensors are collective: every rank calls them in the same order.

Two ways of comparing training runs recur:

* step by step, in the worker (``train_and_compare``; its pieces ``step_all``, ``check_grads``,
  ``check_params`` for tests that interleave other checks): a replicated reference trains on
  the whole global batch, every sharded model on its rank's slice; per step the rank-averaged
  loss, the full gradients and, after the optimizer step, the full parameters must match the
  reference (fp32 tolerance), and fsdp2's must equal torch's bitwise where both ran;
* whole runs, anywhere (``check_same_run``, ``check_close_run``): each run is a dict with the
  per-step ``"losses"`` (floats or tensors) and the final full ``"params"``; fsdp2's must equal
  torch's bitwise, and be close to a reference run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from models import (
    build,
    full_grads,
    full_params,
    local_loss,
    make_batch,
    make_optimizer,
    mean_over_ranks,
    rank_slice,
    shard_model,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp2

__all__ = [
    "ENGINES",
    "GROUPS",
    "NAME",
    "N_BLOCKS",
    "TOL",
    "WORLD_SIZES",
    "assert_all_dtensors",
    "check_close",
    "check_close_run",
    "check_grads",
    "check_params",
    "check_same",
    "check_same_losses",
    "check_same_run",
    "expect_raises",
    "engines_with",
    "fsdp_modules",
    "grads_of",
    "hsdp_mesh",
    "mine",
    "set_all",
    "sharded",
    "step_all",
    "train_and_compare",
    "world_mesh",
]

ENGINES: dict[str, Callable[..., Any]] = {"fsdp2": fsdp2.fully_shard, "torch": torch_fully_shard}
TOL = {"atol": 1e-5, "rtol": 1e-5}
WORLD_SIZES = [2, 4]  # the ranks most distributed tests run on
# The model most engine tests train: ``build(NAME)``, N_BLOCKS MLP blocks and a head at the root.
NAME = "mlp_head"
N_BLOCKS = 3
GROUPS = N_BLOCKS + 1  # the blocks and the root's head
_FSDP_CLASSES = (fsdp2.FSDPModule, TorchFSDPModule)


def engines_with(method: str) -> dict[str, Callable[..., Any]]:
    """``ENGINES`` without torch's where its ``FSDPModule`` lacks ``method`` (a setter added
    after the oldest torch fsdp2 supports): there fsdp2 is checked against the reference alone.
    """
    if hasattr(TorchFSDPModule, method):
        return dict(ENGINES)
    return {"fsdp2": ENGINES["fsdp2"]}


# ---------------------------------------------------------------------------------------------
# Meshes and data


def world_mesh() -> DeviceMesh:
    """A 1D CPU mesh over every rank of the default group."""
    return init_device_mesh("cpu", (dist.get_world_size(),))


def hsdp_mesh(shape: tuple[int, int]) -> DeviceMesh:
    """A 2D ``(replicate, shard)`` CPU mesh (torch's ``fully_shard`` wants the names for HSDP)."""
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def mine(t: torch.Tensor) -> torch.Tensor:
    """This rank's slice (dim 0) of a global batch split over the default group."""
    return rank_slice(t, dist.get_rank(), dist.get_world_size())


# ---------------------------------------------------------------------------------------------
# Sharded models and their state


def sharded(engine: str, name: str, mesh: DeviceMesh | None = None, **kw: Any) -> nn.Module:
    """``build(name)`` with every block sharded by ``engine`` with ``kw`` and the root with the
    defaults, on ``mesh`` (``world_mesh()`` if not given)."""
    mesh = world_mesh() if mesh is None else mesh
    return shard_model(build(name), ENGINES[engine], mesh, root_kwargs={}, **kw)


def set_all(model: nn.Module, method: str, *args: Any) -> None:
    """Call a non-recursive setter on every FSDP module of ``model``."""
    for m in fsdp_modules(model):
        getattr(m, method)(*args)


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """Every module of ``model`` that either engine's ``fully_shard`` was applied to."""
    return [m for m in model.modules() if isinstance(m, _FSDP_CLASSES)]


def assert_all_dtensors(model: nn.Module, what: str) -> None:
    """Every registered parameter is the sharded DTensor (as outside forward and backward)."""
    for m in model.modules():
        for n, p in m._parameters.items():
            assert p is None or isinstance(p, DTensor), f"{what}: {n} is registered unsharded"


@contextlib.contextmanager
def expect_raises(what: str, exc: type[BaseException], match: str | None = None) -> Iterator[Any]:
    """``pytest.raises`` whose failure message starts with ``what`` (e.g. the engine)."""
    try:
        with pytest.raises(exc, match=match) as info:
            yield info
    except (pytest.fail.Exception, AssertionError) as e:
        raise AssertionError(f"{what}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Comparing values


def check_close(
    got: torch.Tensor | None, want: torch.Tensor | None, what: str, **tol: float
) -> None:
    """``got`` is close to ``want`` (``TOL`` unless given), or both are ``None``."""
    assert (got is None) == (want is None), f"{what}: got {got}, want {want}"
    if got is not None:
        torch.testing.assert_close(got, want, **(tol or TOL), msg=lambda m: f"{what}: {m}")


def check_same(
    got: Mapping[str, torch.Tensor | None],
    want: Mapping[str, torch.Tensor | None],
    what: str,
    *,
    bitwise: bool = False,
    **tol: float,
) -> None:
    """Two runs' values by key (losses, gradients, parameters): the same keys, and each value
    close (``check_close``) or, with ``bitwise``, of the same dtype and equal."""
    assert list(got) == list(want), f"{what}: keys {list(got)} != {list(want)}"
    for key, w in want.items():
        g = got[key]
        if not bitwise:
            check_close(g, w, f"{what} {key}", **tol)
            continue
        assert (g is None) == (w is None), f"{what} {key}: got {g}, want {w}"
        if g is None:
            continue
        assert g.dtype == w.dtype, f"{what} {key}: dtype {g.dtype}, want {w.dtype}"
        assert torch.equal(g, w), (
            f"{what} {key}: differs bitwise "
            f"(max abs diff {(g.double() - w.double()).abs().max().item():.3g})"
        )


def grads_of(model: nn.Module, scale: float = 1.0) -> dict[str, torch.Tensor | None]:
    """A plain (reference) model's gradients by name, times ``scale``."""
    return {
        n: None if p.grad is None else p.grad.detach() * scale for n, p in model.named_parameters()
    }


def check_grads(
    models: Mapping[str, nn.Module],
    want: Mapping[str, torch.Tensor | None],
    what: str,
    **tol: float,
) -> dict[str, dict[str, torch.Tensor | None]]:
    """Every sharded model's full gradients against ``want`` (``None`` where it has none);
    returns them by model key. Collective."""
    seen = {}
    for key, model in models.items():
        grads = full_grads(model)
        assert list(grads) == list(want), f"{key}: names {list(grads)} != {list(want)}"
        for n, g in grads.items():
            check_close(g, want[n], f"{key} {what}: grad of {n}", **tol)
        seen[key] = grads
    return seen


def check_params(
    models: Mapping[str, nn.Module], ref: nn.Module, what: str, **tol: float
) -> dict[str, dict[str, torch.Tensor]]:
    """Every sharded model's full parameters against the plain ``ref``'s; returns them by
    model key. Collective."""
    want = {n: p.detach() for n, p in ref.named_parameters()}
    seen = {}
    for key, model in models.items():
        got = full_params(model)
        assert list(got) == list(want), f"{key}: names {list(got)} != {list(want)}"
        for n, full in got.items():
            check_close(full, want[n], f"{key} {what}: param {n}", **tol)
        seen[key] = got
    return seen


def step_all(
    models: Mapping[str, nn.Module], ref: nn.Module, name: str, step: int, batch: int = 8
) -> None:
    """One forward/backward of ``ref`` on the global batch of ``make_batch(name, step)`` and of
    every sharded model on its slice, checking the rank-averaged losses (no optimizer step)."""
    x, y = make_batch(name, step, batch)
    ref_loss = local_loss(ref, name, x, y)
    ref_loss.backward()
    for key, model in models.items():
        loss = local_loss(model, name, mine(x), mine(y))
        loss.backward()
        check_close(mean_over_ranks(loss), ref_loss.detach(), f"{key} step {step} loss")


# ---------------------------------------------------------------------------------------------
# Step-by-step comparison of a training run


Batch = tuple[torch.Tensor, torch.Tensor]


def train_and_compare(
    ref: nn.Module,
    models: Mapping[str, nn.Module],
    *,
    batch: Callable[[int], Batch],
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    forward_backward: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    steps: int = 3,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    data_parallel: tuple[int, int] | None = None,
    tol: Mapping[str, float] = TOL,
    loss_tol: Mapping[str, float] | None = None,
    param_tol: Mapping[str, float] | None = None,
    check_init: bool = False,
    before_step: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    invariant: Callable[[str, nn.Module, list[nn.Parameter]], None] | None = None,
) -> None:
    """Train the plain ``ref`` on each global batch and every sharded model of ``models`` on
    its data-parallel slice, side by side; compare every step.

    Args:
        batch: ``step -> (x, y)``, the global batch (identical on every rank).
        loss: ``(model, x, y) -> loss``, a mean over the rows given (so the rank average is
            the reference's loss); the loop runs its backward. Or instead:
        forward_backward: ``(model, x, y) -> loss`` that runs backward itself (several
            microbatches, a manual unshard...).
        optimizer: ``params -> optimizer``; ``make_optimizer("adamw", ...)`` by default.
        data_parallel: ``(rank, size)`` of this rank among the data-parallel ranks; every
            rank of the default group by default.
        tol: for the losses and gradients; ``loss_tol`` and ``param_tol`` override it for the
            losses and the parameters.
        check_init: first compare the full parameters with ``ref``'s.
        before_step: called with ``(step, x, y)`` before each step's forward.
        invariant: called with ``(key, model, params)`` after sharding, after each backward and
            after each optimizer step; ``params`` are the parameters the optimizer holds.

    Checked per step: the rank-averaged loss, the full gradients (``None`` where ``ref`` has
    none) and, after the optimizer step, the full parameters against ``ref``; and, where both
    ``"fsdp2"`` and ``"torch"`` are in ``models``, their local losses, full gradients and full
    parameters bitwise against each other (same padding, same reduce-scatter, same optimizer:
    on CPU the two engines compute the same floats; a deliberate change of arithmetic order
    should say so).
    """
    assert (loss is None) != (forward_backward is None), "give loss or forward_backward"
    if forward_backward is None:

        def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = loss(model, x, y)
            out.backward()
            return out

    make_opt = optimizer or (lambda ps: make_optimizer("adamw", ps))
    rank, size = data_parallel or (dist.get_rank(), dist.get_world_size())
    params = {key: list(m.parameters()) for key, m in models.items()}
    ref_opt = make_opt(ref.parameters())
    opts = {key: make_opt(ps) for key, ps in params.items()}
    loss_tol = loss_tol if loss_tol is not None else tol
    param_tol = param_tol if param_tol is not None else tol
    if invariant is not None:
        for key, model in models.items():
            invariant(key, model, params[key])
    if check_init:
        check_params(models, ref, "init", **param_tol)
    for step in range(steps):
        x, y = batch(step)
        if before_step is not None:
            before_step(step, x, y)
        ref_loss = forward_backward(ref, x, y).detach()
        xs, ys = rank_slice(x, rank, size), rank_slice(y, rank, size)
        seen: dict[str, dict[str, torch.Tensor | None]] = {}
        for key, model in models.items():
            local = forward_backward(model, xs, ys).detach()
            check_close(mean_over_ranks(local), ref_loss, f"{key} step {step} loss", **loss_tol)
            if invariant is not None:
                invariant(key, model, params[key])
            seen[key] = {"loss": local}
        grads = check_grads(models, grads_of(ref), f"step {step}", **tol)
        for key in models:
            seen[key].update({f"grad of {n}": g for n, g in grads[key].items()})
        for opt in (ref_opt, *opts.values()):
            opt.step()
            opt.zero_grad()
        if invariant is not None:
            for key, model in models.items():
                invariant(key, model, params[key])
        fulls = check_params(models, ref, f"step {step}", **param_tol)
        if "fsdp2" in models and "torch" in models:
            for key in ("fsdp2", "torch"):
                seen[key].update({f"param {n}": p for n, p in fulls[key].items()})
            check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch", bitwise=True)


# ---------------------------------------------------------------------------------------------
# Comparing whole runs


Run = Mapping[str, Any]  # {"losses": per-step losses, "params": {name: full tensor}, ...}


def check_same_losses(ours: Sequence[Any], theirs: Sequence[Any], what: str) -> None:
    """Per-step losses (floats or tensors) equal bitwise."""
    assert len(ours) == len(theirs), f"{what}: {len(ours)} losses, want {len(theirs)}"
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        assert same, f"{what} step {step}: loss {float(a)!r} != {float(b)!r}"


def check_same_run(ours: Run, theirs: Run, what: str = "fsdp2 vs torch") -> None:
    """Two runs' losses and final parameters equal bitwise."""
    check_same_losses(ours["losses"], theirs["losses"], what)
    check_same(ours["params"], theirs["params"], f"{what} param", bitwise=True)


def check_close_run(
    got: Run,
    want: Run,
    what: str,
    *,
    tol: Mapping[str, float] = TOL,
    param_tol: Mapping[str, float] | None = None,
) -> None:
    """``got``'s losses within ``tol`` of ``want``'s; with ``param_tol``, its final parameters
    within that of ``want["params"]``."""
    torch.testing.assert_close(
        list(got["losses"]), list(want["losses"]), **tol, msg=lambda m: f"{what} losses: {m}"
    )
    if param_tol is not None:
        check_same(got["params"], want["params"], f"{what} param", **param_tol)
