"""The migration guide as a test: one FSDP1 training script, run unchanged on torch's FSDP1 and
on ``fsdp2.fsdp1``.

``train(ns, cfg, mesh)`` is written once in FSDP1's vocabulary: it takes a namespace holding
either torch's FSDP1 names (``ShardingStrategy``, ``BackwardPrefetch``, ``MixedPrecision``,
``CPUOffload``, ``StateDictType`` from torch, ``wrap`` = ``FullyShardedDataParallel(...)``,
state dicts through ``FSDP.state_dict_type``) or ours (the same names from ``fsdp2.fsdp1``,
``wrap`` = ``shard_model(...)``, ``get_state_dict`` / ``load_state_dict``). It builds a model
from ``models.py`` (the tiny transformer with a tied embedding, or an MLP with float buffers
for mixed precision), wraps it, trains ``STEPS`` AdamW steps on the rank's slice of the global
batch, and before step ``SAVE_AT`` saves a state dict of the configured ``StateDictType``,
round-trips it through ``torch.save``, scales every
parameter by 0.5 and loads it back. It returns the rank-averaged losses and the final FULL
state dict.

Each world size runs its whole covering matrix (``CONFIGS``) in one ``run_on_ranks`` call;
every config runs both namespaces in the same worker and requires, on 2 and on 4 ranks:

* equal losses and final full parameters and buffers (the FULL state dict), 1e-5, for fp32
  and for ``MixedPrecision(bf16, fp32, buffer_dtype=bf16)`` alike: both engines all-gather the
  same bf16 values and reduce in fp32, and on torch 2.13 the bf16 runs match bitwise (so do
  the fp32 ones on 2 ranks; on 4 ranks the reduction order differs by ~2e-6 in the losses).
* the reload restored the model: each rank's local parameter values (summed per parameter)
  after it equal those before the save, for both engines.

Where torch's FSDP1 cannot run a config on CPU/gloo the reference changes, per config:

* ``CPUOffload(offload_params=True)``: FSDP1 pins memory, which needs an accelerator; its
  reference run omits the offload (which changes no arithmetic).
* ``LOCAL_STATE_DICT``: each engine reloads its own format. FSDP1 cannot reload its LOCAL state
  dict with ``use_orig_params=True`` (unexpected ``_flat_param`` keys) nor use it with a
  ``device_mesh`` (hybrid), so LOCAL configs use ``use_orig_params=False`` (FSDP1's default:
  the optimizer then sees flat parameters; AdamW is elementwise, so the numbers match) and
  the hybrid configs use FULL/SHARDED.

The covering set: every ``ShardingStrategy`` (hybrid ones on 4 ranks, a ``(2, 2)`` mesh),
``BackwardPrefetch`` PRE/POST/``None``, ``forward_prefetch`` on/off, mixed precision,
CPU offload, FULL/SHARDED/LOCAL state dicts, and three policy forms (``ModuleWrapPolicy``,
torch's ``transformer_auto_wrap_policy`` partial passed to both engines, size-based).
"""

from __future__ import annotations

import copy
import functools
import io
import types
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from helpers import TOL
from models import TransformerBlock, build, make_batch, mean_over_ranks, rank_slice
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

STEPS = 4
SAVE_AT = 2  # the state dict is saved and reloaded before this step


class Config(NamedTuple):
    name: str
    model: str  # "transformer" (models.TinyTransformer) or "scaled_mlp" (float buffers)
    strategy: str
    backward_prefetch: str | None
    forward_prefetch: bool
    state_dict: str  # a StateDictType name
    policy: str = "module_wrap"  # "module_wrap", "transformer" or "size"
    mixed_precision: bool = False
    offload: bool = False


_COMMON = [
    Config("full_shard", "transformer", "FULL_SHARD", "BACKWARD_PRE", False, "FULL_STATE_DICT"),
    Config(
        "zero2_post_fwd",
        "transformer",
        "SHARD_GRAD_OP",
        "BACKWARD_POST",
        True,
        "SHARDED_STATE_DICT",
        policy="transformer",
    ),
    Config("no_shard_local", "transformer", "NO_SHARD", None, False, "LOCAL_STATE_DICT"),
    Config(
        "full_shard_local",
        "transformer",
        "FULL_SHARD",
        "BACKWARD_POST",
        True,
        "LOCAL_STATE_DICT",
        policy="size",
    ),
    Config(
        "mixed_precision",
        "scaled_mlp",
        "FULL_SHARD",
        "BACKWARD_PRE",
        True,
        "SHARDED_STATE_DICT",
        mixed_precision=True,
    ),
    Config("offload", "transformer", "FULL_SHARD", None, False, "FULL_STATE_DICT", offload=True),
]
CONFIGS = {
    2: _COMMON,
    4: [
        *_COMMON,
        Config("hybrid", "transformer", "HYBRID_SHARD", "BACKWARD_PRE", True, "FULL_STATE_DICT"),
        Config(
            "hybrid_zero2_mp",
            "scaled_mlp",
            "_HYBRID_SHARD_ZERO2",
            None,
            False,
            "SHARDED_STATE_DICT",
            mixed_precision=True,
            policy="transformer",
        ),
    ],
}


class _ScaledBlock(nn.Module):
    """``relu(lin(x)) * scale`` with a float buffer ``scale`` (cast by ``buffer_dtype``)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.lin(x)) * self.scale


class _ScaledMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_ScaledBlock(7, 12), _ScaledBlock(12, 10)])
        self.head = nn.Linear(10, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _build(kind: str) -> nn.Module:
    if kind == "transformer":
        return build("transformer")
    torch.manual_seed(0)
    return _ScaledMLP()


def _local_sums(model: nn.Module) -> list[float]:
    """This rank's parameter values, summed per parameter (no communication)."""
    return [
        float((p.to_local() if hasattr(p, "to_local") else p).detach().double().sum())
        for p in model.parameters()
    ]


# ---------------------------------------------------------------------------------------------
# The script: FSDP1 vocabulary only, through ``ns`` (and a check of the reload)


def train(ns: Any, cfg: Config, mesh: DeviceMesh | None) -> tuple[list[float], dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _build(cfg.model)
    block = TransformerBlock if cfg.model == "transformer" else _ScaledBlock
    kwargs: dict[str, Any] = {
        "auto_wrap_policy": ns.policy(cfg.policy, block),
        "sharding_strategy": ns.ShardingStrategy[cfg.strategy],
        "backward_prefetch": (
            None if cfg.backward_prefetch is None else ns.BackwardPrefetch[cfg.backward_prefetch]
        ),
        "forward_prefetch": cfg.forward_prefetch,
    }
    if cfg.mixed_precision:
        kwargs["mixed_precision"] = ns.MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16
        )
    if cfg.offload:
        kwargs["cpu_offload"] = ns.CPUOffload(offload_params=True)
    if mesh is not None:
        kwargs["device_mesh"] = mesh
    model = ns.wrap(model, cfg, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sd_type = ns.StateDictType[cfg.state_dict]
    batch_kind = "transformer" if cfg.model == "transformer" else "mlp_head"
    losses = []
    for step in range(STEPS):
        if step == SAVE_AT:
            before = _local_sums(model)
            buf = io.BytesIO()
            torch.save(ns.save(model, sd_type), buf)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
            buf.seek(0)
            ns.load(model, torch.load(buf, weights_only=False), sd_type)
            assert _local_sums(model) == before, f"{cfg.name}: the reload did not restore"
        x, y = make_batch(batch_kind, step)
        out = model(rank_slice(x, rank, world)).float()
        y = rank_slice(y, rank, world)
        if cfg.model == "transformer":
            loss = F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))
        else:
            loss = F.mse_loss(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(mean_over_ranks(loss)))
    final = ns.save(model, ns.StateDictType.FULL_STATE_DICT)
    return losses, {k: v.detach().float().clone() for k, v in final.items()}


# ---------------------------------------------------------------------------------------------
# The two namespaces


def _torch_namespace() -> Any:
    from torch.distributed import fsdp
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import (
        ModuleWrapPolicy,
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    def policy(kind: str, block: type[nn.Module]) -> object:
        if kind == "module_wrap":
            return ModuleWrapPolicy({block})
        if kind == "size":
            return functools.partial(size_based_auto_wrap_policy, min_num_params=1000)
        return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block})

    def wrap(model: nn.Module, cfg: Config, **kwargs: Any) -> nn.Module:
        kwargs.pop("cpu_offload", None)  # FSDP1 pins memory: no offload on a CPU-only machine
        return FSDP(
            model,
            device_id=torch.device("cpu"),
            use_orig_params=cfg.state_dict != "LOCAL_STATE_DICT",  # see the module docstring
            **kwargs,
        )

    def save(model: nn.Module, kind: Any) -> dict[str, Any]:
        with FSDP.state_dict_type(model, kind):
            return model.state_dict()

    def load(model: nn.Module, sd: dict[str, Any], kind: Any) -> None:
        with FSDP.state_dict_type(model, kind):
            model.load_state_dict(sd)

    return types.SimpleNamespace(
        ShardingStrategy=fsdp.ShardingStrategy,
        BackwardPrefetch=fsdp.BackwardPrefetch,
        MixedPrecision=fsdp.MixedPrecision,
        CPUOffload=fsdp.CPUOffload,
        StateDictType=fsdp.StateDictType,
        policy=policy,
        wrap=wrap,
        save=save,
        load=load,
    )


def _our_namespace() -> Any:
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from fsdp2 import fsdp1

    def policy(kind: str, block: type[nn.Module]) -> object:
        if kind == "module_wrap":
            return {block}
        if kind == "size":
            return fsdp1.size_based_policy(1000)
        # torch's FSDP1 policy function, passed as it is
        return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block})

    def wrap(model: nn.Module, cfg: Config, **kwargs: Any) -> nn.Module:
        return fsdp1.shard_model(model, **kwargs)

    def load(model: nn.Module, sd: dict[str, Any], kind: Any) -> None:
        fsdp1.load_state_dict(model, sd, kind)

    return types.SimpleNamespace(
        ShardingStrategy=fsdp1.ShardingStrategy,
        BackwardPrefetch=fsdp1.BackwardPrefetch,
        MixedPrecision=fsdp1.MixedPrecision,
        CPUOffload=fsdp1.CPUOffload,
        StateDictType=fsdp1.StateDictType,
        policy=policy,
        wrap=wrap,
        save=fsdp1.get_state_dict,
        load=load,
    )


def _run_matrix(configs: list[Config]) -> dict[str, dict[str, Any]]:
    """Run every config with both namespaces; per config the losses and any mismatch."""
    world = dist.get_world_size()
    mesh = None
    if any(c.strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2") for c in configs):
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    namespaces = {"torch": _torch_namespace(), "fsdp2": _our_namespace()}
    out: dict[str, dict[str, Any]] = {}
    for cfg in configs:
        hybrid = cfg.strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
        runs = {k: train(ns, cfg, mesh if hybrid else None) for k, ns in namespaces.items()}
        (want_losses, want), (got_losses, got) = runs["torch"], runs["fsdp2"]
        errors = []
        try:
            torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), **TOL)
        except AssertionError as e:
            errors.append(f"losses {got_losses} vs torch {want_losses}: {e}")
        if got.keys() != want.keys():
            errors.append(f"state dict keys {sorted(got)} vs torch {sorted(want)}")
        for key in sorted(got.keys() & want.keys()):
            try:
                torch.testing.assert_close(got[key], want[key], **TOL)
            except AssertionError as e:
                errors.append(f"{key}: {e}")
        diffs = [(got[k] - want[k]).abs().max().item() for k in got.keys() & want.keys()]
        out[cfg.name] = {
            "losses": got_losses,
            "torch_losses": want_losses,
            "max_loss_diff": max(abs(a - b) for a, b in zip(got_losses, want_losses, strict=True)),
            "max_param_diff": max(diffs),
            "errors": errors,
        }
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp1_script_parity(world_size: int) -> None:
    results = run_on_ranks(world_size, _run_matrix, CONFIGS[world_size])
    assert results[0].keys() == {c.name for c in CONFIGS[world_size]}
    failures = {name: r["errors"] for rank in results for name, r in rank.items() if r["errors"]}
    assert not failures, failures


def _torch_save_sharded() -> None:
    from fsdp2 import fsdp1

    model = fsdp1.shard_model(_build("scaled_mlp"), auto_wrap_policy={_ScaledBlock})
    sd = fsdp1.get_state_dict(model, fsdp1.StateDictType.SHARDED_STATE_DICT)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    copied = copy.deepcopy(model.state_dict())
    for key, value in sd.items():
        for what, other in (("torch.load", loaded[key]), ("deepcopy", copied[key])):
            assert type(other) is type(value), (what, key, type(other))
            torch.testing.assert_close(
                other.to_local() if hasattr(other, "to_local") else other,
                value.to_local() if hasattr(value, "to_local") else value,
                msg=lambda m, what=what, key=key: f"{what} {key}: {m}",
            )


def test_torch_save_sharded_state_dict() -> None:
    """``torch.save`` / ``copy.deepcopy`` of a SHARDED state dict (what FSDP1 scripts do per
    rank): every local shard is a view into its group's flat buffer, at an offset."""
    run_on_ranks(2, _torch_save_sharded)
