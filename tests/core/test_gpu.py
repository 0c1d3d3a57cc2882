"""fsdp2's CUDA paths on one GPU: what ``make gpu-check`` runs (``pytest -m gpu``).

Every test here is ``gpu``-marked: it runs on CUDA when there is a GPU and is skipped
otherwise, except under ``FSDP2_TEST_DEVICE=cpu`` (``make gpu-check DEVICE=cpu``, run by CI),
where the device-agnostic ones run on the CPU with gloo and the CUDA-only ones skip with a
reason (``tests/devices.py``). A GPU machine here has one GPU, so the engine runs on a 1-rank
NCCL group (``devices.one_rank_mesh``); two ranks share the GPU over gloo where gloo takes
CUDA tensors. Each training run is repeated ``FSDP2_GPU_REPEATS`` times (``make gpu-check``:
3) and must give the same numbers every time: a missing stream dependency shows as a run
that differs, and only sometimes.

* parity: a small Llama trained by fsdp2, by torch's FSDP2 and unsharded on the same GPU,
  fp32 and bf16 mixed precision, ``reshard_after_forward`` True / False / 1, implicit and
  explicit prefetch: losses every step and parameters at the end;
* ``set_post_optim_event``: the optimizer steps on a side stream held back by a sleep; the
  next forward must wait for its event (without the wait it reads stale parameters);
* ``set_all_reduce_hook(stream=...)``: a hook on a side stream, held back likewise, halves
  the gradients; reading them after backward must see the halved values;
* CPU offload with pinned memory and gradient accumulation (the host adds the accumulated
  gradient only once the device-to-host copy is done);
* ``set_allocate_memory_from_process_group_for_comm``: NCCL's allocator serves the buffers;
* ``fsdp2.checkpoint`` save from and load into GPU shards (meta-device init);
* ``estimate_memory(device="cuda")`` against ``torch.cuda.max_memory_allocated``;
* ``fsdp2.timeline`` on CUDA: the trace holds the GPU kernels;
* two ranks on one GPU over gloo (CUDA tensors): fsdp2 against torch's FSDP2 and the
  reference, where gloo supports CUDA collectives (skipped with its error otherwise);
* the traced mode (``fsdp2.traced``) at world size 1: compiled whole with ``aot_eager``'s
  compilers, bitwise eager fsdp2 (fp32 and bf16 mixed precision; on CUDA SDPA's math
  backend, whose backward has no atomics), no collective in its graphs, nothing recompiled.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from comm_counter import AG_API, RS_API
from devices import REPEATS, TEST_DEVICE, one_rank_mesh, require_cuda
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffload
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2.models import Llama, LlamaConfig

pytestmark = pytest.mark.gpu

CFG = LlamaConfig(vocab_size=256, dim=128, n_layers=3, n_heads=4, max_seq_len=64)
BATCH = 4
STEPS = 4
LR = 1e-3
# fp32: the same kernels on the same inputs, but some CUDA backward kernels (attention) add
# with atomics, so runs differ in the last bits, and AdamW turns a tiny gradient's noise into
# up to ~lr/10 of a parameter. A race (stale or half-written data) is far above these.
# bf16: fsdp2 and torch cast alike.
TOL = {"fp32": {"rtol": 1e-5, "atol": 1e-5}, "bf16": {"rtol": 2e-3, "atol": 2e-3}}
PARAM_TOL = {"fp32": {"rtol": 1e-4, "atol": 1e-4}, "bf16": {"rtol": 1e-2, "atol": 5e-3}}
REF_LOSS_TOL = {"fp32": TOL["fp32"], "bf16": {"rtol": 3e-2, "atol": 3e-2}}  # fp32 reference


# ---------------------------------------------------------------------------------------------
# Models, data, sharding


def _build(device: torch.device | str) -> Llama:
    torch.manual_seed(0)
    return Llama(CFG).to(device)


def _tokens(step: int, device: torch.device | str, batch: int = BATCH) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(1000 + step)
    t = torch.randint(0, CFG.vocab_size, (batch, CFG.max_seq_len + 1), generator=g)
    return t[:, :-1].to(device), t[:, 1:].to(device)


def _policy(engine: str, mp: str) -> dict[str, Any]:
    if mp == "fp32":
        return {}
    cls = fsdp2.MixedPrecisionPolicy if engine == "fsdp2" else TorchMP
    return {"mp_policy": cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


def _shard(
    model: Llama,
    engine: str,
    mesh: DeviceMesh,
    *,
    mp: str = "fp32",
    reshard: bool | int = True,
    prefetch: bool = False,
    **kw: Any,
) -> Llama:
    fn = fsdp2.fully_shard if engine == "fsdp2" else torch_fully_shard
    for block in model.layers:
        fn(block, mesh=mesh, reshard_after_forward=reshard, **_policy(engine, mp), **kw)
    fn(model, mesh=mesh, **_policy(engine, mp), **kw)
    if prefetch:  # explicit: the next block in forward, the previous one in backward
        layers = list(model.layers)
        for i, block in enumerate(layers):
            if i + 1 < len(layers):
                block.set_modules_to_forward_prefetch([layers[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([layers[i - 1]])
    return model


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the full parameters (collective for DTensors).

    Over gloo, CUDA shards are gathered as CPU tensors: torch's own ``DTensor.full_tensor()``
    (its functional all-gather) crashes there with a segmentation fault (torch 2.11 on an H200,
    ``make gpu-check``, 2026-11-28), while c10d's all-gather of CUDA tensors works."""
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and p.device.type == "cuda" and _on_gloo(p):
            t = DTensor.from_local(
                p.to_local().detach().cpu(),
                _cpu_mesh(p),
                p.placements,
                shape=p.shape,
                stride=p.stride(),
            ).full_tensor()
        else:
            t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().float().cpu().clone()
    return out


def _on_gloo(p: DTensor) -> bool:
    return dist.get_backend(p.device_mesh.get_group()) == "gloo"


def _cpu_mesh(p: DTensor) -> DeviceMesh:
    return DeviceMesh.from_group(p.device_mesh.get_group(), "cpu")


def _close(got: Any, want: Any, what: str, tol: dict[str, float]) -> None:
    got, want = torch.as_tensor(got).float().cpu(), torch.as_tensor(want).float().cpu()
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")


def _train(
    model: nn.Module, device: torch.device, steps: int = STEPS, micro: int = 1
) -> list[float]:
    """``steps`` AdamW steps (``micro`` microbatches each, gradients accumulated); the
    per-step mean losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = _tokens(step, device)
        total = 0.0
        for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
            loss = model(xs, ys) / micro
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _check_runs(runs: dict[str, dict[str, Any]], mp: str, what: str) -> None:
    """fsdp2 against the reference and torch (where run): losses per step, final params."""
    ours = runs["fsdp2"]
    for step, (a, b) in enumerate(zip(ours["losses"], runs["ref"]["losses"], strict=True)):
        _close(a, b, f"{what} step {step}: fsdp2 vs reference loss", REF_LOSS_TOL[mp])
    if mp == "fp32":
        for name, p in ours["params"].items():
            _close(p, runs["ref"]["params"][name], f"{what} {name}: fsdp2 vs ref", PARAM_TOL[mp])
    if "torch" in runs:
        theirs = runs["torch"]
        for step, (a, b) in enumerate(zip(ours["losses"], theirs["losses"], strict=True)):
            _close(a, b, f"{what} step {step}: fsdp2 vs torch loss", TOL[mp])
        for name, p in ours["params"].items():
            _close(p, theirs["params"][name], f"{what} {name}: fsdp2 vs torch", PARAM_TOL[mp])


def _check_repeats(results: list[dict[str, Any]], mp: str, what: str) -> None:
    """Every repeat of a run gives the first one's numbers (a race gives other ones)."""
    first = results[0]
    for r, later in enumerate(results[1:], 1):
        for step, (a, b) in enumerate(zip(later["losses"], first["losses"], strict=True)):
            _close(a, b, f"{what} repeat {r} step {step} loss vs repeat 0", TOL[mp])
        for name, p in later["params"].items():
            _close(p, first["params"][name], f"{what} repeat {r} {name}", PARAM_TOL[mp])


# ---------------------------------------------------------------------------------------------
# Parity on one GPU: fsdp2, torch's FSDP2 and the unsharded model


def _parity(mp: str, reshard: bool | int, prefetch: bool) -> dict[str, dict[str, Any]]:
    mesh = one_rank_mesh()
    device = torch.device(TEST_DEVICE, 0) if TEST_DEVICE == "cuda" else torch.device("cpu")
    runs: dict[str, dict[str, Any]] = {}
    ref = _build(device)
    runs["ref"] = {"losses": _train(ref, device), "params": _full(ref)}
    for engine in ("fsdp2", "torch"):
        model = _shard(_build(device), engine, mesh, mp=mp, reshard=reshard, prefetch=prefetch)
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) and p.device.type == device.type, f"{engine} {name}"
        runs[engine] = {"losses": _train(model, device), "params": _full(model)}
    if TEST_DEVICE == "cuda":
        torch.cuda.synchronize()
    _check_runs(runs, mp, f"{mp} reshard={reshard} prefetch={prefetch}")
    return runs


@pytest.mark.parametrize("mp", ["fp32", "bf16"])
@pytest.mark.parametrize("reshard", [True, False, 1], ids=["reshard", "keep", "int1"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["implicit", "explicit"])
def test_parity_one_gpu(mp: str, reshard: bool | int, prefetch: bool) -> None:
    results = [run_on_ranks(1, _parity, mp, reshard, prefetch)[0] for _ in range(REPEATS)]
    _check_repeats([r["fsdp2"] for r in results], mp, "fsdp2")


# ---------------------------------------------------------------------------------------------
# set_post_optim_event: the optimizer on a side stream


def _post_optim_event() -> dict[str, Any]:
    mesh = one_rank_mesh()
    device = torch.device("cuda", 0)
    ref = _build(device)
    ref_losses = _train(ref, device)
    model = _shard(_build(device), "fsdp2", mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    side = torch.cuda.Stream()
    losses = []
    for step in range(STEPS):
        x, y = _tokens(step, device)
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # Hold the step back: a forward that does not wait for the event reads the
            # parameters before they are updated. Gradients are zeroed in place on the
            # side stream, so no memory is freed under it.
            torch.cuda._sleep(50_000_000)
            opt.step()
            opt.zero_grad(set_to_none=False)
            event = side.record_event()
        model.set_post_optim_event(event)
    torch.cuda.synchronize()
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        _close(a, b, f"step {step}: fsdp2 vs reference loss", TOL["fp32"])
    params = _full(model)
    for name, p in _full(ref).items():
        _close(params[name], p, f"{name}: fsdp2 vs reference", PARAM_TOL["fp32"])
    return {"losses": losses, "params": params}


def test_post_optim_event_orders_the_next_forward() -> None:
    require_cuda("set_post_optim_event (streams and events)")
    results = [run_on_ranks(1, _post_optim_event)[0] for _ in range(REPEATS)]
    _check_repeats(results, "fp32", "post-optim event")


# ---------------------------------------------------------------------------------------------
# set_all_reduce_hook(stream=...): the hook runs on a side stream


def _all_reduce_hook_on_stream() -> None:
    mesh = one_rank_mesh()
    device = torch.device("cuda", 0)
    ref = _build(device)
    model = _shard(_build(device), "fsdp2", mesh)
    side = torch.cuda.Stream()

    def halve(grad: torch.Tensor) -> None:  # runs on ``side``, held back by a sleep
        torch.cuda._sleep(50_000_000)
        grad.mul_(0.5)

    for m in model.modules():
        if isinstance(m, fsdp2.FSDPModule):
            m.set_all_reduce_hook(halve, stream=side)
    for step in range(2):
        x, y = _tokens(step, device)
        (ref(x, y) * 0.5).backward()
        model(x, y).backward()
        # Read on the current stream: it must have waited for the hooks' stream.
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        for name, p in ref.named_parameters():
            _close(grads[name], p.grad, f"step {step} {name}: halved gradient", TOL["fp32"])
        ref.zero_grad()
        model.zero_grad()


def test_all_reduce_hook_on_a_side_stream() -> None:
    require_cuda("set_all_reduce_hook(stream=...)")
    for _ in range(REPEATS):
        run_on_ranks(1, _all_reduce_hook_on_stream)


# ---------------------------------------------------------------------------------------------
# CPU offload (pinned) with gradient accumulation


def _offload_accumulate(pin: bool) -> dict[str, dict[str, Any]]:
    mesh = one_rank_mesh()
    device = torch.device("cuda", 0)
    runs: dict[str, dict[str, Any]] = {}
    ref = _build(device)
    runs["ref"] = {"losses": _train(ref, device, micro=2), "params": _full(ref)}
    for engine, policy in (
        ("fsdp2", fsdp2.CPUOffloadPolicy(pin_memory=pin)),
        ("torch", TorchCPUOffload(pin_memory=pin)),
    ):
        model = _shard(_build(device), engine, mesh, offload_policy=policy)
        for name, p in model.named_parameters():
            assert p.to_local().device.type == "cpu", f"{engine} {name} not offloaded"
            assert p.to_local().is_pinned() == pin, f"{engine} {name}: pinned is not {pin}"
        runs[engine] = {"losses": _train(model, device, micro=2), "params": _full(model)}
    _check_runs(runs, "fp32", f"offload pin={pin} accumulate")
    return runs


@pytest.mark.parametrize("pin", [True, False], ids=["pin", "nopin"])
def test_cpu_offload_with_gradient_accumulation(pin: bool) -> None:
    require_cuda("CPU offload from a GPU")
    results = [run_on_ranks(1, _offload_accumulate, pin)[0] for _ in range(REPEATS)]
    _check_repeats([r["fsdp2"] for r in results], "fp32", "offload")


# ---------------------------------------------------------------------------------------------
# set_allocate_memory_from_process_group_for_comm


def _backend_alloc() -> bool:
    from fsdp2._core.comm.transport import BackendAlloc

    mesh = one_rank_mesh()
    device = torch.device("cuda", 0)
    group = mesh.get_group()
    comm = BackendAlloc.for_group(group, device)
    if comm is not None:  # NCCL's own allocator: both collectives through its buffers
        x = torch.arange(1000, dtype=torch.float32, device=device)
        out = comm.allocate((1000,), dtype=torch.float32, device=device)
        work = comm(out, x, group, async_op=True)
        work.wait()
        assert torch.equal(out, x), "all-gather through the process group's allocator"
        out2 = comm.allocate((1000,), dtype=torch.float32, device=device)
        work = comm(out2, x, group, dist.ReduceOp.SUM, async_op=True)
        work.wait()
        assert torch.equal(out2, x), "reduce-scatter through the process group's allocator"
    ref = _build(device)
    ref_losses = _train(ref, device)
    model = _shard(_build(device), "fsdp2", mesh)
    for m in model.modules():
        if isinstance(m, fsdp2.FSDPModule):
            m.set_allocate_memory_from_process_group_for_comm(True)
    losses = _train(model, device)
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        _close(a, b, f"step {step}: fsdp2 vs reference loss", TOL["fp32"])
    return comm is not None


def test_allocate_memory_from_process_group() -> None:
    require_cuda("the NCCL process group's allocator")
    has_allocator = run_on_ranks(1, _backend_alloc)[0]
    if not has_allocator:
        pytest.skip("this NCCL backend has no mem_allocator: the setting falls back to torch's")


# ---------------------------------------------------------------------------------------------
# fsdp2.checkpoint from and to GPU shards


def _checkpoint(path: str) -> None:
    from safetensors.torch import load_file

    mesh = one_rank_mesh()
    device = torch.device(TEST_DEVICE, 0) if TEST_DEVICE == "cuda" else torch.device("cpu")
    model = _shard(_build(device), "fsdp2", mesh)
    _train(model, device, steps=1)
    files = fsdp2.checkpoint.save_full_checkpoint(model, path)
    full = _full(model)
    saved: dict[str, torch.Tensor] = {}
    for f in files:
        saved.update(load_file(f if os.path.isabs(f) else os.path.join(path, f)))
    assert set(saved) == set(full), f"saved {sorted(saved)} want {sorted(full)}"
    for name, t in full.items():
        assert torch.equal(saved[name].float(), t), f"saved {name} differs"
    with torch.device("meta"):
        fresh = Llama(CFG)
    _shard(fresh, "fsdp2", mesh)
    fresh.rope = fresh._rope(device)  # a non-persistent buffer: in no checkpoint
    fsdp2.checkpoint.load_full_checkpoint(fresh, path)
    for name, p in fresh.named_parameters():
        assert p.to_local().device.type == device.type, f"{name} loaded onto {p.device}"
    for name, t in _full(fresh).items():
        assert torch.equal(t, full[name]), f"loaded {name} differs"
    a, b = _train(model, device, steps=2), _train(fresh, device, steps=2)
    _close(b, a, "losses after loading vs the saved model's", TOL["fp32"])


def test_full_checkpoint_on_gpu_shards(tmp_path: Any) -> None:
    run_on_ranks(1, _checkpoint, str(tmp_path / "ckpt"))


# ---------------------------------------------------------------------------------------------
# estimate_memory(device="cuda") against the CUDA caching allocator's peak

EST_DIM, EST_LAYERS, EST_BATCH = 4096, 6, 2048  # ~2 GiB at the peak: cuBLAS workspaces are noise


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(EST_DIM, EST_DIM), nn.GELU()) for _ in range(EST_LAYERS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _measured_cuda_peak() -> int:
    mesh = one_rank_mesh()
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = _MLP().to(device)
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x = torch.randn(EST_BATCH, EST_DIM, device=device)
    for _ in range(3):  # the last is measured: the optimizer's state exists by then
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(x).backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def test_estimate_memory_cuda_within_10_percent() -> None:
    require_cuda("estimate_memory(device='cuda') against torch.cuda.max_memory_allocated")
    measured = run_on_ranks(1, _measured_cuda_peak)[0]
    with torch.device("meta"):
        model = _MLP()
    batch = torch.empty(EST_BATCH, EST_DIM, device="meta")
    est = fsdp2.estimate_memory(model, batch, mesh_shape=1, device="cuda", compare=False)
    ratio = est.peak_bytes / measured
    assert 0.9 <= ratio <= 1.1, f"estimate {est.peak_bytes} vs measured {measured}: {ratio:.3f}"


# ---------------------------------------------------------------------------------------------
# fsdp2.timeline on CUDA


def _timeline(path: str) -> dict[str, Any]:
    mesh = one_rank_mesh()
    device = torch.device(TEST_DEVICE, 0) if TEST_DEVICE == "cuda" else torch.device("cpu")
    model = _shard(_build(device), "fsdp2", mesh)
    _train(model, device, steps=1)
    x, y = _tokens(0, device)
    with fsdp2.timeline(path, png=False) as tl:
        model(x, y).backward()
    assert tl.step_s > 0 and tl.compute_s > 0, tl.summary
    assert tl.trace_path is not None
    with open(tl.trace_path) as f:
        events = json.load(f)["traceEvents"]
    cats = {str(e.get("cat", "")).lower() for e in events if isinstance(e, dict)}
    if TEST_DEVICE == "cuda":
        assert "kernel" in cats, f"no GPU kernel in the trace; categories {sorted(cats)}"
    return {"summary": tl.summary}


def test_timeline_on_device(tmp_path: Any) -> None:
    run_on_ranks(1, _timeline, str(tmp_path / "tl"))


# ---------------------------------------------------------------------------------------------
# Two ranks on one GPU over gloo (CUDA tensors)


def _gloo_supports_cuda() -> str | None:
    """None when gloo all-gathers and reduce-scatters CUDA tensors here, else its error."""
    x = torch.ones(4, device="cuda")
    try:
        getattr(dist, AG_API)(torch.empty(8, device="cuda"), x)
        getattr(dist, RS_API)(torch.empty(2, device="cuda"), torch.ones(4, device="cuda"))
    except (RuntimeError, ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def _two_ranks_one_gpu(mp: str) -> dict[str, Any]:
    torch.cuda.set_device(0)
    unsupported = _gloo_supports_cuda()
    if unsupported is not None:
        return {"unsupported": unsupported}
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
    device = torch.device("cuda", 0)
    rank, world = dist.get_rank(), dist.get_world_size()
    runs: dict[str, dict[str, Any]] = {}
    ref = _build(device)
    runs["ref"] = {"losses": _train(ref, device), "params": _full(ref)}
    for engine in ("fsdp2", "torch"):
        model = _shard(_build(device), engine, mesh, mp=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        losses = []
        for step in range(STEPS):
            x, y = _tokens(step, device)
            n = x.size(0) // world
            loss = model(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])
            loss.backward()
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            losses.append(avg.item() / world)
            opt.step()
            opt.zero_grad()
        runs[engine] = {"losses": losses, "params": _full(model)}
    torch.cuda.synchronize()
    _check_runs(runs, mp, f"2 ranks on one GPU {mp}")
    return runs


@pytest.mark.parametrize("mp", ["fp32", "bf16"])
def test_two_ranks_share_one_gpu_over_gloo(mp: str) -> None:
    require_cuda("CUDA tensors over gloo")
    results = [run_on_ranks(2, _two_ranks_one_gpu, mp)[0] for _ in range(REPEATS)]
    if "unsupported" in results[0]:
        pytest.skip(f"gloo has no CUDA all-gather / reduce-scatter here: {results[0]}")
    _check_repeats([r["fsdp2"] for r in results], mp, "2 ranks on one GPU")


# ---------------------------------------------------------------------------------------------
# fsdp2.reduction's exchange on the device's backend (NCCL on a GPU: all_to_all_single, the fp8
# casts and the sum ordered after the collective on the current stream)


def _exchange_on_device() -> None:
    from fsdp2.reduction import ExchangeReduceScatter

    mesh = one_rank_mesh()
    group = mesh.get_group()
    device = torch.device(mesh.device_type, 0) if mesh.device_type == "cuda" else None
    gen = torch.Generator().manual_seed(0)
    numel, block = 1000, 64
    x = (torch.randn(numel, generator=gen) * torch.logspace(-3, 3, numel)).to(device)
    for wire in (None, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        comm = ExchangeReduceScatter(wire, block_size=block)
        out = torch.empty(numel, device=x.device)
        comm(out, x, group, dist.ReduceOp.SUM, True).wait()
        if wire is None:
            want = x
        elif wire == torch.bfloat16:
            want = x.to(wire).float()
        else:
            grid = torch.cat([x, x.new_zeros(-numel % block)]).view(-1, block)
            scale = grid.abs().amax(dim=1, keepdim=True) / torch.finfo(wire).max
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            want = ((grid / scale).to(wire).float() * scale).view(-1)[:numel]
        assert torch.equal(out, want), f"{wire}: max diff {(out - want).abs().max().item()}"


def test_exchange_reduce_on_device() -> None:
    run_on_ranks(1, _exchange_on_device)


# ---------------------------------------------------------------------------------------------
# The traced mode on the device: compiled (aot_eager) equals eager fsdp2 bitwise, and at one
# shard rank its graphs hold no collective


def _recording_backend(ops: dict[str, list[str]]) -> Any:
    """A ``torch.compile`` backend: ``aot_eager``'s compilers (the traced aten graphs run as
    they are), keeping each forward and backward graph's functional collectives in ``ops``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(kind: str) -> Any:
        def compiler(gm: torch.fx.GraphModule, _: Any) -> Any:
            ops[kind] += [
                str(n.target)
                for n in gm.graph.nodes
                if n.op == "call_function" and "_c10d_functional" in str(n.target)
            ]
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))


def _traced_on_device(mp: str) -> dict[str, Any]:
    from torch._dynamo.utils import counters
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fsdp2.traced import fully_shard_traced

    mesh = one_rank_mesh()
    device = torch.device(TEST_DEVICE, 0) if TEST_DEVICE == "cuda" else torch.device("cpu")
    # On CUDA, SDPA's memory-efficient and flash backwards add with atomics (runs differ in
    # the last bits); the math backend's matmuls and softmax do not. The CPU keeps its own.
    cuda = TEST_DEVICE == "cuda"
    runs: dict[str, dict[str, Any]] = {}
    ops: dict[str, list[str]] = {"fw": [], "bw": []}
    graphs: list[int] = []
    for how in ("eager", "traced"):
        model = _build(device)
        fn: Any = fsdp2.fully_shard if how == "eager" else fully_shard_traced
        for block in model.layers:
            fn(block, mesh=mesh, **_policy("fsdp2", mp))
        fn(model, mesh=mesh, **_policy("fsdp2", mp))
        run: Any = model
        if how == "traced":
            torch._dynamo.reset()
            counters.clear()
            run = torch.compile(model, backend=_recording_backend(ops), fullgraph=True)
        with sdpa_kernel([SDPBackend.MATH]) if cuda else contextlib.nullcontext():
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
            losses = []
            for step in range(3):
                x, y = _tokens(step, device)
                loss = run(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                if how == "traced":
                    graphs.append(counters["stats"]["unique_graphs"])
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) and p.device.type == device.type, f"{how} {name}"
        runs[how] = {"losses": losses, "params": _full(model)}
    recompiles = sum(counters["recompiles"].values())
    breaks = sum(counters["graph_break"].values())
    return {**runs, "ops": ops, "graphs": graphs, "recompiles": recompiles, "breaks": breaks}


@pytest.mark.parametrize("mp", ["fp32", "bf16"])
def test_traced_compiled_on_device(mp: str) -> None:
    """World size 1 on the device: ``fully_shard_traced`` on each block and the root, then
    ``torch.compile(fullgraph=True)`` with ``aot_eager``'s compilers, trains bitwise as eager
    ``fsdp2.fully_shard`` (losses each step, parameters at the end; 3 AdamW steps). At one
    shard rank the local shard is the whole parameter, so the traced mode makes no
    collective: the forward and backward graphs hold none. One graph, compiled in step 1,
    nothing recompiled after it. Run once, not ``REPEATS`` times: the traced mode has no
    stream of its own, and eager fsdp2's are repeated by ``test_parity_one_gpu``."""
    res = run_on_ranks(1, _traced_on_device, mp)[0]
    eager, traced = res["eager"], res["traced"]
    assert traced["losses"] == eager["losses"], (traced["losses"], eager["losses"])
    for name, p in eager["params"].items():
        got = traced["params"][name]
        assert torch.equal(got, p), f"{mp} {name}: max diff {(got - p).abs().max().item()}"
    assert res["ops"] == {"fw": [], "bw": []}, res["ops"]
    assert res["graphs"] == [1, 1, 1], res["graphs"]
    assert res["recompiles"] == 0 and res["breaks"] == 0, res
