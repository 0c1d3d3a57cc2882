"""CPU offloading (``CPUOffloadPolicy``): where the sharded state lives, and training parity.

* On a CPU mesh, ``CPUOffloadPolicy()`` and ``CPUOffloadPolicy(pin_memory=False)`` are
  accepted; sharded parameters and gradients are CPU tensors; training matches a replicated
  reference (fp32, within tolerance) and torch's FSDP2 under the same policy (bitwise, also
  with bf16 compute).
* A mix of offloaded and non-offloaded groups under one root: torch 2.13 trains it, so must
  we (and to the same floats).
* ``gpu``: the CUDA path on a 1-rank NCCL group: sharded parameters and gradients on the CPU
  (pinned when asked), training matches a reference, and between steps
  ``torch.cuda.memory_allocated()`` holds nothing of the model.

torch 2.13 pins CPU memory with ``Tensor.pin_memory()``, which raises on a machine without
an accelerator even for a CPU mesh; on such a machine torch runs with ``pin_memory=False``
(pinning changes where the bytes live, not their values). fsdp2 does not pin for a CPU mesh.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from devices import REPEATS, require_cuda
from helpers import check_close, check_same, world_mesh
from models import (
    build,
    full_grads,
    full_params,
    local_loss,
    make_batch,
    make_optimizer,
    mean_over_ranks,
    rank_slice,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp2

STEPS = 3
BF16, FP32 = torch.bfloat16, torch.float32

# Which groups offload: ``blocks`` every block (root not), ``root`` the root only, ``all``.
OFFLOADED = {
    "all": lambda path: True,
    "blocks": lambda path: path != "",
    "root": lambda path: path == "",
}


def _policies(engine: str, pin_memory: bool, mp: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``(offload policy, no-offload policy, mixed precision policy)`` for ``engine``."""
    if engine == "fsdp2":
        return (
            fsdp2.CPUOffloadPolicy(pin_memory=pin_memory),
            fsdp2.OffloadPolicy(),
            fsdp2.MixedPrecisionPolicy(**mp),
        )
    pin = pin_memory and torch.accelerator.is_available()  # see the module docstring
    return (
        TorchCPUOffloadPolicy(pin_memory=pin),
        TorchOffloadPolicy(),
        TorchMixedPrecisionPolicy(**mp),
    )


def _shard(
    model: nn.Module,
    engine: str,
    mesh: DeviceMesh,
    *,
    offloaded: str,
    pin_memory: bool,
    mp: dict[str, Any],
) -> nn.Module:
    fully_shard_fn = fsdp2.fully_shard if engine == "fsdp2" else torch_fully_shard
    offload, no_offload, mp_policy = _policies(engine, pin_memory, mp)
    paths = [f"layers.{i}" for i in range(len(model.layers))] + [""]
    for path in paths:
        policy = offload if OFFLOADED[offloaded](path) else no_offload
        fully_shard_fn(
            model.get_submodule(path), mesh=mesh, mp_policy=mp_policy, offload_policy=policy
        )
    return model


def _group_paths(model: nn.Module) -> dict[str, str]:
    """``param name -> path of the fully_shard'ed module owning it`` (blocks or root)."""
    owner = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        owner[name] = ".".join(parts[:2]) if parts[0] == "layers" else ""
    return owner


def _check_placement(model: nn.Module, offloaded: str, device: torch.device, pin: bool) -> None:
    """Sharded params (and grads, when present) of offloaded groups are CPU tensors (pinned
    when ``pin``); the others live on ``device``."""
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{name} is not a DTensor"
        path = _group_paths(model)[name]
        want = torch.device("cpu") if OFFLOADED[offloaded](path) else device
        tensors = {"param": p.to_local()}
        if p.grad is not None:
            tensors["grad"] = p.grad.to_local()
        for what, t in tensors.items():
            assert t.device.type == want.type, f"{what} {name}: on {t.device}, want {want}"
            if pin and want.type == "cpu" and t.numel():
                assert t.is_pinned(), f"{what} {name}: CPU offloaded but not pinned"


def _train_offloaded(model_name: str, offloaded: str, pin_memory: bool, mp: dict) -> None:
    """Reference (fp32 only), fsdp2 and torch with the same offload/mixed precision setup:
    same losses, grads and params every step (fsdp2 vs torch bitwise)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = world_mesh()
    ref = build(model_name) if not mp else None
    ref_opt = make_optimizer("adamw", ref.parameters()) if ref is not None else None
    engines = ("fsdp2", "torch")
    kw = {"offloaded": offloaded, "pin_memory": pin_memory, "mp": mp}
    models = {e: _shard(build(model_name), e, mesh, **kw) for e in engines}
    opts = {e: make_optimizer("adamw", m.parameters()) for e, m in models.items()}
    for model in models.values():
        _check_placement(model, offloaded, torch.device("cpu"), pin=False)
    for step in range(STEPS):
        x, y = make_batch(model_name, step)
        xs, ys = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
        seen: dict[str, dict[str, torch.Tensor]] = {}
        if ref is not None:
            ref_loss = local_loss(ref, model_name, x, y)
            ref_loss.backward()
        for engine, model in models.items():
            loss = local_loss(model, model_name, xs, ys)
            loss.backward()
            _check_placement(model, offloaded, torch.device("cpu"), pin=False)
            grads = full_grads(model)
            seen[engine] = {"loss": loss.detach(), **{f"grad {n}": g for n, g in grads.items()}}
            if ref is not None:
                what = f"{engine} step {step}"
                check_close(mean_over_ranks(loss), ref_loss.detach(), f"{what} loss")
                for name, p in ref.named_parameters():
                    check_close(grads[name], p.grad, f"{what} grad {name}")
        for opt in (*opts.values(), *((ref_opt,) if ref_opt is not None else ())):
            opt.step()
            opt.zero_grad()
        for engine, model in models.items():
            params = full_params(model)
            seen[engine].update({f"param {n}": p for n, p in params.items()})
            if ref is not None:
                for name, p in ref.named_parameters():
                    check_close(params[name], p.detach(), f"{engine} step {step} param {name}")
        # The same offload policy: the same floats.
        check_same(seen["fsdp2"], seen["torch"], f"step {step} fsdp2 vs torch", bitwise=True)


WORLD_SIZES = [pytest.param(2, id="ws2"), pytest.param(4, id="ws4")]
MP = {"fp32": {}, "bf16": {"param_dtype": BF16, "reduce_dtype": FP32}}


@pytest.mark.parametrize("mp", list(MP))
@pytest.mark.parametrize("pin_memory", [True, False], ids=["pin", "nopin"])
@pytest.mark.parametrize("model_name", ["mlp_head", "transformer"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_cpu_offload_on_cpu_mesh(
    world_size: int, model_name: str, pin_memory: bool, mp: str
) -> None:
    run_on_ranks(world_size, _train_offloaded, model_name, "all", pin_memory, MP[mp])


def _try_mixed(engine: str, offloaded: str, model_name: str) -> str:
    """Train one step with only some groups offloaded; ``"ok"`` or the error raised."""
    mesh = world_mesh()
    kw = {"offloaded": offloaded, "pin_memory": False, "mp": {}}
    try:
        model = _shard(build(model_name), engine, mesh, **kw)
        x, y = make_batch(model_name, 0)
        local_loss(model, model_name, x, y).backward()
    except Exception as e:  # noqa: BLE001 - the outcome is what we compare
        return f"{type(e).__name__}: {e}"
    return "ok"


@pytest.mark.parametrize("offloaded", ["blocks", "root"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_mixed_offloaded_and_not(world_size: int, offloaded: str) -> None:
    # torch 2.13 accepts a mix (the policy is per fully_shard call; on a CPU mesh every group
    # lives on the CPU anyway). Match its outcome, then its numbers.
    model_name = "mlp_head"
    ours = run_on_ranks(world_size, _try_mixed, "fsdp2", offloaded, model_name)[0]
    theirs = run_on_ranks(world_size, _try_mixed, "torch", offloaded, model_name)[0]
    assert (ours == "ok") == (theirs == "ok"), f"fsdp2: {ours}; torch: {theirs}"
    if ours == "ok":
        run_on_ranks(world_size, _train_offloaded, model_name, offloaded, True, {})


# ---------------------------------------------------------------------------------------------
# CUDA


def _local_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """``name -> CPU copy of the local shard``; on one rank that is the whole parameter."""
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local()
        assert local.shape == p.shape, f"{name}: local {local.shape}, full {p.shape}"
        out[name] = local.detach().cpu().clone()
    return out


def _warm_up_cublas(device: torch.device) -> None:
    """A first matmul on a stream allocates cuBLAS's workspace through the caching allocator
    (65 MiB on an H200, kept for the process): done here, before the test measures what
    fsdp2's step leaves allocated (gpu-check, 2026-11-28, the first test of a fresh worker)."""
    lin = nn.Linear(8, 8, device=device)
    lin(torch.ones(2, 8, device=device, requires_grad=True)).sum().backward()
    torch.cuda.synchronize()


def _train_offloaded_cuda(offloaded: str, pin_memory: bool) -> None:
    """fsdp2 on a 1-rank NCCL group over cuda:0 with CPU offloading, against a replicated
    fp32 reference on the CPU and torch's FSDP2 under the same policies."""
    torch.cuda.set_device(0)
    group = dist.new_group(ranks=[0], backend="nccl")
    mesh = DeviceMesh.from_group(group, "cuda")
    cuda = torch.device("cuda", 0)
    model_name = "mlp_head"
    ref = build(model_name)
    ref_opt = make_optimizer("adamw", ref.parameters())
    _warm_up_cublas(cuda)
    before = torch.cuda.memory_allocated()
    kw = {"offloaded": offloaded, "pin_memory": pin_memory, "mp": {}}
    ours = _shard(build(model_name), "fsdp2", mesh, **kw)
    # Offloaded groups hold nothing on the GPU once sharded; the others their shards (each
    # group one flat buffer, rounded up to the allocator's 512-byte blocks).
    on_gpu = sum(
        p.to_local().numel() * p.element_size()
        for name, p in ours.named_parameters()
        if not OFFLOADED[offloaded](_group_paths(ours)[name])
    )
    limit = 0 if offloaded == "all" else on_gpu + 512 * len(ours.layers) + 512
    assert torch.cuda.memory_allocated() - before <= limit, (
        f"after fully_shard: {torch.cuda.memory_allocated() - before} bytes on the GPU, "
        f"want at most {limit}"
    )
    theirs = _shard(build(model_name), "torch", mesh, **kw)
    opts = {"fsdp2": make_optimizer("adamw", ours.parameters())}
    opts["torch"] = make_optimizer("adamw", theirs.parameters())
    _check_placement(ours, offloaded, cuda, pin_memory)
    for step in range(STEPS):
        # CPU tensors: the root moves the input to the GPU; the target goes there by hand.
        x, y = make_batch(model_name, step)
        ref_loss = local_loss(ref, model_name, x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        start = torch.cuda.memory_allocated()
        for engine, model in (("fsdp2", ours), ("torch", theirs)):
            loss = local_loss(model, model_name, x, y.to(cuda))
            loss.backward()
            if engine == "fsdp2":
                _check_placement(model, offloaded, cuda, pin_memory)
            # GPU vs CPU kernels sum in other orders: fp32 rounding, ~1e-6 relative.
            check_close(loss.detach().cpu(), ref_loss.detach(), f"{engine} step {step} loss")
            del loss
            opts[engine].step()
            opts[engine].zero_grad()
            for name, full in _local_params(model).items():
                what = f"{engine} step {step} param {name}"
                check_close(full, ref_params[name], what, atol=1e-4, rtol=1e-4)
            # Step 0 creates AdamW's state, on the GPU for groups that are not offloaded.
            if engine == "fsdp2" and (offloaded == "all" or step > 0):
                torch.cuda.synchronize()
                # Nothing of fsdp2's step stays allocated: unsharded params and gradients
                # are freed, sharded grads and optimizer state live on the CPU.
                assert torch.cuda.memory_allocated() == start, (
                    f"step {step}: {torch.cuda.memory_allocated() - start} bytes left "
                    "allocated on the GPU by fsdp2's training step"
                )


@pytest.mark.gpu
@pytest.mark.parametrize("offloaded", ["all", "blocks"])
@pytest.mark.parametrize("pin_memory", [True, False], ids=["pin", "nopin"])
def test_cpu_offload_cuda(pin_memory: bool, offloaded: str) -> None:
    require_cuda("offloading from a GPU")  # tests/devices.py: make gpu-check DEVICE=cpu
    for _ in range(REPEATS):
        run_on_ranks(1, _train_offloaded_cuda, offloaded, pin_memory)
