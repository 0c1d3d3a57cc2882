"""Training under ``torch.autograd.graph.saved_tensors_hooks``, as activation-offloading
libraries run it (torchao / torchtune's ``OffloadActivations``): identity hooks (offloading
switched off: the packed value is the saved tensor itself, for a parameter the parameter
object) and hooks that copy to the host and back (pack ``t.detach().clone()``, unpack returns
it).

The root's group frees, when backward begins, the unsharded parameters nothing holds
([Note: release] in fsdp2/_core/params/group.py). An identity hook holds the parameter's Python
object only, which no use count sees: fsdp2 freed the final norm's weight that its backward
then read, and crashed (SIGSEGV). Now a parameter a hook holds is kept, and one it copied is
still freed. Each case trains the tied-embedding transformer for 2 steps under the hooks with
fsdp2 and torch's FSDP2, and with fsdp2 without hooks: per-step losses and final full
parameters equal bitwise; and checks, from inside the backward, which of the root's
parameters were freed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from _harness import run_on_ranks
from helpers import ENGINES, check_same_run, hsdp_mesh, mine, world_mesh
from models import build, full_params, local_loss, make_batch, make_optimizer, shard_model

from fsdp2._core.runtime.state import state_of

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]

HOOKS: dict[str, Hooks] = {
    "identity": (lambda t: t, lambda t: t),
    "offload": (lambda t: t.detach().clone(), lambda t: t),  # host copy on CPU: a clone
}

# the root's parameters freed before the blocks' backward
RELEASED = {
    "none": {"pos_emb.weight"},
    # the norm's weight is the packed value itself: kept (the tied weight is kept by a view)
    "identity": {"pos_emb.weight"},
    # every saved tensor is a copy: the parameters are freed, the copies read
    "offload": {"pos_emb.weight", "tok_emb.weight", "norm.weight"},
}


def _released(model: nn.Module) -> set[str]:
    g = state_of(model).groups[0]
    bufs = g.unsharded_bufs
    return {p.fqn for i, p in enumerate(g.flat_params) if bufs[i].untyped_storage().nbytes() == 0}


def _run(engine: str, hooks: str, mesh_kind: str) -> dict[str, Any]:
    model = build("transformer")
    mesh = world_mesh() if mesh_kind == "1d" else hsdp_mesh((2, 2))
    shard_model(model, ENGINES[engine], mesh)
    seen: list[set[str]] = []
    if engine == "fsdp2":
        model.layers[-1].register_full_backward_hook(lambda *_: seen.append(_released(model)))
    opt = make_optimizer("adamw", model.parameters())
    losses = []
    for step in range(2):
        x, y = make_batch("transformer", step)
        if hooks == "none":
            loss = local_loss(model, "transformer", mine(x), mine(y))
            loss.backward()
        else:
            with torch.autograd.graph.saved_tensors_hooks(*HOOKS[hooks]):
                loss = local_loss(model, "transformer", mine(x), mine(y))
                loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": full_params(model), "released": seen}


def _compare(hooks: str, mesh_kind: str) -> None:
    ours = _run("fsdp2", hooks, mesh_kind)
    check_same_run(ours, _run("torch", hooks, mesh_kind), f"fsdp2 vs torch under {hooks} hooks")
    check_same_run(ours, _run("fsdp2", "none", mesh_kind), f"fsdp2 under {hooks} hooks vs none")
    assert ours["released"] == [RELEASED[hooks]] * 2, ours["released"]


@pytest.mark.parametrize("hooks", ["identity", "offload"])
@pytest.mark.parametrize("mesh_kind", ["1d", "hsdp"])
def test_train_under_saved_tensors_hooks(mesh_kind: str, hooks: str) -> None:
    run_on_ranks(4, _compare, hooks, mesh_kind)  # one pool for both meshes
