"""``fsdp_should_release_all_gather_outputs_after_post_all_gather`` (torch main's extension hook,
pytorch PR 194114), on 2 gloo ranks, with test_tensor_subclass.py's ``Bf16Gather`` (fp32 data
gathered as bf16; its post-all-gather tensor is a new fp32 tensor, never a view of the raw
outputs).

* ``True``: the raw all-gather outputs are freed right after ``fsdp_post_all_gather`` (their
  storage is empty while the module computes), reallocated by the next unshard, and training
  is bitwise the run without the hook (3 AdamW steps: losses and local shards);
* ``False``: the outputs are kept until the reshard, as without the hook;
* errors before any collective: the hook returning a non-bool (``TypeError``), the hook on a
  subclass without the all-gather hooks (``TypeError``), and ``reshard_after_forward=2`` on 4
  ranks with a hook answering ``True`` (``NotImplementedError``: the smaller copy is built
  from the outputs; ``False`` is accepted).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from _harness import run_on_ranks
from helpers import world_mesh
from test_tensor_subclass import Bf16Gather, _Uneven

import fsdp2
from fsdp2._core.runtime.state import state_of


class _Release(Bf16Gather):
    answer: Any = True

    def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> Any:
        return type(self).answer


def _model(cls: type, raf: Any = True) -> nn.Module:
    torch.manual_seed(0)
    model = _Uneven(pad=True)
    for lin in (model.layers[0], model.layers[2]):
        lin.weight = nn.Parameter(cls(lin.weight._data.clone(), True))
    for layer in model.layers:
        fsdp2.fully_shard(layer, mesh=world_mesh(), reshard_after_forward=raf)
    fsdp2.fully_shard(model, mesh=world_mesh())
    return model


def _outputs_held(layer: nn.Module) -> list[bool]:
    (group,) = state_of(layer).groups
    return [t.untyped_storage().nbytes() > 0 for p in group.ext_params for t in p.ext.outputs or ()]


def _train(cls: type, answer: Any = True) -> dict[str, Any]:
    _Release.answer = answer
    model = _model(cls)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    held: list[list[bool]] = []
    # after fsdp2's pre-forward hook: the parameters gathered, the module about to compute
    hook = model.layers[0].register_forward_pre_hook(lambda m, _: held.append(_outputs_held(m)))
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, 4, generator=g)).pow(2).mean()
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    hook.remove()
    shards = [p.to_local() for p in model.parameters()]
    shards = [p._data if isinstance(p, Bf16Gather) else p for p in shards]
    return {"losses": losses, "shards": shards, "held": held}


def _release() -> dict[str, Any]:
    plain, released, kept = _train(Bf16Gather), _train(_Release, True), _train(_Release, False)
    same = all(
        torch.equal(a, b)
        for run in (released, kept)
        for a, b in zip(
            run["losses"] + run["shards"], plain["losses"] + plain["shards"], strict=True
        )
    )
    return {
        "same": same,
        "released": released["held"],
        "kept": kept["held"],
        "plain": plain["held"],
    }


def test_release_outputs_after_post_all_gather() -> None:
    for out in run_on_ranks(2, _release):
        assert out["same"], out
        assert out["released"] == [[False]] * 3, out  # freed before the module computed
        assert out["kept"] == out["plain"] == [[True]] * 3, out


def _errors() -> list[str]:
    errors = []
    for answer, raf in (("yes", True), (True, 2)):
        _Release.answer = answer
        try:
            _model(_Release, raf)
        except (TypeError, NotImplementedError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    _Release.answer = False
    _model(_Release, 2)  # nothing released: the int copy is fine

    class _OnlyRelease(torch.Tensor):
        def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> bool:
            return True

    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(lin.weight.detach().as_subclass(_OnlyRelease))
    try:
        fsdp2.fully_shard(lin, mesh=world_mesh())
    except TypeError as e:
        errors.append(f"TypeError: {e}")
    return errors


def test_release_hook_errors() -> None:
    for errors in run_on_ranks(4, _errors):  # reshard_after_forward=2 is an int below 4
        assert len(errors) == 3, errors
        assert errors[0].startswith("TypeError") and "must return a bool" in errors[0], errors
        assert (
            errors[1].startswith("NotImplementedError") and "reshard_after_forward=2" in (errors[1])
        ), errors
        assert errors[2].startswith("TypeError") and "fsdp_pre_all_gather" in errors[2], errors


@pytest.fixture(autouse=True)
def _reset() -> Any:
    yield
    _Release.answer = True
