"""FSDP1 state APIs of the migration layer (``fsdp2.fsdp1``): ``summon_full_params`` and
``get_state_dict`` / ``load_state_dict`` with ``StateDictType``.

* ``summon_full_params``: after one training step of an MLP (``shard_model`` with a
  ``{MLPBlock}`` policy) the parameters inside the context are plain tensors equal to an
  unsharded reference's, and with ``with_grads`` their ``.grad`` equals the reference's; edits
  land in the shards with ``writeback`` (and not without); ``recurse=False`` only touches the
  given unit; ``rank0_only`` leaves the other ranks sharded and refuses ``writeback``;
  ``offload_to_cpu`` gives CPU tensors; afterwards the parameters are DTensors again and
  training keeps matching the reference.
* State dicts: FULL (``rank0_only`` and ``offload_to_cpu`` on and off) equals the reference's
  ``state_dict()``; FULL, SHARDED and LOCAL round-trip (save, perturb, load, equal).
* Interop: a FULL state dict saved by torch's FSDP1 loads into an fsdp2 model and both give the
  same outputs; FSDP1 wrapper prefixes are stripped on load.
* ``SHARD_GRAD_OP`` and ``NO_SHARD``: full values, grads, writeback and a FULL round trip.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks
from helpers import TOL, WORLD_SIZES
from models import MLPBlock, build, full_params, local_loss, make_batch, rank_slice
from torch.distributed.fsdp import FullStateDictConfig as TorchFullStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.fsdp import StateDictType as TorchStateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

from fsdp2.fsdp1 import (
    FullStateDictConfig,
    LocalStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
    get_state_dict,
    load_state_dict,
    shard_model,
    strip_fsdp1_prefixes,
    summon_full_params,
)

MODEL = "mlp_head"  # blocks 7->5->3->1 and a root head 1->2


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """An unsharded reference and an fsdp2 copy, after one SGD step each (so grads exist)."""
    ref = build(MODEL)
    ours = shard_model(build(MODEL), auto_wrap_policy={MLPBlock})
    _step(ref, ours, 0)
    return ref, ours


def _step(ref: torch.nn.Module, ours: torch.nn.Module, step: int) -> None:
    """Zero grads, backward on both models, SGD update; the grads stay for inspection."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    x, y = make_batch(MODEL, step)
    for model, (xs, ys) in (
        (ref, (x, y)),
        (ours, (rank_slice(x, rank, ws), rank_slice(y, rank, ws))),
    ):
        model.zero_grad(set_to_none=True)
        local_loss(model, MODEL, xs, ys).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)


def _check_full_params(ours: torch.nn.Module, want: dict[str, torch.Tensor], what: str) -> None:
    got = full_params(ours)
    assert got.keys() == want.keys(), (got.keys(), want.keys())
    for name in want:
        _close(got[name], want[name], f"{what} {name}")


def _summon_values(offload: bool) -> None:
    ref, ours = _pair()
    ref_params = dict(ref.named_parameters())
    with summon_full_params(ours, with_grads=True, offload_to_cpu=offload):
        for name, p in ours.named_parameters():
            assert not isinstance(p, DTensor), f"{name} is still a DTensor"
            assert p.device.type == "cpu"
            _close(p, ref_params[name], f"full {name}")
            assert p.grad is not None, name
            _close(p.grad, ref_params[name].grad, f"full grad {name}")
    for name, p in ours.named_parameters():
        assert isinstance(p, DTensor), f"{name} is not a DTensor after the context"
    # training goes on and still matches the reference
    for step in (1, 2):
        _step(ref, ours, step)
        _check_full_params(ours, {n: p.detach() for n, p in ref.named_parameters()}, f"step {step}")


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_summon_values_and_grads(world_size: int, offload: bool) -> None:
    run_on_ranks(world_size, _summon_values, offload)


def _summon_writeback(writeback: bool) -> None:
    ref, ours = _pair()
    before = full_params(ours)
    with summon_full_params(ours, writeback=writeback):
        with torch.no_grad():
            for p in ours.parameters():
                p.add_(1.0)
    want = {n: t + 1.0 for n, t in before.items()} if writeback else before
    _check_full_params(ours, want, f"writeback={writeback}")
    # the shards really changed: a forward sees the edits
    x, _ = make_batch(MODEL, 5)
    if writeback:
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(1.0)
    _close(ours(x), ref(x), "forward after the context")


@pytest.mark.parametrize("writeback", [True, False])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_summon_writeback(world_size: int, writeback: bool) -> None:
    run_on_ranks(world_size, _summon_writeback, writeback)


def _summon_not_recursive() -> None:
    ref, ours = _pair()
    unit = ours.layers[0]
    with summon_full_params(unit, recurse=False):
        for name, p in ours.named_parameters():
            full = name.startswith("layers.0.")
            assert isinstance(p, DTensor) != full, f"{name}: DTensor={isinstance(p, DTensor)}"
        _close(unit.lin.weight, ref.layers[0].lin.weight, "layers.0.lin.weight")
    # recurse=True on a unit reaches only the groups under it
    with summon_full_params(ours.layers[1]):
        assert not isinstance(ours.layers[1].lin.weight, DTensor)
        assert isinstance(ours.head.weight, DTensor)
    assert all(isinstance(p, DTensor) for p in ours.parameters())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_summon_not_recursive(world_size: int) -> None:
    run_on_ranks(world_size, _summon_not_recursive)


def _summon_rank0_only() -> None:
    ref, ours = _pair()
    with pytest.raises(ValueError, match="rank0_only"):
        with summon_full_params(ours, rank0_only=True):
            pass
    with summon_full_params(ours, rank0_only=True, writeback=False):
        for name, p in ours.named_parameters():
            if dist.get_rank() == 0:
                _close(p, dict(ref.named_parameters())[name], f"rank 0 {name}")
            else:
                assert isinstance(p, DTensor), f"rank {dist.get_rank()}: {name} was unsharded"
    assert all(isinstance(p, DTensor) for p in ours.parameters())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_summon_rank0_only(world_size: int) -> None:
    run_on_ranks(world_size, _summon_rank0_only)


def _perturb(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-2.0).add_(0.5)


def _clone(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sd.items()}


def _full_state_dict(rank0_only: bool, offload: bool) -> None:
    ref, ours = _pair()
    config = FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only)
    sd = _clone(get_state_dict(ours, StateDictType.FULL_STATE_DICT, config))
    want = ref.state_dict()
    if rank0_only and dist.get_rank() != 0:
        assert sd == {}, sorted(sd)
    else:
        assert sd.keys() == want.keys(), (sd.keys(), want.keys())
        for k in want:
            assert not isinstance(sd[k], DTensor) and sd[k].device.type == "cpu", k
            _close(sd[k], want[k], f"FULL {k}")
    _perturb(ours)
    load_state_dict(ours, sd, StateDictType.FULL_STATE_DICT, config)
    _check_full_params(ours, dict(want), "FULL round trip")


@pytest.mark.parametrize(
    ("rank0_only", "offload"), [(False, False), (True, False), (True, True), (False, True)]
)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_full_state_dict(world_size: int, rank0_only: bool, offload: bool) -> None:
    run_on_ranks(world_size, _full_state_dict, rank0_only, offload)


def _round_trip(kind: str) -> None:
    ref, ours = _pair()
    state_dict_type = StateDictType[kind]
    config = {
        "SHARDED_STATE_DICT": ShardedStateDictConfig(),
        "LOCAL_STATE_DICT": LocalStateDictConfig(),
    }[kind]
    sd = get_state_dict(ours, state_dict_type, config)
    for k, v in sd.items():
        is_dtensor = isinstance(v, DTensor)
        assert is_dtensor == (kind == "SHARDED_STATE_DICT"), f"{kind} {k}: {type(v).__name__}"
    if kind == "LOCAL_STATE_DICT":
        for k, p in ours.named_parameters():
            assert sd[k].shape == p.to_local().shape, k
    sd = _clone(sd)
    want = full_params(ours)
    _perturb(ours)
    load_state_dict(ours, sd, state_dict_type, config)
    _check_full_params(ours, want, f"{kind} round trip")
    _close(full_params(ours)["head.weight"], ref.head.weight.detach(), "vs reference")


@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "LOCAL_STATE_DICT"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_round_trip(world_size: int, kind: str) -> None:
    run_on_ranks(world_size, _round_trip, kind)


def _from_torch_fsdp1() -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch_model = FSDP1(
        build(MODEL),
        auto_wrap_policy=ModuleWrapPolicy({MLPBlock}),
        use_orig_params=True,
        device_id=torch.device("cpu"),
    )
    x, y = make_batch(MODEL, 0)
    xs, ys = rank_slice(x, rank, ws), rank_slice(y, rank, ws)
    local_loss(torch_model, MODEL, xs, ys).backward()
    # an optimizer step (FSDP1 leaves .grad None on ranks whose shard is empty) moves the
    # parameters away from build(MODEL)'s initialization
    torch.optim.SGD(torch_model.parameters(), lr=0.1).step()
    with FSDP1.state_dict_type(
        torch_model, TorchStateDictType.FULL_STATE_DICT, TorchFullStateDictConfig(rank0_only=False)
    ):
        sd = _clone(torch_model.state_dict())
    ours = shard_model(build(MODEL, seed=1), auto_wrap_policy={MLPBlock})
    assert set(strip_fsdp1_prefixes(sd)) == set(ours.state_dict()), sorted(sd)
    load_state_dict(ours, sd, TorchStateDictType.FULL_STATE_DICT)
    x2, _ = make_batch(MODEL, 1)
    with torch.no_grad():
        _close(ours(x2), torch_model(x2), "outputs after loading FSDP1's state dict")
    # keys carrying FSDP1's wrapper prefixes load too
    _perturb(ours)
    prefixed = {
        k.replace("layers.0.", "layers.0._fsdp_wrapped_module._checkpoint_wrapped_module."): v
        for k, v in sd.items()
    }
    load_state_dict(ours, prefixed, StateDictType.FULL_STATE_DICT)
    with torch.no_grad():
        _close(ours(x2), torch_model(x2), "outputs after loading prefixed keys")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_load_torch_fsdp1_full_state_dict(world_size: int) -> None:
    run_on_ranks(world_size, _from_torch_fsdp1)


def test_strip_fsdp1_prefixes() -> None:
    sd = {"_fsdp_wrapped_module.a._checkpoint_wrapped_module.w": 1, "b": 2}
    assert strip_fsdp1_prefixes(sd) == {"a.w": 1, "b": 2}


def _other_strategies(strategy: str) -> None:
    ref = build(MODEL)
    ours = shard_model(
        build(MODEL), auto_wrap_policy={MLPBlock}, sharding_strategy=ShardingStrategy[strategy]
    )
    _step(ref, ours, 0)
    with summon_full_params(ours, with_grads=True):
        for name, p in ours.named_parameters():
            _close(p, dict(ref.named_parameters())[name], f"{strategy} full {name}")
            _close(p.grad, dict(ref.named_parameters())[name].grad, f"{strategy} grad {name}")
            with torch.no_grad():
                p.mul_(2.0)
    want = {n: 2.0 * p.detach() for n, p in ref.named_parameters()}
    _check_full_params(ours, want, f"{strategy} writeback")
    sd = _clone(get_state_dict(ours, StateDictType.FULL_STATE_DICT))
    _perturb(ours)
    load_state_dict(ours, sd, StateDictType.FULL_STATE_DICT)
    _check_full_params(ours, want, f"{strategy} FULL round trip")


@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_other_strategies(world_size: int, strategy: str) -> None:
    run_on_ranks(world_size, _other_strategies, strategy)


def _summon_layouts(layout: str) -> None:
    """summon_full_params on HSDP (2x2), mixed precision and CPU offload models: full values
    in the parameters' own dtype (fp32, not the bf16 ``param_dtype``), writeback lands in
    every shard and replica, training goes on."""
    from fsdp2.fsdp1 import CPUOffload, MixedPrecision, ShardingStrategy

    kw: dict[str, object] = {}
    if layout == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        kw["sharding_strategy"] = ShardingStrategy.HYBRID_SHARD
        kw["device_mesh"] = init_device_mesh(
            "cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard")
        )
    elif layout == "bf16_offload":
        kw["mixed_precision"] = MixedPrecision(torch.bfloat16, torch.float32)
        kw["cpu_offload"] = CPUOffload(offload_params=True)
    ref = build(MODEL)
    ours = shard_model(build(MODEL), auto_wrap_policy={MLPBlock}, **kw)
    x, y = make_batch(MODEL, 0)
    rank, ws = dist.get_rank(), dist.get_world_size()
    local_loss(ours, MODEL, rank_slice(x, rank, ws), rank_slice(y, rank, ws)).backward()
    ref_params = {n: p.detach() for n, p in ref.named_parameters()}
    with summon_full_params(ours, with_grads=True):
        for name, p in ours.named_parameters():
            assert not isinstance(p, DTensor), f"{layout}: {name} is still a DTensor"
            assert p.dtype == torch.float32, f"{layout}: {name} gathered as {p.dtype}"
            _close(p, ref_params[name], f"{layout} full {name}")
            assert p.grad is not None and p.grad.shape == p.shape, name
        with torch.no_grad():
            for p in ours.parameters():
                p.mul_(2.0)
    _check_full_params(ours, {n: 2.0 * t for n, t in ref_params.items()}, f"{layout} writeback")
    for n, p in ours.named_parameters():  # every replica got the edit, not just one
        gathered: list[torch.Tensor | None] = [None] * ws  # shards differ in size: objects
        dist.all_gather_object(gathered, p.to_local().detach())
        if layout == "hybrid":  # ranks r and r + 2 hold the same shard
            _close(gathered[rank % 2], gathered[rank % 2 + 2], f"replicas of {n}")
    ours.zero_grad()
    local_loss(ours, MODEL, rank_slice(x, rank, ws), rank_slice(y, rank, ws)).backward()


@pytest.mark.parametrize("layout", ["hybrid", "bf16_offload"])
def test_summon_hsdp_mixed_precision_offload(layout: str) -> None:
    run_on_ranks(4, _summon_layouts, layout)
