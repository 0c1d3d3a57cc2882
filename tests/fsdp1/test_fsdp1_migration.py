"""The FSDP1 migration layer (``fsdp2.fsdp1``): ``shard_model`` with FSDP1's vocabulary.

* Parity: for ``FULL_SHARD``, ``SHARD_GRAD_OP``, ``NO_SHARD`` and ``HYBRID_SHARD`` (4 ranks,
  ``LOCAL_WORLD_SIZE=2``), an MLP wrapped with a module-class policy trains 3 AdamW steps; the
  rank-averaged losses and the full parameters after every step match a replicated reference
  and torch's FSDP1 (``FullyShardedDataParallel`` with ``ModuleWrapPolicy``, CPU/gloo).
* Policies: ``size_based_policy`` and a callable wrap exactly the expected modules; every
  policy form (torch's ``ModuleWrapPolicy``, ``CustomPolicy``, partials of its
  ``size_based`` / ``transformer`` / ``lambda`` policies and ``_or_policy``, a user function
  ``(module, recurse, nonwrapped_numel)``, our sets / ``size_based_policy`` / ``module -> bool``)
  selects the units torch's FSDP1 wraps for it, with and without mixed precision and
  ``ignored_modules``; bad ``CustomPolicy`` overrides raise; torch's ``MixedPrecision`` /
  ``CPUOffload`` objects are accepted.
* Prefetch: on a model running its blocks out of definition order, the implicit forward
  prefetch chain equals the order torch's FSDP1 records with ``forward_prefetch=True``, and
  losses match; ``backward_prefetch=None`` turns backward prefetch off.
* ``keep_low_precision_grads``: bf16 gradients on fp32 parameters, FSDP1's values and dtypes.
* ``MixedPrecision(bf16, fp32, buffer_dtype=bf16)`` trains; buffers are bf16, except in the
  ``BatchNorm`` (its own unit, full precision).
* Errors: ``HYBRID_SHARD`` on 4 ranks with ``LOCAL_WORLD_SIZE=3``; a bad policy.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from helpers import TOL
from models import (
    MLPBlock,
    build,
    local_loss,
    make_batch,
    make_optimizer,
    mean_over_ranks,
    rank_slice,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import Replicate, Shard

import fsdp2
from fsdp2 import FSDPModule
from fsdp2._core.front.seam import unit_settings
from fsdp2.fsdp1 import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    shard_model,
    size_based_policy,
)

STEPS = 3
MODEL = "mlp_head"  # blocks 7->5->3->1 (40, 18, 4 params) and a root head 1->2 (4 params)


def _check_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


def _set_local_world_size(value: int | None) -> None:
    if value is None:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    else:
        os.environ["LOCAL_WORLD_SIZE"] = str(value)


def _torch_fsdp1(model: nn.Module, strategy: str) -> nn.Module:
    kw: dict[str, object] = {}
    if strategy == "HYBRID_SHARD":
        ws = dist.get_world_size()
        kw["device_mesh"] = init_device_mesh(
            "cpu", (ws // 2, 2), mesh_dim_names=("replicate", "shard")
        )
    return FSDP1(
        model,
        auto_wrap_policy=ModuleWrapPolicy({MLPBlock}),
        sharding_strategy=TorchShardingStrategy[strategy],
        use_orig_params=True,
        device_id=torch.device("cpu"),
        **kw,
    )


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("_fsdp_wrapped_module.", "")] = t.detach().clone()
    return out


def _parity(strategy: str) -> list[tuple[str, float, float]]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    _set_local_world_size(2 if strategy == "HYBRID_SHARD" else None)
    try:
        ref = build(MODEL)
        ours = shard_model(
            build(MODEL),
            auto_wrap_policy={MLPBlock},
            sharding_strategy=ShardingStrategy[strategy],
        )
    finally:
        _set_local_world_size(None)
    models = {"ref": ref, "fsdp2": ours}
    models["torch"] = _torch_fsdp1(build(MODEL), strategy)
    opts = {k: make_optimizer("adamw", m.parameters()) for k, m in models.items()}
    units = sorted(n or "<root>" for n, m in ours.named_modules() if isinstance(m, FSDPModule))
    assert units == ["<root>", "layers.0", "layers.1", "layers.2"], units
    for step in range(STEPS):
        x, y = make_batch(MODEL, step)
        losses = {}
        for key, model in models.items():
            if key == "ref":
                loss = local_loss(model, MODEL, x, y)
                loss.backward()
                losses[key] = loss.detach()
            else:
                xs, ys = rank_slice(x, rank, ws), rank_slice(y, rank, ws)
                loss = local_loss(model, MODEL, xs, ys)
                loss.backward()
                losses[key] = mean_over_ranks(loss)
            opts[key].step()
            opts[key].zero_grad()
        for key in ("fsdp2", "torch"):
            _check_close(losses[key], losses["ref"], f"{key} loss step {step}")
        want = _full_params(ref)
        for key in ("fsdp2", "torch"):
            if key == "torch":
                with FSDP1.summon_full_params(models[key]):
                    got = _full_params(models[key])
            else:
                got = _full_params(models[key])
            assert got.keys() == want.keys(), (key, got.keys(), want.keys())
            for name in want:
                _check_close(got[name], want[name], f"{key} {name} step {step}")
    return [(k, float(v)) for k, v in losses.items()]


@pytest.mark.parametrize(
    ("world_size", "strategy"),
    [
        (ws, strategy)
        for ws in (2, 4)
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
        if strategy != "HYBRID_SHARD" or ws == 4  # 2 nodes of LOCAL_WORLD_SIZE=2 ranks
    ],
)
def test_parity_with_fsdp1(world_size: int, strategy: str) -> None:
    run_on_ranks(world_size, _parity, strategy)


def _wrapped_units(policy_name: str) -> list[str]:
    policy = {
        # children first, as FSDP1: the Linears of layers.0 (40) and layers.1 (18) are wrapped,
        # which leaves their blocks with no unwrapped parameters; layers.2 (4) stays in the root
        "size": size_based_policy(18),
        "callable": lambda m: isinstance(m, nn.Linear) and m.out_features == 2,  # the head
    }[policy_name]
    model = shard_model(build(MODEL), auto_wrap_policy=policy)
    x, y = make_batch(MODEL, 0)
    local_loss(model, MODEL, x, y).backward()
    return sorted(n or "<root>" for n, m in model.named_modules() if isinstance(m, FSDPModule))


@pytest.mark.parametrize(
    ("policy", "want"),
    [
        ("size", ["<root>", "layers.0.lin", "layers.1.lin"]),
        ("callable", ["<root>", "head"]),
    ],
)
@pytest.mark.parametrize("world_size", [2, 4])
def test_policies(world_size: int, policy: str, want: list[str]) -> None:
    assert run_on_ranks(world_size, _wrapped_units, policy) == [want] * world_size


class _ScaledBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("scale", torch.full((d,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * self.scale


class _BNNet(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ScaledBlock(d) for _ in range(2))
        self.norm = nn.BatchNorm1d(d)
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)  # its own full-precision unit; blocks cast its output back to bf16
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _mixed_precision(offload: bool) -> dict[str, str]:
    torch.manual_seed(0)
    model = shard_model(
        _BNNet(),
        auto_wrap_policy={_ScaledBlock},
        mixed_precision=MixedPrecision(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            buffer_dtype=torch.bfloat16,
            cast_forward_inputs=True,
        ),
        cpu_offload=CPUOffload(offload_params=offload),
        forward_prefetch=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert torch.isfinite(loss), loss
    assert isinstance(model.norm, FSDPModule), "BatchNorm must be its own (full precision) unit"
    for p in model.parameters():
        assert p.dtype == torch.float32, p.dtype
    return {n: str(b.dtype) for n, b in model.named_buffers()}


@pytest.mark.parametrize("offload", [False, True])
def test_mixed_precision_buffers(offload: bool) -> None:
    (bufs, _) = run_on_ranks(2, _mixed_precision, offload)
    assert bufs["blocks.0.scale"] == "torch.bfloat16", bufs
    assert bufs["blocks.1.scale"] == "torch.bfloat16", bufs
    assert bufs["norm.running_mean"] == "torch.float32", bufs  # _module_classes_to_ignore


def _hybrid_bad_split() -> str:
    _set_local_world_size(3)
    try:
        with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=3") as e:
            shard_model(build(MODEL), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    finally:
        _set_local_world_size(None)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        shard_model(build(MODEL), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    with pytest.raises(ValueError, match="auto_wrap_policy"):
        shard_model(build(MODEL), auto_wrap_policy=42)  # type: ignore[arg-type]
    return str(e.value)


def test_bad_combinations() -> None:
    msgs = run_on_ranks(4, _hybrid_bad_split)
    assert "4 ranks" in msgs[0], msgs[0]


def test_vocabulary_matches_torch() -> None:
    from torch.distributed.fsdp import api as torch_api

    assert [s.name for s in ShardingStrategy] == [s.name for s in torch_api.ShardingStrategy]
    from dataclasses import fields

    def names_defaults(cls: type) -> list[tuple[str, object]]:
        return [(f.name, f.default) for f in fields(cls)]

    assert names_defaults(MixedPrecision) == names_defaults(torch_api.MixedPrecision)
    assert names_defaults(CPUOffload) == names_defaults(torch_api.CPUOffload)
    with pytest.raises(ValueError, match="buffer_dtype"):
        MixedPrecision(buffer_dtype=torch.int32)


def test_core_does_not_import_fsdp1() -> None:
    # ``import fsdp2`` in a fresh process leaves ``fsdp2.fsdp1`` unimported: test_import.py's
    # test_import_loads_no_more_than_training_needs (the same check, one interpreter less)
    import fsdp2

    assert "fsdp1" not in fsdp2.__all__


def test_fsdp1_layer_uses_only_public_api_and_seam() -> None:
    """The layer's files (``fsdp2/fsdp1/``) import from the core only what ``fsdp2`` exports,
    ``fsdp2.api`` and ``fsdp2._core.front.seam``, and touch no private attribute of the core's
    objects, so that the core can change behind ``fsdp2._core.front.seam``."""
    import ast
    import pathlib

    import fsdp2

    package = pathlib.Path(fsdp2.__file__).parent / "fsdp1"
    files = sorted(package.glob("*.py"))
    assert len(files) > 1
    allowed_modules = {"fsdp2.api", "fsdp2._core.front.seam"}
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                bad.append(f"{path.name}: relative import from .{node.module}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp2"):
                module = node.module or ""
                if module == "fsdp2":  # the package's public names
                    bad += [
                        f"{path.name}: fsdp2.{a.name}"
                        for a in node.names
                        if a.name not in fsdp2.__all__
                    ]
                elif module not in allowed_modules and not module.startswith("fsdp2.fsdp1"):
                    bad.append(f"{path.name}: from {module}")
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_fsdp"):
                bad.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert not bad, bad


def _ignored_and_meshes() -> dict[str, object]:
    model = build(MODEL)
    shard_model(
        model,
        auto_wrap_policy={MLPBlock},
        sharding_strategy=ShardingStrategy.NO_SHARD,
        ignored_modules=[model.head],
    )
    x, y = make_batch(MODEL, 0)
    local_loss(model, MODEL, x, y).backward()
    w = model.layers[0].lin.weight
    return {
        "head_is_dtensor": hasattr(model.head.weight, "full_tensor"),
        "head_has_grad": model.head.weight.grad is not None,
        "mesh_shape": tuple(w.device_mesh.shape),
        "placements": str(tuple(w.placements)),
        "replicated": isinstance(model.layers[0], fsdp2.ReplicateModule),
    }


def test_ignored_modules_and_no_shard_mesh() -> None:
    """NO_SHARD is fsdp2.replicate over every rank (Replicate() parameters on a 1D mesh)."""
    out = run_on_ranks(2, _ignored_and_meshes)[0]
    assert out == {
        "head_is_dtensor": False,
        "head_has_grad": True,
        "mesh_shape": (2,),
        "placements": "(Replicate(),)",
        "replicated": True,
    }, out


# ---------------------------------------------------------------------------------------------
# Wrap policies: the units equal torch's FSDP1's for the same policy object


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)  # 272 params
        self.norm = nn.LayerNorm(16)  # 32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


class _PBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2)  # 1088, out_proj 272 (a force-leaf module)
        self.inner = _Inner()  # 304
        self.fc = nn.Linear(16, 16)  # 272

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.inner(x + self.attn(x, x, x)[0]))


class _PolicyNet(nn.Module):
    """For selection (forwards never run): 3564 params, nesting, a ModuleList, a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 16)  # 136
        self.blocks = nn.ModuleList(_PBlock() for _ in range(2))  # 2 x 1664
        self.bn = nn.BatchNorm1d(16)  # 32
        self.head = nn.Linear(16, 4)  # 68

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.bn(x))


def _user_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    if recurse:
        return not isinstance(module, _Inner)  # never descend into (nor wrap) an _Inner
    return nonwrapped_numel >= 250


def _is_head(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.out_features == 4


# (case, torch policy, our policy if another form, mixed precision, ignore blocks.1)
_POLICY_CASES = [
    ("module_wrap", "module_wrap", None, False, False),
    ("module_wrap+mp", "module_wrap", None, True, False),
    ("set", "module_wrap", "set", False, False),
    ("size_300", "size_300", None, False, False),
    ("size_300+mp", "size_300", None, True, False),  # mp: FSDP1 descends everywhere
    ("size_300+ignored", "size_300", None, False, True),
    ("size_1000", "size_1000", None, False, False),
    ("our_size_300", "size_300", "our_size_300", False, False),
    ("transformer", "transformer", None, False, False),
    ("lambda", "lambda", None, False, False),
    ("module_fn", "lambda", "module_fn", False, False),
    ("user_fn", "user_fn", None, False, False),
    ("user_fn+mp", "user_fn", None, True, False),
    ("or", "or", None, False, False),
    ("custom", "custom", None, False, False),
    ("custom+ignored", "custom", None, False, True),
]


def _make_policy(name: str, model: nn.Module) -> object:
    from functools import partial

    from torch.distributed.fsdp.wrap import (
        CustomPolicy,
        _or_policy,
        lambda_auto_wrap_policy,
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    def custom(m: nn.Module) -> bool | dict[str, object]:
        if m is model.head:  # type: ignore[union-attr]
            return {"sharding_strategy": TorchShardingStrategy.SHARD_GRAD_OP}
        return isinstance(m, _Inner)

    if name == "module_wrap":
        return ModuleWrapPolicy({_PBlock})
    if name == "set":
        return {_PBlock}
    if name.startswith("size_"):
        return partial(size_based_auto_wrap_policy, min_num_params=int(name[5:]))
    if name == "our_size_300":
        return size_based_policy(300)
    if name == "transformer":
        return partial(transformer_auto_wrap_policy, transformer_layer_cls={_Inner})
    if name == "lambda":
        return partial(lambda_auto_wrap_policy, lambda_fn=_is_head)
    if name == "module_fn":
        return _is_head
    if name == "user_fn":
        return _user_policy
    if name == "or":
        return partial(
            _or_policy,
            policies=[
                partial(lambda_auto_wrap_policy, lambda_fn=_is_head),
                partial(transformer_auto_wrap_policy, transformer_layer_cls={_Inner}),
            ],
        )
    assert name == "custom", name
    return CustomPolicy(custom)


def _policy_units() -> dict[str, tuple[list[str], list[str], dict[str, bool]]]:
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

    out = {}
    for case, torch_name, our_name, mp, ignore in _POLICY_CASES:
        torch.manual_seed(0)
        ref = _PolicyNet()
        kw: dict[str, object] = {"ignored_modules": [ref.blocks[1]]} if ignore else {}
        if mp:
            kw["mixed_precision"] = TorchMixedPrecision(param_dtype=torch.bfloat16)
        wrapped = FSDP1(
            ref,
            auto_wrap_policy=_make_policy(torch_name, ref),
            device_id=torch.device("cpu"),
            use_orig_params=True,
            **kw,
        )
        want = sorted(
            n.replace("_fsdp_wrapped_module.", "") or "<root>"
            for n, m in wrapped.named_modules()
            if isinstance(m, FSDP1)
        )
        ours = _PolicyNet()
        kw = {"ignored_modules": [ours.blocks[1]]} if ignore else {}
        if mp:
            kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)
        shard_model(ours, auto_wrap_policy=_make_policy(our_name or torch_name, ours), **kw)
        got = sorted(n or "<root>" for n, m in ours.named_modules() if isinstance(m, FSDPModule))
        settings = unit_settings(ours)  # the units that manage parameters
        reshard = {
            n or "<root>": bool(settings[m].reshard_after_forward)
            for n, m in ours.named_modules()
            if isinstance(m, FSDPModule) and m in settings
        }
        out[case] = (want, got, reshard)
    return out


def test_policies_match_fsdp1_units() -> None:
    """Each policy form selects exactly the modules torch's FSDP1 wraps (names without
    ``_fsdp_wrapped_module.``): FSDP1's policy objects and functions passed as they are, our
    equivalents (a set of classes, ``size_based_policy``, a ``module -> bool``), with mixed
    precision (the BatchNorm becomes a unit and FSDP1 descends everywhere) and with
    ``ignored_modules``; a ``CustomPolicy`` dict's ``sharding_strategy`` override applies."""
    results = run_on_ranks(2, _policy_units)
    assert results[0] == results[1]
    bad = {case: (want, got) for case, (want, got, _) in results[0].items() if want != got}
    assert not bad, bad
    units = {case: got for case, (_, got, _) in results[0].items()}
    # the cases are not vacuous; FSDP1 never wraps a module it does not descend into (the
    # force-leaf MultiheadAttention under size-based policies, _Inner under _user_policy)
    assert units["size_300"] == [
        "<root>",
        "blocks.0",
        "blocks.0.inner",
        "blocks.1",
        "blocks.1.inner",
    ]
    # mixed precision makes FSDP1 descend everywhere: the attention becomes a unit and leaves
    # its blocks below the threshold
    assert units["size_300+mp"] == [
        "<root>",
        "blocks.0.attn",
        "blocks.0.inner",
        "blocks.1.attn",
        "blocks.1.inner",
        "bn",
    ]
    assert "bn" in units["module_wrap+mp"] and "bn" not in units["module_wrap"]
    assert not any(u.startswith("blocks.1") for u in units["size_300+ignored"])
    assert units["user_fn"] == [
        "<root>",
        *(f"blocks.{i}{m}" for i in (0, 1) for m in ("", ".attn", ".attn.out_proj", ".fc")),
    ]
    assert "blocks.0.inner.lin" in units["user_fn+mp"], units["user_fn+mp"]
    reshard = results[0]["custom"][2]
    assert reshard == {
        "<root>": True,
        "head": False,
        "blocks.0.inner": True,
        "blocks.1.inner": True,
    }, reshard


def _bad_policies() -> None:
    from torch.distributed.fsdp import CPUOffload as TorchCPUOffload
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
    from torch.distributed.fsdp.wrap import CustomPolicy

    model = shard_model(  # torch's config objects are converted
        build(MODEL),
        mixed_precision=TorchMixedPrecision(param_dtype=torch.bfloat16),
        cpu_offload=TorchCPUOffload(offload_params=True),
    )
    assert unit_settings(model)[model].mp_policy.param_dtype == torch.bfloat16
    with pytest.raises(TypeError, match="mixed_precision"):
        shard_model(build(MODEL), mixed_precision=torch.bfloat16)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="only sharding_strategy and mixed_precision"):
        shard_model(build(MODEL), auto_wrap_policy=CustomPolicy(lambda m: {"cpu_offload": 1}))
    # NO_SHARD blocks inside a FULL_SHARD model: replicated blocks, a sharded root
    mixed = shard_model(
        build(MODEL),
        auto_wrap_policy=CustomPolicy(
            lambda m: isinstance(m, MLPBlock) and {"sharding_strategy": ShardingStrategy.NO_SHARD}
        ),
    )
    assert all(isinstance(b, fsdp2.ReplicateModule) for b in mixed.layers)
    assert not isinstance(mixed, fsdp2.ReplicateModule)
    assert mixed.head.weight.placements == (Shard(0),)
    # HYBRID_SHARD blocks under a FULL_SHARD root: the blocks on a (nodes, per node) mesh
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        hybrid = shard_model(
            build(MODEL),
            auto_wrap_policy=CustomPolicy(
                lambda m: (
                    isinstance(m, MLPBlock) and {"sharding_strategy": ShardingStrategy.HYBRID_SHARD}
                )
            ),
        )
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    assert hybrid.layers[0].lin.weight.placements == (Replicate(), Shard(0))
    assert hybrid.head.weight.placements == (Shard(0),)
    x, y = make_batch(MODEL, 0)
    local_loss(hybrid, MODEL, x, y).backward()  # trains across the two kinds of mesh


def test_bad_policy_overrides() -> None:
    """CustomPolicy overrides we cannot apply raise; torch's config objects are accepted."""
    run_on_ranks(2, _bad_policies)


# ---------------------------------------------------------------------------------------------
# Prefetch: forward order recorded from execution, backward_prefetch=None


class _Shuffled(nn.Module):
    """Runs its blocks in the order 2, 0, 1: execution order differs from definition order."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in (2, 0, 1):
            x = self.layers[i](x)
        return self.head(x)


def _unit_names(model: nn.Module) -> dict[nn.Module, str]:
    return {m: n or "<root>" for n, m in model.named_modules() if isinstance(m, FSDPModule)}


def _as_list(units: tuple[nn.Module, ...] | None) -> list[nn.Module] | None:
    return None if units is None else list(units)


def _prefetch_orders() -> dict[str, object]:
    rank, ws = dist.get_rank(), dist.get_world_size()

    def make() -> nn.Module:
        torch.manual_seed(0)
        return _Shuffled()

    models: dict[str, nn.Module] = {
        "ref": make(),
        "fsdp2": shard_model(make(), auto_wrap_policy={MLPBlock}, forward_prefetch=True),
        "torch": FSDP1(
            make(),
            auto_wrap_policy=ModuleWrapPolicy({MLPBlock}),
            forward_prefetch=True,
            use_orig_params=True,
            device_id=torch.device("cpu"),
        ),
    }
    opts = {k: make_optimizer("adamw", m.parameters()) for k, m in models.items()}
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
        losses = {}
        for key, model in models.items():
            xs, ys = (x, y) if key == "ref" else (rank_slice(x, rank, ws), rank_slice(y, rank, ws))
            loss = nn.functional.mse_loss(model(xs), ys)
            loss.backward()
            losses[key] = loss.detach() if key == "ref" else mean_over_ranks(loss)
            opts[key].step()
            opts[key].zero_grad()
        for key in ("fsdp2", "torch"):
            _check_close(losses[key], losses["ref"], f"{key} loss")
    ours = models["fsdp2"]
    names = _unit_names(ours)
    settings = unit_settings(ours)
    chain, unit = [], ours
    while unit is not None:  # the implicit forward prefetch: each unit's next
        assert settings[unit].forward_prefetch is None, "no explicit forward prefetch list"
        chain.append(names[unit])
        nxt = settings[unit].implicit_forward_prefetch
        unit = nxt[0] if nxt else None
    torch_names = {
        id(m._handle): n.replace("_fsdp_wrapped_module.", "") or "<root>"
        for n, m in models["torch"].named_modules()
        if isinstance(m, FSDP1) and m._handle is not None
    }
    recorded = [
        torch_names[id(h)] for h in models["torch"]._exec_order_data.handles_pre_forward_order
    ]
    bwd = {}
    for prefetch in (None, "BACKWARD_PRE", "BACKWARD_POST"):
        model = shard_model(
            make(),
            auto_wrap_policy={MLPBlock},
            backward_prefetch=None if prefetch is None else BackwardPrefetch[prefetch],
        )
        settings = unit_settings(model)
        bwd[str(prefetch)] = {
            n or "<root>": _as_list(settings[m].backward_prefetch)
            for n, m in model.named_modules()
            if isinstance(m, FSDPModule)
        }
    return {"chain": chain, "recorded": recorded, "bwd": bwd}


def test_forward_prefetch_follows_execution_order() -> None:
    """A model running its blocks 2, 0, 1: with ``forward_prefetch=True`` fsdp2's implicit
    forward prefetch chain after the first steps is the execution order, the order torch's
    FSDP1 records (``handles_pre_forward_order``); losses equal a replicated reference and
    FSDP1 (1e-5). ``backward_prefetch=None`` sets empty backward prefetch lists (none), the
    other two values leave fsdp2's implicit backward prefetch."""
    out = run_on_ranks(2, _prefetch_orders)[0]
    want = ["<root>", "layers.2", "layers.0", "layers.1"]
    assert out["recorded"] == want, out["recorded"]
    assert out["chain"] == want, out["chain"]
    assert all(v == [] for v in out["bwd"]["None"].values()), out["bwd"]
    for key in ("BACKWARD_PRE", "BACKWARD_POST"):
        assert all(v is None for v in out["bwd"][key].values()), out["bwd"]


# ---------------------------------------------------------------------------------------------
# keep_low_precision_grads


def _low_precision_grads() -> dict[str, object]:
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

    rank, ws = dist.get_rank(), dist.get_world_size()
    kw = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    low = shard_model(
        build(MODEL),
        auto_wrap_policy={MLPBlock},
        mixed_precision=MixedPrecision(**kw, keep_low_precision_grads=True),
    )
    full = shard_model(
        build(MODEL), auto_wrap_policy={MLPBlock}, mixed_precision=MixedPrecision(**kw)
    )
    ref = FSDP1(
        build(MODEL),
        auto_wrap_policy=ModuleWrapPolicy({MLPBlock}),
        mixed_precision=TorchMixedPrecision(**kw, keep_low_precision_grads=True),
        use_orig_params=True,
        device_id=torch.device("cpu"),
    )

    def backward(model: nn.Module, step: int) -> None:
        x, y = make_batch(MODEL, step)
        xs, ys = rank_slice(x, rank, ws), rank_slice(y, rank, ws)
        local_loss(model, MODEL, xs, ys).float().backward()

    def round_grads(model: nn.Module) -> None:  # what FSDP1 keeps between two backwards
        for p in model.parameters():
            p.grad = p.grad.to(torch.bfloat16).float()

    def check(what: str) -> None:
        for (name, p), q in zip(low.named_parameters(), full.parameters(), strict=True):
            assert p.dtype == torch.float32 and p.grad.dtype == torch.bfloat16, (name, p.grad)
            want = q.grad.full_tensor().to(torch.bfloat16)
            torch.testing.assert_close(p.grad.full_tensor(), want, rtol=0, atol=0, msg=what)

    for model in (low, full, ref):  # two backwards accumulate (in fp32, from rounded grads)
        backward(model, 0)
    round_grads(full)
    for model in (low, full, ref):
        backward(model, 1)
    check("accumulated")
    low.zero_grad()
    full.zero_grad()
    backward(low, 2)
    backward(full, 2)
    check("after zero_grad")
    torch.optim.SGD(low.parameters(), lr=0.1).step()  # fp32 params, bf16 grads
    return {
        "torch": sorted({str(p.grad.dtype) for p in ref.parameters() if p.grad is not None}),
        "ours": sorted({str(p.grad.dtype) for p in low.parameters()}),
    }


def test_keep_low_precision_grads() -> None:
    """``keep_low_precision_grads=True``: after backward the sharded fp32 parameters hold bf16
    gradients, as in torch's FSDP1; values equal the full-precision run's cast to bf16, with
    two accumulating backwards rounding in between as FSDP1 does (cast back to fp32 before
    the second backward accumulates). FSDP1's ``summon_full_params(with_grads=True)`` fails on
    such gradients in torch 2.13, so only FSDP1's dtypes are compared."""
    out = run_on_ranks(2, _low_precision_grads)[0]
    assert out == {"torch": ["torch.bfloat16"], "ours": ["torch.bfloat16"]}, out


def _batchnorm_parity(with_policy: bool) -> list[float]:
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
    from torch.distributed.fsdp import StateDictType as TorchStateDictType

    from fsdp2.fsdp1 import StateDictType, get_state_dict

    rank, ws = dist.get_rank(), dist.get_world_size()
    kw = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    kw["buffer_dtype"] = torch.bfloat16

    def make() -> nn.Module:
        torch.manual_seed(0)
        return _BNNet()

    models = {
        "torch": FSDP1(
            make(),
            auto_wrap_policy=ModuleWrapPolicy({_ScaledBlock}) if with_policy else None,
            mixed_precision=TorchMixedPrecision(**kw),
            use_orig_params=True,
            device_id=torch.device("cpu"),
        ),
        "fsdp2": shard_model(
            make(),
            auto_wrap_policy={_ScaledBlock} if with_policy else None,
            mixed_precision=MixedPrecision(**kw),
        ),
    }
    opts = {k: make_optimizer("adamw", m.parameters()) for k, m in models.items()}
    out = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        losses = {}
        for key, model in models.items():
            out_ = model(rank_slice(x, rank, ws))
            loss = nn.functional.mse_loss(out_.float(), rank_slice(y, rank, ws))
            loss.backward()
            opts[key].step()
            opts[key].zero_grad()
            losses[key] = mean_over_ranks(loss)
        _check_close(losses["fsdp2"], losses["torch"], f"loss step {step}")
        out.append(float(losses["fsdp2"]))
    with FSDP1.state_dict_type(models["torch"], TorchStateDictType.FULL_STATE_DICT):
        want = models["torch"].state_dict()
    got = get_state_dict(models["fsdp2"], StateDictType.FULL_STATE_DICT)
    assert got.keys() == want.keys(), (got.keys(), want.keys())
    for k in got:
        _check_close(got[k].float(), want[k].float(), k)
    norm_dtype = str(models["fsdp2"].norm.weight.dtype)
    assert isinstance(models["fsdp2"].norm, FSDPModule) == with_policy
    return [*out, norm_dtype]


@pytest.mark.parametrize("with_policy", [True, False])
def test_batchnorm_mixed_precision_parity(with_policy: bool) -> None:
    """``MixedPrecision(bf16, fp32, buffer_dtype=bf16)`` with the default
    ``cast_forward_inputs=False`` on a model running a BatchNorm first: with a policy, FSDP1
    wraps the BatchNorm alone in full precision and casts its output back to bf16 for the
    blocks; without one it runs in bf16 in the root. Losses and the final FULL state dict
    (parameters and running statistics) equal torch's FSDP1 (1e-5)."""
    out = run_on_ranks(2, _batchnorm_parity, with_policy)[0]
    assert all(isinstance(v, float) for v in out[:-1]), out


def test_size_based_policy_called_alone() -> None:
    """``policy(module)`` (no ``nonwrapped_numel``) counts the subtree's parameter elements
    not in a unit below it, a shared parameter once, as ``size_based_policy`` documents."""
    policy = size_based_policy(100)
    assert policy(nn.Linear(10, 10))  # 110 elements
    assert not policy(nn.Linear(5, 5))  # 30
    shared = nn.Linear(10, 10)
    assert not size_based_policy(200)(nn.Sequential(shared, shared))  # 110, counted once
    assert size_based_policy(200)(nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10)))
    assert not policy(nn.ModuleList([nn.Linear(10, 10)]))  # never a container
    attention = nn.MultiheadAttention(16, 2)
    assert policy(attention) and not policy(attention, recurse=True)  # never descended into
