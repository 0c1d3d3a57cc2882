"""fsdp2's profiler labels and ``fsdp2.timeline`` (one step as a Chrome trace, a Gantt chart
and a summary), on 2 and 4 gloo ranks with the Llama of ``fsdp2.models``.

* Labels: under ``torch.profiler`` the step's events hold, per block, ``fsdp2::copy_in``,
  ``fsdp2::all_gather issue/wait``, ``fsdp2::copy_out``, ``fsdp2::reshard``, ``fsdp2::reduce_scatter
  pack/issue/wait``, the hooks (``fsdp2::hook pre_forward layers.0`` ...,
  ``fsdp2::hook final_callback``), and with HSDP ``fsdp2::all_reduce issue/wait``; without
  a profiler ``label`` returns one shared do-nothing context (no string is built).
* ``timeline``: the summary's parts add up to the step; one lane per block with its
  all-gathers (forward + backward) and reduce-scatter, in flight from issue to the end of
  their wait; the counts of collectives; the Chrome trace loads as JSON with the labels,
  the PNG is a PNG; the losses and parameters are bitwise those of the same steps without
  it; ``path=None`` writes nothing.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _harness import run_on_ranks
from helpers import hsdp_mesh, world_mesh
from torch.profiler import ProfilerActivity, profile

import fsdp2
from fsdp2 import fully_shard
from fsdp2._core.support.labels import _OFF, label
from fsdp2.models.llama import Llama, LlamaConfig

LAYERS = 3


def _model(mesh) -> Llama:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=LAYERS, n_heads=4, max_seq_len=16))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step(model: Llama, optim: torch.optim.Optimizer, i: int) -> float:
    g = torch.Generator().manual_seed(i * 10 + torch.distributed.get_rank())
    tokens = torch.randint(0, 64, (2, 9), generator=g)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def _labels(layout: str) -> list[str]:
    mesh = hsdp_mesh((2, 2)) if layout == "hsdp" else world_mesh()
    model = _model(mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, optim, 0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model, optim, 1)
    return sorted({e.name for e in prof.events() if e.name.startswith("fsdp2::")})


@pytest.mark.parametrize("world, layout", [(2, "fsdp"), (4, "hsdp")])
def test_profiler_labels(world, layout):
    names = run_on_ranks(world, _labels, layout)[0]
    for i in range(LAYERS):
        block = f"layers.{i}"
        for kind in (
            "copy_in",
            "all_gather issue",
            "all_gather wait",
            "copy_out",
            "reshard",
            "reduce_scatter pack",
            "reduce_scatter issue",
            "reduce_scatter wait",
            "hook pre_forward",
            "hook post_forward",
            "hook pre_backward",
            "hook post_backward",
        ):
            assert f"fsdp2::{kind} {block}" in names, (kind, block, names)
        if layout == "hsdp":
            assert f"fsdp2::all_reduce issue {block}" in names, names
            assert f"fsdp2::all_reduce wait {block}" in names, names
    assert "fsdp2::hook final_callback" in names, names


def test_labels_cost_nothing_without_a_profiler():
    built = []
    assert label("all_gather issue", lambda: built.append(1) or "x") is _OFF
    assert not built, "the label's name is not built without a profiler"


def _timeline(prefix: str | None) -> dict:
    model, twin = _model(world_mesh()), _model(world_mesh())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_optim = torch.optim.SGD(twin.parameters(), lr=0.1)
    losses, twin_losses = [_step(model, optim, 0)], [_step(twin, twin_optim, 0)]
    with fsdp2.timeline(prefix) as tl:
        losses.append(_step(model, optim, 1))
    twin_losses.append(_step(twin, twin_optim, 1))
    assert losses == twin_losses, (losses, twin_losses)
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
    return {
        "summary": tl.summary,
        "parts": (tl.step_s, tl.compute_s, tl.exposed_comm_s, tl.framework_s),
        "collectives": tl.collectives,
        "lanes": {k: [(op, a, b, i, w) for op, a, b, i, w in v] for k, v in tl.lanes.items()},
        "trace": tl.trace_path,
        "png": tl.png_path,
    }


def test_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    prefix = str(tmp_path / "out" / "step")
    for rank, got in enumerate(run_on_ranks(2, _timeline, prefix)):
        step, compute, comm, framework = got["parts"]
        assert step > 0 and min(compute, comm, framework) >= 0, got["parts"]
        assert abs(compute + comm + framework - step) < 1e-9, got["parts"]
        assert got["summary"].startswith(f"step {step:.3f} s: compute {compute:.3f} s"), got
        # 3 blocks + root gathered in the forward, the blocks again in the backward
        # (the root keeps its parameters); one reduce-scatter per group
        assert got["collectives"] == {"all_gather": 2 * LAYERS + 1, "reduce_scatter": LAYERS + 1}
        for i in range(LAYERS):
            ops = [entry[0] for entry in got["lanes"][f"layers.{i}"]]
            assert sorted(ops) == ["all_gather", "all_gather", "reduce_scatter"], ops
            for _, a, b, issue, wait in got["lanes"][f"layers.{i}"]:
                assert 0 <= a <= b <= step and issue + wait <= b - a + 1e-9
        assert (
            got["trace"] == f"{prefix}.rank{rank}.json" and got["png"] == f"{prefix}.rank{rank}.png"
        )
        with open(got["trace"]) as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        assert "fsdp2::step" in names and "fsdp2::all_gather wait layers.0" in names
        with open(got["png"], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_timeline_without_files(tmp_path):
    got = run_on_ranks(2, _timeline, None)[0]
    assert got["trace"] is None and got["png"] is None and got["parts"][0] > 0
    assert os.listdir(tmp_path) == []
