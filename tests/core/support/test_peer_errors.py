"""Errors where torch's FSDP2 raises a particular exception type for a path users hit:
fsdp2 raises the same type, naming the parameters, before any collective.

* a non-contiguous parameter (``channels_last`` conv weight) -> ``NotImplementedError``;
* a first forward with parameters still on the meta device -> ``RuntimeError`` listing
  them by full name (and the model trains once they are materialized);
* ``reshard_after_forward`` of the wrong type (``1.5``) -> ``ValueError``.

Each case runs on fsdp2 and on torch's ``fully_shard`` where torch raises the same type.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _harness import run_on_ranks
from helpers import ENGINES, world_mesh


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _channels_last(engine: str) -> str:
    mesh = world_mesh()
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()
    try:
        ENGINES[engine](conv, mesh=mesh)
    except Exception as e:  # noqa: BLE001 - the type is what is checked
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_non_contiguous_parameter_raises_not_implemented() -> None:
    for msg in run_on_ranks(2, _channels_last, "fsdp2"):
        assert msg.startswith("NotImplementedError"), msg
        assert "weight" in msg and "contiguous" in msg, msg


def _meta_forward(engine: str) -> str:
    mesh = world_mesh()
    with torch.device("meta"):
        model = _Net()
    for layer in model.layers:
        ENGINES[engine](layer, mesh=mesh)
    ENGINES[engine](model, mesh=mesh)
    try:
        model(torch.randn(2, 4))
    except RuntimeError as e:
        msg = f"RuntimeError: {e}"
    else:
        return "no error"
    if engine == "fsdp2":  # materialized, the same model trains
        model.to_empty(device="cpu")
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
        model(torch.randn(2, 4)).sum().backward()
    return msg


@pytest.mark.parametrize("engine", list(ENGINES))
def test_forward_with_meta_parameters_raises_runtime_error(engine: str) -> None:
    for msg in run_on_ranks(2, _meta_forward, engine):
        assert msg.startswith("RuntimeError"), msg
        if engine == "fsdp2":
            for name in ("layers.0.weight", "layers.0.bias", "layers.1.weight"):
                assert name in msg, msg
            assert "to_empty" in msg, msg


def _bad_reshard(engine: str, value: object) -> str:
    mesh = world_mesh()
    try:
        ENGINES[engine](nn.Linear(2, 2), mesh=mesh, reshard_after_forward=value)
    except Exception as e:  # noqa: BLE001 - the type is what is checked
        return type(e).__name__
    return "no error"


@pytest.mark.parametrize("value", [1.5, "yes"], ids=["float", "str"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_bad_reshard_after_forward_raises_value_error_like_torch(
    engine: str, value: object
) -> None:
    assert run_on_ranks(2, _bad_reshard, engine, value) == ["ValueError"] * 2
