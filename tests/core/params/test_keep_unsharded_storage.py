"""``set_keep_unsharded_storage`` (torch main's API): resharding keeps the unsharded storage,
against the same model without it and a replica.

* Trained 3 SGD steps with it on (every module, ``recurse=True``), on 2 gloo ranks (the
  all-gather written straight into the unsharded parameters on gloo): the losses and the final
  parameters are bitwise the plain run's (the same collectives and kernels: only the
  freeing differs), both within ``TOL`` of a replica trained on the whole batch; each
  unsharded parameter has the same data pointer at every step's forward, and after each
  step (resharded) its storage is still allocated while the module registers the sharded
  DTensor; an ``unshard()`` after the optimizer step gathers the new values.
* Call orders, on 4 ranks (the all-gather through a buffer): switched on after a first step
  (the next reshard keeps), off again (the next reshard frees), ``recurse=False`` on one
  block (only its parameters kept), with ``reshard_after_forward=False`` and an ``int`` (the
  small copy path).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from _harness import run_on_ranks
from helpers import TOL, mine, world_mesh
from models import build, full_params, local_loss, make_batch, shard_model
from torch.distributed.tensor import DTensor

import fsdp2

NAME = "mlp_head"
STEPS = 3


def _unsharded(model: nn.Module) -> dict[str, torch.Tensor]:
    """The registered parameters of every FSDP module, by name, while unsharded."""
    return {n: p for n, p in model.named_parameters() if not isinstance(p, DTensor)}


def _storage_kept(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > 0


def _train(keep: bool | None, **kw: Any) -> dict[str, Any]:
    model = shard_model(build(NAME), fsdp2.fully_shard, world_mesh(), **kw)
    if keep is not None:
        model.set_keep_unsharded_storage(keep)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen: dict[str, list[int]] = {}
    held: dict[str, torch.Tensor] = {}

    def record(module: nn.Module, _args: Any) -> None:
        for n, p in module.named_parameters(recurse=False):
            if not isinstance(p, DTensor):
                seen.setdefault(f"{id(module)}.{n}", []).append(p.data_ptr())
                held[f"{id(module)}.{n}"] = p

    hooks = [m.register_forward_pre_hook(record) for m in model.modules()]
    losses, kept_after = [], []
    for step in range(STEPS):
        x, y = make_batch(NAME, step)
        loss = local_loss(model, NAME, mine(x), mine(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        registered_sharded = all(isinstance(p, DTensor) for p in model.parameters())
        kept_after.append((registered_sharded, all(_storage_kept(t) for t in held.values())))
    for h in hooks:
        h.remove()
    stable = all(len(set(ptrs)) == 1 for ptrs in seen.values())
    model.unshard()  # the root's own: gathered again after the optimizer step
    fresh = {n: p.detach().clone() for n, p in _unsharded(model).items()}
    model.reshard()
    full = full_params(model)
    gathered = all(torch.equal(fresh[n], full[n]) for n in fresh)
    return {
        "losses": losses,
        "kept": kept_after,
        "stable": stable,
        "params": full,
        "gathered": gathered,
        "n_seen": len(seen),
    }


def _parity() -> dict[str, Any]:
    keep, plain = _train(True), _train(None)
    torch.manual_seed(0)
    ref = build(NAME)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for step in range(STEPS):
        x, y = make_batch(NAME, step)
        loss = local_loss(ref, NAME, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.detach())
    bitwise = all(torch.equal(a, b) for a, b in zip(keep["losses"], plain["losses"], strict=True))
    bitwise &= all(torch.equal(keep["params"][n], p) for n, p in plain["params"].items())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(keep["params"][n], p.detach(), **TOL)
    return {
        "bitwise": bitwise,
        "kept": keep["kept"],
        "plain_kept": plain["kept"],
        "stable": keep["stable"],
        "plain_stable": plain["stable"],
        "gathered": keep["gathered"],
        "n_seen": keep["n_seen"],
    }


def test_keep_unsharded_storage_trains_like_plain() -> None:
    for out in run_on_ranks(2, _parity):
        assert out["bitwise"] and out["gathered"] and out["n_seen"] > 0, out
        assert out["stable"], out
        assert out["kept"] == [(True, True)] * STEPS, out
        assert out["plain_kept"] == [(True, False)] * STEPS, out


def _orders() -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = shard_model(build(NAME), fsdp2.fully_shard, world_mesh())
    block = model.layers[0]

    def cycle(m: Any) -> torch.Tensor:
        m.unshard()
        w = next(p for p in m.parameters() if not isinstance(p, DTensor))
        m.reshard()
        return w

    w = cycle(block)
    out["default_frees"] = not _storage_kept(w)
    model.set_keep_unsharded_storage(True)
    w1 = cycle(block)
    w2 = cycle(block)
    out["on_keeps"] = _storage_kept(w1) and w1.data_ptr() == w2.data_ptr()
    model.set_keep_unsharded_storage(False)
    out["off_frees"] = not _storage_kept(cycle(block))
    block.set_keep_unsharded_storage(True, recurse=False)
    other = cycle(model.layers[1])
    out["recurse_false"] = _storage_kept(cycle(block)) and not _storage_kept(other)
    for raf in (False, 2):
        m = shard_model(build(NAME), fsdp2.fully_shard, world_mesh(), reshard_after_forward=raf)
        m.set_keep_unsharded_storage(True)
        ptrs = []
        for step in range(2):
            x, y = make_batch(NAME, step)
            local_loss(m, NAME, mine(x), mine(y)).backward()
            ptrs.append(cycle(m.layers[0]).data_ptr())
        out[f"raf_{raf}"] = ptrs[0] == ptrs[1]
    return out


def test_keep_unsharded_storage_call_orders() -> None:
    for out in run_on_ranks(4, _orders):
        assert all(out.values()), out
