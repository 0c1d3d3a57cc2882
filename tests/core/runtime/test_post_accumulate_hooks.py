"""Post-accumulate-grad hooks on sharded parameters (``register_post_accumulate_grad_hook``):
fsdp2 calls them where the reduced gradient lands, as torch's FSDP2 does (``foreach_reduce``;
[Note: post-accumulate-grad hooks] in fsdp2/_core/params/param.py).

A recording hook on every sharded parameter logs ``(name, .grad is a DTensor, its local
values)`` per call; fsdp2's log must equal torch's FSDP2's on the same model and data (the
same calls in the same order, the same values bitwise), on 2 gloo ranks:

* FSDP, two synced backwards without ``zero_grad`` (the second call sees the accumulated
  gradient), then accumulation: a micro-batch under ``set_requires_gradient_sync(False)``
  calls no hook, the synced one calls each once with the sum (close to a replica's gradient
  of the whole batch); fsdp2's ``synchronize_gradients`` (torch main) calls them too;
* optimizer-in-backward (torchtune's ``register_optim_in_bwd_hooks``: an AdamW per
  parameter stepped in its hook, then ``zero_grad``), 3 steps: every ``.grad`` is ``None``
  after backward; losses each step and the final parameters equal torch's bitwise and are
  close to an unsharded replica doing the same on the whole batch;
* other layouts, one step each against torch: HSDP on a ``(2, 1)`` mesh (with
  ``set_requires_all_reduce(False)`` for a micro-batch: no hook until the all-reduce),
  ``CPUOffloadPolicy(pin_memory=False)``, and ``fsdp2.replicate`` against torch's
  ``replicate``; under replica sharding (``fsdp2.replica_optim``, no torch counterpart) each
  hook sees its ``PieceGrad``, the piece ``.grad`` holds after backward, in plain HSDP's
  order of calls.

The pinned device-to-host copy that a hook makes synchronous needs an accelerator; not
covered here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from helpers import ENGINES, check_close, check_same, hsdp_mesh, mine, world_mesh
from models import (
    build,
    full_params,
    local_loss,
    make_batch,
    make_optimizer,
    mean_over_ranks,
    shard_model,
)
from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2._core.replicas.piece_grad import PieceGrad
from fsdp2.replica_optim import shard_over_replicas

NAME = "mlp_head"  # 3 blocks and a root holding a head: 4 groups
Log = list[tuple[str, bool, torch.Tensor]]


def _record(model: nn.Module) -> Log:
    """Hook every parameter of ``model``; the returned list fills with one entry per call."""
    log: Log = []
    for n, p in model.named_parameters():

        def hook(p: torch.Tensor, n: str = n) -> None:
            g = p.grad
            assert g is not None, f"{n}: a hook ran without a gradient"
            local = g.to_local() if isinstance(g, DTensor) else g
            log.append((n, isinstance(g, DTensor), local.detach().clone()))

        p.register_post_accumulate_grad_hook(hook)
    return log


def _calls(log: Log) -> list[tuple[str, bool]]:
    return [(n, is_dt) for n, is_dt, _ in log]


def _names(log: Log) -> list[str]:
    return [n for n, _, _ in log]


def _same_logs(got: Log, want: Log, what: str) -> None:
    """The same calls in the same order, with the same gradient values bitwise."""
    assert _calls(got) == _calls(want), f"{what}: calls {_calls(got)} != {_calls(want)}"
    for i, ((n, _, g), (_, _, w)) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and torch.equal(g, w), f"{what}: call {i} ({n}) differs"


def _backward(model: nn.Module, step: int, **setters: bool) -> torch.Tensor:
    for setter, value in setters.items():
        getattr(model, setter)(value)
    x, y = make_batch(NAME, step)
    loss = local_loss(model, NAME, mine(x), mine(y))
    loss.backward()
    return loss.detach()


def _sharded(engine: str, mesh: Any = None, **kw: Any) -> nn.Module:
    mesh = world_mesh() if mesh is None else mesh
    return shard_model(build(NAME), ENGINES[engine], mesh, **kw)


# ---------------------------------------------------------------------------------------------
# FSDP: the calls, accumulation, optimizer-in-backward


def _optim_in_backward(params: list[nn.Parameter]) -> None:
    """torchtune's ``register_optim_in_bwd_hooks``: each parameter steps in its own hook."""
    opts = {p: make_optimizer("adamw", [p]) for p in params}

    def step(p: torch.Tensor) -> None:
        opts[p].step()
        opts[p].zero_grad()

    for p in params:
        p.register_post_accumulate_grad_hook(step)


def _fsdp() -> None:
    names = [n for n, _ in build(NAME).named_parameters()]
    # two synced backwards without zero_grad: assigned, then accumulated
    models = {e: _sharded(e) for e in ENGINES}
    logs = {e: _record(m) for e, m in models.items()}
    for e, model in models.items():
        _backward(model, 0)
        assert sorted(_names(logs[e])) == sorted(names), f"{e}: {_calls(logs[e])}"
        _backward(model, 1)
        assert len(logs[e]) == 2 * len(names), f"{e}: {_calls(logs[e])}"
        assert all(is_dt for _, is_dt, _ in logs[e]), f"{e}: a hook saw a plain .grad"
    _same_logs(logs["fsdp2"], logs["torch"], "synced backwards")
    for n, p in models["fsdp2"].named_parameters():  # the last call saw the final .grad
        last = [g for m, _, g in logs["fsdp2"] if m == n][-1]
        assert torch.equal(last, p.grad.to_local()), n

    # accumulation: nothing lands (no hook) without gradient sync; the synced micro-batch
    # lands the sum once
    ref = build(NAME)
    for step in (2, 3):
        x, y = make_batch(NAME, step)
        local_loss(ref, NAME, x, y).backward()
    models = {e: _sharded(e) for e in ENGINES}
    logs = {e: _record(m) for e, m in models.items()}
    for e, model in models.items():
        _backward(model, 2, set_requires_gradient_sync=False)
        assert logs[e] == [], f"{e}: a hook ran without gradient sync: {_calls(logs[e])}"
        _backward(model, 3, set_requires_gradient_sync=True)
        assert sorted(_names(logs[e])) == sorted(names), f"{e}: {_calls(logs[e])}"
    _same_logs(logs["fsdp2"], logs["torch"], "accumulation")
    want = dict(ref.named_parameters())
    for n, _, g in logs["fsdp2"]:  # each rank's shard of the replica's (summed) gradient
        full = want[n].grad
        assert full is not None
        rows = -(-full.size(0) // 2)
        check_close(g, full[rows * dist.get_rank() : rows * (dist.get_rank() + 1)], n)

    # synchronize_gradients (torch main's API) lands the pending sums: the hooks run
    model = _sharded("fsdp2")
    log = _record(model)
    _backward(model, 2, set_requires_gradient_sync=False)
    assert log == []
    model.synchronize_gradients()
    assert sorted(_names(log)) == sorted(names), _calls(log)

    # optimizer-in-backward, 3 steps, against torch and a replica doing the same
    ref = build(NAME)
    _optim_in_backward(list(ref.parameters()))
    models = {e: _sharded(e) for e in ENGINES}
    for model in models.values():
        _optim_in_backward(list(model.parameters()))
    losses: dict[str, list[torch.Tensor]] = {e: [] for e in models}
    for step in range(3):
        x, y = make_batch(NAME, step)
        ref_loss = local_loss(ref, NAME, x, y)
        ref_loss.backward()
        for e, model in models.items():
            loss = mean_over_ranks(_backward(model, step))
            check_close(loss, ref_loss.detach(), f"{e} step {step} loss")
            losses[e].append(loss)
            for n, p in model.named_parameters():
                assert p.grad is None, f"{e} step {step}: {n} kept its gradient"
    check_same(
        {str(i): t for i, t in enumerate(losses["fsdp2"])},
        {str(i): t for i, t in enumerate(losses["torch"])},
        "optimizer-in-backward losses",
        bitwise=True,
    )
    params = {e: full_params(m) for e, m in models.items()}
    check_same(params["fsdp2"], params["torch"], "optimizer-in-backward params", bitwise=True)
    check_same(params["fsdp2"], {n: p.detach() for n, p in ref.named_parameters()}, "vs replica")


def test_hooks_accumulation_and_optimizer_in_backward_like_torch() -> None:
    run_on_ranks(2, _fsdp)


# ---------------------------------------------------------------------------------------------
# HSDP, CPU offload, replicate, replica sharding


def _replicated(engine: str) -> nn.Module:
    rep: Callable[..., Any] = fsdp2.replicate if engine == "fsdp2" else torch_replicate
    return shard_model(build(NAME), rep, world_mesh())


def _layouts() -> None:
    names = sorted(n for n, _ in build(NAME).named_parameters())
    # HSDP (2, 1): a micro-batch without the all-reduce lands nothing
    models = {e: _sharded(e, hsdp_mesh((2, 1))) for e in ENGINES}
    logs = {e: _record(m) for e, m in models.items()}
    for e, model in models.items():
        _backward(model, 0, set_requires_all_reduce=False)
        assert logs[e] == [], f"{e}: a hook ran before the all-reduce: {_calls(logs[e])}"
        _backward(model, 1, set_requires_all_reduce=True)
        assert sorted(_names(logs[e])) == names, f"{e}: {_calls(logs[e])}"
    _same_logs(logs["fsdp2"], logs["torch"], "HSDP")
    plain = logs["fsdp2"]

    # CPU offload: the gradients land on the host, then the hooks run
    offload = {"fsdp2": fsdp2.CPUOffloadPolicy(pin_memory=False)}
    offload["torch"] = TorchCPUOffloadPolicy(pin_memory=False)
    models = {e: _sharded(e, offload_policy=offload[e]) for e in ENGINES}
    logs = {e: _record(m) for e, m in models.items()}
    for model in models.values():
        _backward(model, 0)
    assert sorted(_names(logs["fsdp2"])) == names, _calls(logs["fsdp2"])
    assert all(g.device.type == "cpu" for _, _, g in logs["fsdp2"])
    _same_logs(logs["fsdp2"], logs["torch"], "CPU offload")

    # replicate: DDP's all-reduce behind fully_shard's API, the hooks as torch's replicate
    models = {e: _replicated(e) for e in ENGINES}
    logs = {e: _record(m) for e, m in models.items()}
    for model in models.values():
        _backward(model, 0)
    assert sorted(_names(logs["fsdp2"])) == names, _calls(logs["fsdp2"])
    _same_logs(logs["fsdp2"], logs["torch"], "replicate")

    # replica sharding: each hook sees its PieceGrad, plain HSDP's order of calls
    model = _sharded("fsdp2", hsdp_mesh((2, 1)))
    shard_over_replicas(make_optimizer("adamw", model.parameters()))
    seen: list[tuple[str, str]] = []
    pieces: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters():

        def hook(p: torch.Tensor, n: str = n) -> None:
            seen.append((n, type(p.grad).__name__))
            assert isinstance(p.grad, PieceGrad)
            pieces[n] = p.grad.to_local().clone()

        p.register_post_accumulate_grad_hook(hook)
    _backward(model, 1)
    assert [n for n, _ in seen] == _names(plain), seen
    assert all(kind == "PieceGrad" for _, kind in seen), seen
    for n, p in model.named_parameters():
        assert torch.equal(pieces[n], p.grad.to_local()), n


def test_hooks_hsdp_offload_replicate_pieces_like_torch() -> None:
    run_on_ranks(2, _layouts)
