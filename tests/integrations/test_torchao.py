"""torchao's training subclasses under ``fsdp2.fully_shard``: parity with torch's FSDP2.

torchao (a test extra, pinned in pyproject.toml) converts ``nn.Linear`` weights into tensor
subclasses that implement torch's FSDP2 all-gather extension hooks (see [Note: all-gather
extensions] in fsdp2/_core/params/extension.py). Each case builds the same model twice in one
worker, converts it with torchao, shards it with ``fsdp2.fully_shard`` and with torch's, trains
both on the same data with AdamW and checks, every step, that the rank-averaged losses are
bitwise equal (and close to an unsharded reference trained on the global batch, where one
exists), and at the end that the full parameters are bitwise equal. Cases:

* float8 training with dynamic scaling, with and without ``enable_fsdp_float8_all_gather``,
  with ``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step, with
  ``MixedPrecisionPolicy(param_dtype=bf16)``, on an MLP and on fsdp2's Llama;
* int8 mixed-precision training (``int8_mixed_precision_training()``);
* NF4 frozen base weights (QLoRA style: the old one-argument ``fsdp_pre_all_gather``, three
  all-gather inputs of different dtypes per weight) with trainable LoRA adapters;
* what moves: float8 all-gather inputs are a quarter of fp32's bytes;
* meta-device init + ``to_empty``, and DCP save / load of float8 weights (the sharded
  parameters' local tensors stay torchao subclasses).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _harness import run_on_ranks
from comm_counter import spy_all_gathers
from helpers import check_close_run, check_same_run, mine, world_mesh
from models import mean_over_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp2

pytest.importorskip("torchao", reason="torchao is a test extra: pip install -e '.[test]'")

ENGINES = ("fsdp2", "torch")
STEPS = 4


def _quiet_import_torchao() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchao  # noqa: F401  (prints loader warnings for CUDA-only kernels)


def _fully_shard(engine: str):
    return fsdp2.fully_shard if engine == "fsdp2" else torch_fully_shard


def _mp(engine: str, param_dtype: torch.dtype | None):
    cls = fsdp2.MixedPrecisionPolicy if engine == "fsdp2" else TorchMP
    return cls(param_dtype=param_dtype)


def plain(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` as a plain tensor (a DTensor's local shard for DTensors; the first
    inner tensor of a wrapper subclass)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    while type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        t = getattr(t, names[0])
    return t.detach().clone()


class MLP(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (32, 64, 48, 32), bias: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(a, b, bias=bias) for a, b in zip(dims[:-1], dims[1:], strict=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


def _batch(step: int, dims=(32, 32), n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, dims[0], generator=g), torch.randn(n, dims[1], generator=g)


def _shard(model: nn.Module, engine: str, mesh, **kw) -> nn.Module:
    fs = _fully_shard(engine)
    for layer in model.layers:
        fs(layer, mesh=mesh, **kw)
    fs(model, mesh=mesh, **kw)
    return model


def _train(model: nn.Module, opt, loss_of, steps, *, precompute: bool = False) -> list:
    """For each step index in ``steps``: ``loss_of(step)``, backward, optimizer step (then
    float8 scales, with ``precompute``). Returns the rank-averaged losses."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    losses = []
    for step in steps:
        loss = loss_of(step)
        loss.backward()
        losses.append(mean_over_ranks(loss))
        opt.step()
        opt.zero_grad()
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
    return losses


def _mse(model: nn.Module, dims=(32, 32), n: int = 16):
    """``step -> loss`` on this rank's slice of step ``step``'s global batch."""

    def loss_of(step: int) -> torch.Tensor:
        x, y = _batch(step, dims, n)
        return F.mse_loss(model(mine(x)), mine(y))

    return loss_of


def _compare_engines(run, reference=None, *, tol: float = 1e-4) -> None:
    """``run(engine)`` trains one sharded copy and returns ``(losses, local params)``; both
    engines must agree bitwise, and ``reference`` (a list of losses) within ``tol``."""
    results = {}
    for engine in ENGINES:
        losses, params = run(engine)
        results[engine] = {"losses": losses, "params": params}
    check_same_run(results["fsdp2"], results["torch"])
    if reference is not None:
        check_close_run(
            results["fsdp2"],
            {"losses": reference},
            "fsdp2 vs reference",
            tol={"atol": tol, "rtol": tol},
        )


# ---- float8 --------------------------------------------------------------------------------


def _float8(model: nn.Module, all_gather: bool) -> nn.Module:
    _quiet_import_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather)
    return convert_to_float8_training(
        model, config=config, module_filter_fn=lambda m, fqn: fqn != "output"
    )


def _float8_mlp_case(all_gather: bool, precompute: bool, bf16: bool) -> None:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    mesh = world_mesh()
    param_dtype = torch.bfloat16 if bf16 else None

    def train(model: nn.Module, sharded: bool) -> tuple[list[torch.Tensor], dict]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(STEPS):
            x, y = _batch(step)
            if sharded:
                x, y = mine(x), mine(y)
            loss = F.mse_loss(model(x).float(), y)
            loss.backward()
            if not sharded:  # the reference saw the global batch: nothing to average
                losses.append(loss.detach())
            else:
                losses.append(mean_over_ranks(loss))
            opt.step()
            opt.zero_grad()
            if precompute:
                precompute_float8_dynamic_scale_for_fsdp(model)
        return losses, {n: plain(p) for n, p in model.named_parameters()}

    def run(engine: str):
        torch.manual_seed(0)
        model = _shard(_float8(MLP(), all_gather), engine, mesh, mp_policy=_mp(engine, param_dtype))
        if all_gather:
            w = model.layers[0].weight
            assert isinstance(w, DTensor), engine
            assert isinstance(w._local_tensor, WeightWithDynamicFloat8CastTensor), engine
        return train(model, sharded=True)

    # The reference sees the global batch, so float8's per-tensor activation scales (amax over
    # the batch) differ from each rank's: it agrees to float8 rounding, not bitwise.
    reference = None
    if not bf16:
        torch.manual_seed(0)
        reference, _ = train(_float8(MLP(), all_gather), sharded=False)
    _compare_engines(run, reference, tol=5e-3)


@pytest.mark.parametrize(
    "all_gather, precompute, bf16",
    [
        pytest.param(False, False, False, id="float8-compute-only"),
        pytest.param(True, False, False, id="float8-all-gather"),
        pytest.param(True, True, False, id="float8-all-gather-precompute"),
        pytest.param(True, True, True, id="float8-all-gather-precompute-bf16"),
    ],
)
def test_float8_mlp_parity(all_gather: bool, precompute: bool, bf16: bool) -> None:
    run_on_ranks(2, _float8_mlp_case, all_gather, precompute, bf16)


def _float8_llama_case() -> None:

    from fsdp2.models.llama import Llama, LlamaConfig

    mesh = world_mesh()
    cfg = LlamaConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, max_seq_len=32)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (4, 17), generator=g)

    def run(engine: str):
        torch.manual_seed(0)
        model = _float8(Llama(cfg), all_gather=True)
        _shard(model, engine, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = mine(tokens[:, :-1]), mine(tokens[:, 1:])

        def loss_of(step: int) -> torch.Tensor:
            logits = model(x)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

        losses = _train(model, opt, loss_of, range(3), precompute=True)
        return losses, {n: plain(p) for n, p in model.named_parameters()}

    _compare_engines(run)


def test_float8_llama_parity() -> None:
    run_on_ranks(2, _float8_llama_case)


def _float8_bytes_case() -> None:
    mesh = world_mesh()
    sizes: dict[bool, list[int]] = {}
    for all_gather in (False, True):
        torch.manual_seed(0)
        model = _shard(_float8(MLP((64, 64, 64), bias=False), all_gather), "fsdp2", mesh)
        seen: list[int] = []

        def counted(input: torch.Tensor, group: Any, _seen: list[int] = seen) -> None:
            _seen.append(input.numel() * input.element_size())

        x, _ = _batch(0, (64, 64))
        with spy_all_gathers(counted):
            model(mine(x)).sum().backward()
        sizes[all_gather] = seen
    # 2 layer groups (the root has no parameters), resharded after forward: two all-gathers
    # in forward, two in backward.
    assert len(sizes[True]) == len(sizes[False]) == 4, sizes
    for fp8, fp32 in zip(sizes[True], sizes[False], strict=True):
        assert fp8 * 4 == fp32, f"float8 all-gather moved {fp8} bytes, fp32 {fp32}"


def test_float8_all_gather_moves_a_quarter_of_the_bytes() -> None:
    run_on_ranks(2, _float8_bytes_case)


def _float8_meta_dcp_case(tmpdir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    mesh = world_mesh()

    def build(engine: str) -> nn.Module:
        with torch.device("meta"):
            model = _float8(MLP(), all_gather=True)
        _shard(model, engine, mesh)
        model.to_empty(device="cpu")
        torch.manual_seed(3)
        for p in model.parameters():
            nn.init.trunc_normal_(p, std=0.1)
        return model

    def steps(model, opt, first: int, n: int) -> list[torch.Tensor]:
        return _train(model, opt, _mse(model), range(first, first + n), precompute=True)

    def run(engine: str):
        model = build(engine)
        for name, p in model.named_parameters():
            if name.endswith("weight"):
                assert isinstance(p._local_tensor, WeightWithDynamicFloat8CastTensor), (
                    engine,
                    name,
                )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = steps(model, opt, 0, 2)
        path = f"{tmpdir}/{engine}"
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
        uninterrupted = steps(model, opt, 2, 2)
        # A fresh model loads the checkpoint and repeats the last two steps exactly.
        model2 = build(engine)
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
        steps(model2, opt2, 10, 1)  # creates optimizer state to load into
        state = {"model": model2.state_dict(), "optim": opt2.state_dict()}
        for name, v in state["model"].items():
            if name.endswith("weight"):
                assert isinstance(v._local_tensor, WeightWithDynamicFloat8CastTensor), (
                    engine,
                    name,
                )
        dcp.load(state, checkpoint_id=path)
        model2.load_state_dict(state["model"])
        opt2.load_state_dict(state["optim"])
        precompute_float8_dynamic_scale_for_fsdp(model2)
        resumed = steps(model2, opt2, 2, 2)
        for a, b in zip(uninterrupted, resumed, strict=True):
            assert torch.equal(a, b), f"{engine}: resumed loss {b.item()} != {a.item()}"
        return losses + uninterrupted, {n: plain(p) for n, p in model2.named_parameters()}

    _compare_engines(run)


def test_float8_meta_init_and_dcp_round_trip(tmp_path) -> None:
    run_on_ranks(2, _float8_meta_dcp_case, str(tmp_path))


# ---- int8 mixed precision ------------------------------------------------------------------


def _int8_case(reshard_after_forward: bool) -> None:
    _quiet_import_torchao()
    from torchao.prototype.quantized_training import int8_mixed_precision_training
    from torchao.quantization import quantize_

    mesh = world_mesh()

    def run(engine: str):
        torch.manual_seed(0)
        model = MLP()
        quantize_(model, int8_mixed_precision_training())
        _shard(model, engine, mesh, reshard_after_forward=reshard_after_forward)
        assert type(model.layers[0].weight._local_tensor).__name__ == (
            "Int8MixedPrecisionTrainingLinearWeight"
        ), engine
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = _train(model, opt, _mse(model), range(STEPS))
        return losses, {n: plain(p) for n, p in model.named_parameters()}

    _compare_engines(run)


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["raf", "no-raf"])
def test_int8_mixed_precision_parity(reshard_after_forward: bool) -> None:
    run_on_ranks(2, _int8_case, reshard_after_forward)


# ---- NF4 (frozen base + LoRA) --------------------------------------------------------------


class _LoRALinear(nn.Module):
    """A frozen NF4 base weight plus trainable low-rank adapters."""

    def __init__(self, dim: int, rank: int = 4) -> None:
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        base = torch.randn(dim, dim) / dim**0.5
        self.weight = nn.Parameter(to_nf4(base), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(dim, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + x @ self.lora_a.t() @ self.lora_b.t()


class _QLoRA(nn.Module):
    def __init__(self, dim: int = 256, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_LoRALinear(dim) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _nf4_case() -> None:
    _quiet_import_torchao()
    mesh = world_mesh()

    def run(engine: str):
        torch.manual_seed(0)
        model = _shard(_QLoRA(), engine, mesh)
        assert type(model.layers[0].weight._local_tensor).__name__ == "NF4Tensor", engine
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = _train(model, opt, _mse(model, (256, 256), n=8), range(3))
        params = {n: plain(p) for n, p in model.named_parameters() if p.requires_grad}
        return losses, params

    _compare_engines(run)


def test_nf4_qlora_parity() -> None:
    run_on_ranks(2, _nf4_case)


# ---- state dicts of subclass parameters -----------------------------------------------------


def _float8_state_dict_case() -> None:
    import io

    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from fsdp2.fsdp1 import summon_full_params

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = world_mesh()

    def sharded(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return _shard(_float8(MLP(), all_gather=True), "fsdp2", mesh)

    def check_locals(model: nn.Module, want: dict[str, torch.Tensor], what: str) -> None:
        for name, p in model.named_parameters():
            if name.endswith("weight"):
                assert isinstance(p._local_tensor, WeightWithDynamicFloat8CastTensor), what
            chunk = torch.chunk(plain(want[name]), world)[rank]
            assert torch.equal(plain(p), chunk), f"{what}: {name}"

    torch.manual_seed(1)
    full = {n: p.detach().clone() for n, p in MLP().named_parameters()}
    x, y = _batch(0)

    # 1. torch.save of the sharded state dict keeps the subclass and the values.
    model = sharded(1)
    check_locals(model, full, "init")
    sd = model.state_dict()
    assert isinstance(sd["layers.0.weight"]._local_tensor, WeightWithDynamicFloat8CastTensor)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for name, v in loaded.items():
        assert torch.equal(plain(v), plain(sd[name])), name

    # 2. load_state_dict of full tensors, plain (an unconverted checkpoint) and float8 ones:
    # values are copied into the subclass shards.
    for source in ("plain", "float8"):
        target = sharded(2)
        state = full
        if source == "float8":
            unsharded = _float8(MLP(), all_gather=True)
            unsharded.load_state_dict(full)
            state = unsharded.state_dict()
            assert isinstance(state["layers.0.weight"], WeightWithDynamicFloat8CastTensor)
        target.load_state_dict(state)
        check_locals(target, full, f"load {source}")
        F.mse_loss(target(mine(x)), mine(y)).backward()

    # 3. assign=True keeps the subclass when the values have it, and refuses to drop it.
    target = sharded(3)
    target.load_state_dict(model.state_dict(), assign=True)
    check_locals(target, full, "assign")
    F.mse_loss(target(mine(x)), mine(y)).backward()
    bad = {
        n: DTensor.from_local(plain(v), v.device_mesh, v.placements, run_check=False)
        for n, v in sharded(4).state_dict().items()
    }
    with pytest.raises(ValueError, match="drop the tensor subclass"):
        sharded(4).load_state_dict(bad, assign=True)

    # 4. summon_full_params (fsdp2.fsdp1) gives the full values and writes back.
    with summon_full_params(model, writeback=True):
        for name, p in model.named_parameters():
            assert torch.equal(plain(p), plain(full[name])), name
            with torch.no_grad():
                p.add_(1.0)
    for name, p in model.named_parameters():
        assert torch.equal(plain(p), torch.chunk(plain(full[name]) + 1.0, world)[rank]), name


def test_float8_state_dicts() -> None:
    run_on_ranks(2, _float8_state_dict_case)


# ---- float8 with tensor parallel -------------------------------------------------------------


class _TPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(32, 64, bias=False)
        self.w2 = nn.Linear(64, 32, bias=False)
        # A plain fp32 parameter in the group: torch's FSDP2 all-gathers a group of float8
        # inputs alone in float8, which gloo rejects ("Invalid scalar type"); fsdp2 moves bytes.
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.w2(F.relu(self.w1(x))))


class _TPStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_TPBlock(), _TPBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _float8_tp_case() -> None:
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank(0)

    def run(engine: str):
        torch.manual_seed(0)
        model = _float8(_TPStack(), all_gather=True)
        plan = {"w1": Float8ColwiseParallel(), "w2": Float8RowwiseParallel()}
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], plan)
        _shard(model, engine, mesh["dp"])
        assert type(model.layers[0].w1.weight._local_tensor).__name__ == (
            "WeightWithDynamicFloat8CastTensor"
        ), engine
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def loss_of(step: int) -> torch.Tensor:  # data parallel over "dp" only
            x, y = _batch(step)
            return F.mse_loss(model(x[dp * 8 : dp * 8 + 8]), y[dp * 8 : dp * 8 + 8])

        losses = _train(model, opt, loss_of, range(3), precompute=True)
        return losses, {n: plain(p) for n, p in model.named_parameters()}

    _compare_engines(run)


def test_float8_tensor_parallel_parity() -> None:
    run_on_ranks(4, _float8_tp_case)
