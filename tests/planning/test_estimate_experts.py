"""A mixture of experts' stacked 3-D parameters in ``fsdp2 estimate`` and
``fsdp2.estimate_memory``: sharded as torchtitan shards them ([Note: expert placement] in
fsdp2/planning/_experts.py), and a warning naming the fix where they are held padded.

* Mixtral (the shipped config's architecture, 8 experts, shrunk to width 64 and 2 blocks) on
  8 and 64 ranks: on 64 its experts shard on dim 1, rank 0 holds the bytes that placement
  gives (parameters, gradients, AdamW state, to the byte), and its peak is no larger than on
  8 (the shipped config itself: docs/cli.md, "Mixtures of experts").
* ``--experts-dim``: ``0`` holds whole experts on the first ranks (padding on the rest) and
  warns naming ``--experts-dim auto`` (docs/cli.md shows that warning for the full-size
  config: the same words, other shapes); ``auto`` on a mesh whose shard size does not divide
  dim 1 keeps dim 0 and warns naming the mesh; ``1`` shards on dim 1 where dim 0 would do.
* ``estimate_memory``: ``shard_placement_fn="auto"`` (the default), ``None`` (dim 0) and
  ``build(mesh)``'s own dim-0 sharding, each warning with its own fix; bad arguments raise.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import fsdp2
from fsdp2.planning._experts import PaddedExperts

pytest.importorskip("transformers", reason="transformers is a test extra")

from test_cli_checkpoint import fsdp2 as run_cli  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--batch", "2", "--seq", "32", "--device", "cpu", "--json"]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: Any) -> str:
    """The shipped Mixtral config, 8 experts, shrunk: width 64, 2 blocks."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(os.path.join(ROOT, "examples", "configs", "mixtral-8x7b"))
    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    small |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
    for k, v in small.items():
        setattr(config, k, v)
    assert config.num_local_experts == 8
    folder = str(tmp_path_factory.mktemp("mixtral"))
    config.save_pretrained(folder)
    return folder


def _held(folder: str, shards: int, dim1: bool) -> dict[str, int]:
    """Rank 0's fp32 shards (``dim1``: 3-D parameters on dim 1), gradients, AdamW state."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    params = list(model.parameters())
    numel = 0
    for p in params:
        if dim1 and p.dim() == 3:
            numel += p.numel() // shards
        else:  # dim 0: torch.chunk's first piece
            numel += -(-p.shape[0] // shards) * math.prod(p.shape[1:])
    steps = 4 * len(params)  # AdamW's fp32 step counter per parameter
    return {"parameters": 4 * numel, "gradients": 4 * numel, "optimizer state": 8 * numel + steps}


def _estimate(folder: str, *argv: str) -> tuple[dict[str, Any], str]:
    code, out, err = run_cli("estimate", folder, *argv, *SMALL)
    assert code == 0, err[-3000:]
    return json.loads(out), err


def test_mixtral_on_64_ranks_peaks_no_higher_than_on_8(mixtral: str) -> None:
    on8, err8 = _estimate(mixtral, "--mesh", "8")
    on64, err64 = _estimate(mixtral, "--mesh", "64")
    assert not err8 and not err64, (err8, err64)
    assert on8["held"] == _held(mixtral, 8, dim1=False), on8["held"]
    assert "experts sharded on dim 1" not in on8["settings"]
    assert on64["held"] == _held(mixtral, 64, dim1=True), on64["held"]
    assert "experts sharded on dim 1" in on64["settings"]
    assert on64["peak_bytes"] <= on8["peak_bytes"], (on64["peak_bytes"], on8["peak_bytes"])


OPTION_CASES = [
    # mesh, --experts-dim, rank 0's 3-D parameters on dim 1, the fix the warning names
    ("64", "0", False, "--experts-dim auto (the default) shards them on dim 1"),
    ("48", "auto", False, "pick a world size, or an HSDP --mesh RxS"),  # 48 divides neither
    ("6x8", "auto", False, None),  # HSDP: 8 experts over 8 shard ranks, even on dim 0
    ("8", "1", True, None),
]


@pytest.mark.parametrize(
    "mesh,dim,dim1,fix", OPTION_CASES, ids=[f"{c[0]}-{c[1]}" for c in OPTION_CASES]
)
def test_experts_dim_option(mixtral: str, mesh: str, dim: str, dim1: bool, fix: str) -> None:
    got, err = _estimate(mixtral, "--mesh", mesh, "--experts-dim", dim)
    assert got["held"] == _held(mixtral, int(mesh.split("x")[-1]), dim1), got["held"]
    assert ("experts sharded on dim 1" in got["settings"]) is dim1, got["settings"]
    if fix is None:
        assert not err, err
        return
    shards = mesh.split("x")[-1]
    assert err.startswith(f"fsdp2 estimate: warning: mesh {mesh}: "), err
    assert f"8 rows over {shards} shard ranks: shard ranks 8 to" in err and fix in err, err
    assert "model.layers.*.mlp.experts.gate_up_proj (8, 256, 64)" in err, err
    assert len(err.strip().splitlines()) == 1, err  # once, though 2 blocks and 2 tensors
    if dim == "0":  # docs/cli.md's warning, for the full-size Mixtral on 64 ranks
        text = open(os.path.join(ROOT, "docs", "cli.md")).read()
        (shown,) = re.findall(r"^```text\n(fsdp2 estimate: warning: .*?)^```", text, re.M | re.S)
        shape = re.compile(r"\(\d+, \d+, \d+\)")
        assert shape.sub("(...)", err) == shape.sub("(...)", shown), (err, shown)


# ---- estimate_memory ------------------------------------------------------------------


class Experts(nn.Module):
    """Stacked experts ``(4, 32, 32)``, every one applied (an einsum)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 32, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bd,ehd->bh", x, self.w)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Experts(), Experts()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _api(mesh: int, **kw: Any) -> fsdp2.MemoryEstimate:
    model: Any = kw.pop("model", None)
    if model is None:
        with torch.device("meta"):
            model = Net()
    x = torch.empty(2, 32, device="meta")
    return fsdp2.estimate_memory(model, x, mesh_shape=mesh, device="cpu", compare=False, **kw)


def _shard_bytes(rows: int) -> int:
    return 2 * rows * 32 * 32 * 4  # two fp32 (rows, 32, 32) shards


def test_estimate_memory_auto_and_dim0() -> None:
    with pytest.warns(UserWarning) as caught:  # (no warning fails pytest.warns: one below)
        est = _api(8)
        dim0 = _api(8, shard_placement_fn=None)
    assert est.held["parameters"] == _shard_bytes(4) // 8, est.held
    assert est.settings.endswith("experts sharded on dim 1"), est.settings
    assert dim0.held["parameters"] == _shard_bytes(1), dim0.held  # a whole expert each
    padded = [w.message for w in caught if isinstance(w.message, PaddedExperts)]
    assert len(padded) == 1, [str(w.message) for w in caught]
    text = str(padded[0])
    assert "layers.*.w (4, 32, 32) are sharded on dim 0, 4 rows over 8 shard ranks" in text
    assert 'shard_placement_fn="auto" (the default) shards them on dim 1' in text, text


def test_estimate_memory_warns_where_dim1_does_not_divide() -> None:
    with pytest.warns(PaddedExperts, match="does not divide evenly over the shard ranks"):
        est = _api(6)  # 4 experts over 6 ranks, and 32 rows of dim 1 over 6
    assert est.held["parameters"] == _shard_bytes(1), est.held


def test_estimate_memory_warns_about_builds_that_pad() -> None:
    def build(mesh: DeviceMesh) -> nn.Module:
        with torch.device("meta"):
            model = Net()
        for layer in model.layers:
            fsdp2.fully_shard(layer, mesh=mesh)
        return fsdp2.fully_shard(model, mesh=mesh)

    with pytest.warns(PaddedExperts, match=r"Return Shard\(1\) for them from the shard_pl"):
        est = _api(8, model=build)
    assert est.held["parameters"] == _shard_bytes(1), est.held
    with pytest.raises(ValueError, match="shard_placement_fn apply to a model"):
        _api(8, model=build, shard_placement_fn=lambda p: None)
    with pytest.raises(TypeError, match='shard_placement_fn must be a function, None or "auto"'):
        _api(8, shard_placement_fn="dim1")
