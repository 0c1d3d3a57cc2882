"""What the full-checkpoint tests (``checkpoint/test_full_checkpoint_*.py``) share: the model,
its values, and the files as ``safetensors`` itself reads them.

Values are compared bitwise (``torch.equal`` of ``full_tensor()``, same dtype) with an
unsharded reference built under the same seed. The model is a tiny ``fsdp2.models.llama.Llama``
(vocabulary 61: uneven shards; non-persistent ``rope`` buffer) plus persistent buffers
(int64, 0-dim int64, empty, fp32) and a (3, 2) parameter that leaves empty shards on 4 ranks.

The names keep a leading underscore: they are these test modules' own helpers, imported by
name from here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import check_same, world_mesh
from models import full_value, shard_model
from safetensors.torch import load_file
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Shard

import fsdp2
from fsdp2.models.llama import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, ffn_multiple_of=16, max_seq_len=16)
TIED = dataclasses.replace(CFG, tie_embeddings=True)
BATCH, SEQ = 4, 8
SMALL = 8192  # bytes: a few tensors per file, so a save writes several files
INDEX = "model.safetensors.index.json"


# ---------------------------------------------------------------------------------------------
# Models and values


def _build(seed: int = 0, *, tied: bool = False, meta: bool = False) -> Llama:
    """The Llama under ``seed``, plus persistent buffers ``counts`` (int64), ``step`` (0-dim
    int64), ``empty`` (0 elements) and ``norm.scale`` (fp32) and a small parameter ``tiny``
    (3, 2). On the meta device, ``rope`` is meta too."""
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model = Llama(TIED if tied else CFG)
        model.register_buffer("counts", torch.arange(7) * 3 + seed)
        model.register_buffer("step", torch.tensor(5 + seed))  # 0-dim
        model.register_buffer("empty", torch.zeros(0, 3))
        model.norm.register_buffer("scale", torch.linspace(0.5, 1.5, 5) + seed)
        # Unused in forward; 3 rows or 2 columns: empty shards on 4 ranks.
        model.tiny = nn.Parameter(torch.randn(3, 2))
    return model


def _shard_dim(p: torch.Tensor, dim: int) -> int:
    """``dim`` for 2-D parameters it divides evenly (fully_shard's rule), else 0."""
    return dim if p.dim() == 2 and p.shape[dim] % dist.get_world_size() == 0 else 0


def _shard(
    model: nn.Module, mesh: Any = None, engine: str = "fsdp2", dim: int = 0, **kw: Any
) -> nn.Module:
    """Every block, then the root; 2-D parameters on ``Shard(dim)`` where even."""
    fn = fsdp2.fully_shard if engine == "fsdp2" else torch_fully_shard
    if dim:
        kw["shard_placement_fn"] = lambda p: Shard(_shard_dim(p, dim))
    return shard_model(model, fn, world_mesh() if mesh is None else mesh, **kw)


def _meta_sharded(seed: int, mesh: Any = None, **kw: Any) -> nn.Module:
    """Built and sharded on the meta device, then ``rope`` built on the CPU (it is in no
    checkpoint): what a user does before ``load_full_checkpoint``."""
    model = _shard(_build(seed, meta=True), mesh, **kw)
    model.rope = model._rope(torch.device("cpu"))
    return model


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters and buffers (non-persistent ones too) by name. Collective."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    return {n: full_value(t) for n, t in named}


def _check_state(model: nn.Module, want: dict[str, torch.Tensor], what: str) -> None:
    check_same(_state(model), want, what, bitwise=True)


def _tokens(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _check_logits(model: nn.Module, ref: nn.Module, what: str) -> None:
    x, _ = _tokens()
    with torch.no_grad():
        got, want = model(x), ref(x)
    assert torch.equal(got, want), (
        f"{what}: logits differ (max abs diff {(got - want).abs().max().item():.3g})"
    )


def _read_dir(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a saved checkpoint (a directory or a ``.safetensors`` file), read with
    ``safetensors`` itself."""
    if path.endswith(".safetensors"):
        return load_file(path)
    index = os.path.join(path, INDEX)
    if not os.path.exists(index):
        return load_file(os.path.join(path, "model.safetensors"))
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        tensors = load_file(os.path.join(path, file))
        assert sorted(tensors) == sorted(k for k, v in weight_map.items() if v == file), (
            f"{file}: holds {sorted(tensors)}, the index says otherwise"
        )
        out.update(tensors)
    return out


def _check_saved(path: str, want: dict[str, torch.Tensor], what: str) -> None:
    """The checkpoint at ``path`` holds exactly ``want`` (bitwise, same dtypes)."""
    got = _read_dir(path)
    assert sorted(got) == sorted(want), f"{what}: saved {sorted(got)}, want {sorted(want)}"
    check_same({k: got[k] for k in want}, want, f"{what} saved", bitwise=True)


def _want_saved(ref: nn.Module) -> dict[str, torch.Tensor]:
    """What a full checkpoint of ``ref`` holds: its state dict, a tied tensor once."""
    seen: set[int] = set()
    out = {}
    for name, t in ref.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t.detach().clone()
    return out


def _write_on_rank0(write: Any) -> None:
    """``write()`` on rank 0 (files every rank then reads), then a barrier."""
    if dist.get_rank() == 0:
        write()
    dist.barrier()


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
