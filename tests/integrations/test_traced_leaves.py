"""The traced mode's graph inputs are the parameters' local shards ([Note: traced leaves] in
fsdp2/traced/_gather.py): what users do to parameters between steps still holds.

One worker (2 ranks, gloo) trains the tiny transformer with eager ``fsdp2.fully_shard``,
with torch's FSDP2 and with the traced mode under ``torch.compile(fullgraph=True)``
(``aot_eager``), through the same orders, and compares losses every step, which parameters
got a gradient and the parameters at the end:

1. a plain step, two synced backwards summed into the gradients before the optimizer;
2. block 0 frozen (``requires_grad_(False)`` after the graph was made): no gradient, no
   update (the compiled graph still computes it once; the hook drops it and the next graph
   reads the flag);
3. block 0 unfrozen: it trains again (dynamo's guard on the flag recompiles);
4. ``load_state_dict(..., assign=True)`` of a copy, the optimizer rebuilt on the new
   parameters: they get the gradients;
5. ``to_empty`` and a reload (the local tensors replaced in place): trains on.

Both shard with one bias in ``ignored_params`` (left a plain parameter, its gradient
unreduced, as ``fully_shard`` leaves it) and ``mixed_placement`` (norms and biases
``Replicate()``, one weight ``Shard(1)``: the same DTensor placements as eager's). Also:
the forward graph's inputs are plain tensors (no DTensor to unwrap per step), a
post-accumulate-grad hook on a sharded parameter runs once per step with the gradient on
it, a parameter replaced by a DTensor of other placements raises ``ValueError``, and one
replaced behind its module's back (``_parameters`` written directly) raises in backward.
"""

from __future__ import annotations

from typing import Any

import models
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from helpers import check_close_run, check_same, expect_raises, world_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp2
from fsdp2.traced import fully_shard_traced

ORDERS = ("plain", "freeze", "unfreeze", "assign", "to_empty")


def mixed_placement(p: nn.Parameter) -> Replicate | Shard | None:
    """``shard_placement_fn`` for the tiny transformer: norms and biases kept whole
    (``Replicate()``), the MLP's first weight (40 x 32) sharded on dim 1, the rest on dim 0."""
    if p.ndim == 1:
        return Replicate()
    return Shard(1) if p.shape[0] == 40 else None


class _Inputs:
    """An ``aot_eager`` backend noting whether any graph input is a DTensor."""

    def __init__(self) -> None:
        self.dtensor_inputs = 0

    def __call__(self, gm: torch.fx.GraphModule, example: Any) -> Any:
        self.dtensor_inputs += sum(isinstance(t, DTensor) for t in example)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example)


def _train(how: str) -> dict[str, Any]:
    torch._dynamo.reset()
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = models.build("transformer")
    ignored = model.layers[1].fc2.bias  # type: ignore[index]
    if how == "torch":  # torch's FSDP2 beside: Shard(d) only (no Replicate() placement)
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        def place(p: nn.Parameter) -> Shard | None:
            return Shard(1) if p.ndim == 2 and p.shape[0] == 40 else None

        models.shard_model(
            model, torch_fully_shard, world_mesh(), ignored_params={ignored},
            shard_placement_fn=place,
        )  # fmt: skip
    else:
        fn = fsdp2.fully_shard if how == "eager" else fully_shard_traced
        models.shard_model(
            model, fn, world_mesh(), ignored_params={ignored}, shard_placement_fn=mixed_placement
        )
    inputs = _Inputs()
    run = torch.compile(model, backend=inputs, fullgraph=True) if how == "traced" else model
    opt = models.make_optimizer("adamw", model.parameters())
    block0 = list(model.layers[0].parameters())  # type: ignore[index]
    seen: list[bool] = []
    watched = model.norm.weight  # type: ignore[union-attr]
    watched.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))
    losses, got_grad, hooks = [], [], []
    for step, order in enumerate(ORDERS):
        if order == "freeze":
            for p in block0:
                p.requires_grad_(False)
        elif order == "unfreeze":
            for p in block0:
                p.requires_grad_(True)
        elif order in ("assign", "to_empty"):
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if order == "to_empty":
                model.to_empty(device="cpu")
            model.load_state_dict(state, assign=order == "assign")
            opt = models.make_optimizer("adamw", model.parameters())
            block0 = list(model.layers[0].parameters())  # type: ignore[index]
        x, y = models.make_batch("transformer", step)
        x, y = models.rank_slice(x, rank, ws), models.rank_slice(y, rank, ws)
        loss = models.local_loss(run, "transformer", x, y)
        loss.backward()
        if order == "plain":  # a second synced backward adds to the gradients there
            x2, y2 = (models.rank_slice(t, rank, ws) for t in models.make_batch("transformer", 50))
            models.local_loss(run, "transformer", x2, y2).backward()
        got_grad.append([p.grad is not None for p in model.parameters()])
        hooks.append(len(seen))
        opt.step()
        opt.zero_grad()
        losses.append(models.mean_over_ranks(loss))
    out: dict[str, Any] = {
        "losses": [float(v) for v in losses],
        "params": models.full_params(model),
        "got_grad": got_grad,
        "hooks": hooks,
        "dtensor_inputs": inputs.dtensor_inputs,
        "ignored": (type(ignored).__name__, ignored.detach().clone()),
        "placements": {
            n: str(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)
        },  # fmt: skip
    }
    if how == "traced":
        out["errors"] = _errors(model, run)
    return out


def _errors(model: nn.Module, run: Any) -> list[str]:
    said = []
    head: nn.Module = model.layers[1].fc1  # type: ignore[index]
    name, param = "weight", head.weight
    with expect_raises("other placements", ValueError, "mesh and placements") as e:
        other = DTensor.from_local(param.to_local(), param.device_mesh, [Replicate()])
        setattr(head, name, nn.Parameter(other))
    said.append(str(e.value))
    # Behind the module's back: the graph reads the old leaf, whose gradient has no home.
    head._parameters[name] = nn.Parameter(param.detach().clone())
    x, y = models.make_batch("transformer", 9)
    x, y = models.rank_slice(x, dist.get_rank(), 2), models.rank_slice(y, dist.get_rank(), 2)
    with expect_raises("replaced behind the module", RuntimeError, "behind its module") as e:
        models.local_loss(run, "transformer", x, y).backward()
    said.append(str(e.value))
    return said


def _both() -> dict[str, Any]:
    return {how: _train(how) for how in ("eager", "traced", "torch")}


def test_traced_leaves_orders() -> None:
    res = run_on_ranks(2, _both)[0]
    eager, traced = res["eager"], res["traced"]
    tol, param_tol = {"rtol": 1e-4, "atol": 1e-4}, {"rtol": 1e-3, "atol": 1e-3}
    check_close_run(traced, eager, "traced vs eager fsdp2", tol=tol, param_tol=param_tol)
    # torch's FSDP2 through the same orders (_apply by to_empty, assign=True, freezing):
    theirs = res["torch"]
    check_close_run(traced, theirs, "traced vs torch's FSDP2", tol=tol, param_tol=param_tol)
    assert traced["got_grad"] == eager["got_grad"] == theirs["got_grad"], res
    assert theirs["hooks"] == traced["hooks"], (theirs["hooks"], traced["hooks"])
    frozen = traced["got_grad"][ORDERS.index("freeze")]
    assert not all(frozen) and any(frozen), frozen
    assert all(traced["got_grad"][ORDERS.index("unfreeze")]), traced["got_grad"]
    assert traced["dtensor_inputs"] == 0, traced["dtensor_inputs"]
    assert traced["placements"] == eager["placements"], (traced["placements"], eager["placements"])
    assert "Shard(dim=1)" in traced["placements"]["layers.0.fc1.weight"], traced["placements"]
    assert "Replicate" in traced["placements"]["norm.weight"], traced["placements"]
    # ignored_params: left as they are (a plain Parameter, its gradient this rank's own).
    assert traced["ignored"][0] == eager["ignored"][0] == "Parameter", traced["ignored"]
    check_same({"bias": traced["ignored"][1]}, {"bias": eager["ignored"][1]}, "ignored bias",
               rtol=1e-4, atol=1e-4)  # fmt: skip
    assert len(traced["errors"]) == 2, traced["errors"]
    # The hook's parameter is replaced by "assign": it runs once per backward until then.
    assert traced["hooks"] == eager["hooks"] == [2, 3, 4, 4, 4], (traced["hooks"], eager["hooks"])
