"""Per-rank peak memory of a training step, before launch: ``fsdp2.estimate_memory``.

The estimate is a simulation, not a formula: the model is sharded with ``fully_shard``
on a mesh of the asked shape and one training step (forward, backward, optimizer step)
runs for real through fsdp2's engine, but on ``FakeTensor``s (shapes, dtypes and devices,
no memory) and over torch's fake process group (collectives return at once). A dispatch
mode sees every tensor the step creates and every one that dies, so the peak is that of
the live tensors, taken after every operator, exactly what fsdp2 and the model allocate:
all-gather and reduce-scatter buffers, prefetched groups, activations (with activation
checkpointing's recompute), gradients, the optimizer's state and its temporaries.

See [Note: simulated step] for how the peak is split into parts.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh

from fsdp2._core.front.seam import compute_device, rests_on_host
from fsdp2._core.front.sharding import FSDPModule, fully_shard
from fsdp2._core.support.debug import is_debug, set_debug
from fsdp2._core.support.observe import HUB
from fsdp2.api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdp2.planning import _experts, _fake, _held, _offload
from fsdp2.planning.stage import stage_step
from fsdp2.planning.tracker import PARTS, Tracker, sort_persistent

__all__ = ["PARTS", "MemoryEstimate", "estimate_memory"]


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


@dataclass(frozen=True)
class MemoryEstimate:
    """The simulated peak of one training step on one rank (rank 0: the largest shards).

    ``print(estimate)`` shows the peak, its parts and, when other settings were
    simulated too, a table of the peak under each.
    """

    peak_bytes: int
    """Peak live tensor bytes on the compute device during a steady-state step."""
    parts: dict[str, int]
    """The peak split into parts (keys: ``fsdp2.planning.estimate.PARTS``); they add up to it."""
    when: str
    """Where the step was at the peak, e.g. ``"backward of layers.3"``."""
    unsharded: tuple[str, ...]
    """The groups whose parameters were unsharded (or being gathered) at the peak."""
    settings: str
    """The simulated settings, e.g. ``"reshard_after_forward=True"``."""
    host_peak_bytes: int
    """Peak bytes on the host when the compute device is not the CPU (CPU offload keeps
    the sharded parameters, gradients and optimizer state there); 0 otherwise."""
    world_size: int
    mesh_shape: tuple[int, ...]
    device: str
    moments: dict[str, dict[str, int]] = field(default_factory=dict)
    """With ``estimate_memory(..., moments=True)``: for every moment of the step (the same
    names as ``when``), the parts at the most memory live then."""
    moment_unsharded: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """With ``moments=True``: the groups unsharded at each of those."""
    held: dict[str, int] = field(default_factory=dict)
    """What this rank holds from step to step, in bytes: ``"parameters"`` (its shards),
    ``"gradients"`` (its sharded gradients, all landed) and ``"optimizer state"``; on the
    compute device or, with CPU offload, the host."""
    held_on_host: dict[str, int] = field(default_factory=dict)
    """Of ``held``, what rests on the host: the groups whose CPU offload keeps their state
    there between steps (``offload_after_backward=True``), also on a CPU plan."""
    alternatives: tuple[MemoryEstimate, ...] = field(default=())
    """The same step simulated with other settings (``reshard_after_forward`` choices,
    with/without CPU offload): pick the one that fits."""

    def __str__(self) -> str:
        lines = [
            f"fsdp2 memory estimate: rank 0 of {self.world_size} (mesh {self.mesh_shape}), "
            f"{self.device}, {self.settings}",
            f"peak {_fmt(self.peak_bytes)} per rank, in the {self.when}",
        ]
        if self.unsharded:
            lines.append("  unsharded then: " + ", ".join(self.unsharded))
        width = max(len(p) for p in PARTS)
        for part in PARTS:
            if self.parts.get(part):
                lines.append(f"  {part:<{width}}  {_fmt(self.parts[part]):>11}")
        if self.host_peak_bytes:
            lines.append(f"  host memory (peak)  {_fmt(self.host_peak_bytes)}")
        if self.alternatives:
            rows = [self, *self.alternatives]
            w = max(len(r.settings) for r in rows)
            lines.append("")
            lines.append(f"{'settings':<{w}}  {'peak':>11}  {'host':>11}")
            for r in rows:
                host = _fmt(r.host_peak_bytes) if r.host_peak_bytes else "-"
                lines.append(f"{r.settings:<{w}}  {_fmt(r.peak_bytes):>11}  {host:>11}")
        return "\n".join(lines)


# ---- the simulation -------------------------------------------------------------------


def _optimizer(
    spec: str | Callable[[list[nn.Parameter]], torch.optim.Optimizer],
) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    if callable(spec):
        return spec
    builders: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
        "adamw": lambda ps: torch.optim.AdamW(ps),
        "adam": lambda ps: torch.optim.Adam(ps),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
        "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    }
    if spec not in builders:
        raise ValueError(
            f"estimate_memory: unknown optimizer {spec!r}; use one of {sorted(builders)} "
            "or a function that builds the optimizer from the parameters"
        )
    return builders[spec]


def _default_step(model: nn.Module, batch: Any) -> torch.Tensor:
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    loss = getattr(out, "loss", None)
    if loss is None:
        loss = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            "estimate_memory: the model's output is not a tensor (nor has .loss): pass "
            "step_fn=lambda model, batch: <the loss> to say how a step computes its loss"
        )
    return loss if loss.numel() == 1 else loss.float().sum()


def _is_sharded(model: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _default_blocks(model: nn.Module) -> list[nn.Module]:
    """The usual sharding: every module held in an ``nn.ModuleList`` (a model's
    layers), then the root."""
    blocks: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            blocks.extend(m)
    return blocks


def _select_blocks(
    model: nn.Module, shard: type | tuple[type, ...] | Callable[[nn.Module], bool] | None
) -> list[nn.Module]:
    if shard is None:
        return _default_blocks(model)
    if isinstance(shard, type) or (
        isinstance(shard, tuple) and all(isinstance(s, type) for s in shard)
    ):
        return [m for m in model.modules() if m is not model and isinstance(m, shard)]
    if callable(shard) and not isinstance(shard, nn.Module):
        return [m for m in model.modules() if m is not model and shard(m)]
    hint = (
        " (a module is not a predicate; the default, shard=None, takes every module of an "
        "nn.ModuleList such as model.model.layers, or pass the layer class)"
        if isinstance(shard, nn.Module)
        else ""
    )
    raise TypeError(
        "estimate_memory: shard must be a module class, a tuple of classes or a "
        f"function module -> bool, got {type(shard).__name__}{hint}"
    )


@contextmanager
def _watching(tracker: Tracker) -> Iterator[None]:
    was_debug = is_debug()
    set_debug(False)  # its checks talk to the store; nothing to check here
    try:
        with HUB.observing(tracker):
            yield
    finally:
        set_debug(was_debug)


def _checked(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"estimate_memory: step_fn returned a {type(loss).__name__}, not the "
            "loss tensor to call backward() on"
        )
    return loss


def _simulate(
    build: Callable[[DeviceMesh], nn.Module],
    batch: Any,
    step_fn: Callable[[nn.Module, Any], torch.Tensor],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    mesh: DeviceMesh,
    reshard: bool | None,
    settings: str,
    pipeline: tuple[int, int] | None = None,
    moments: bool = False,
    fix: str = "",
) -> MemoryEstimate:
    device = torch.device(mesh.device_type)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracker = Tracker(device)
    if moments:
        tracker.moments = {}
    with fake_mode, _watching(tracker), tracker:
        model = build(mesh)
        _experts.warn_padded(model, fix)  # see [Note: expert placement] in _experts.py
        if _experts.any_on_dim1(model):
            settings += ", experts sharded on dim 1"
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            model.to_empty(device=compute_device(model) or device)  # built on meta
        if reshard is not None:  # every block's, not the root's
            for m in model.modules():
                if isinstance(m, FSDPModule) and m is not model:
                    m.set_reshard_after_forward(reshard, recurse=False)
        params = [p for p in model.parameters() if p.requires_grad]
        tracker.params = params
        opt = optimizer(params)
        steps = 2  # the first builds the optimizer's state and learns the prefetch order
        for i in range(steps):
            if i == steps - 1:
                sort_persistent(tracker, model, opt)
                tracker.reset_peak()
            tracker.phase = tracker.where = "setup"
            dev = compute_device(model) or device
            if pipeline is not None:  # see [Note: pipeline stages] in planning/stage.py
                make = functools.partial(_fake.batch, batch, dev)
                stage_step(model, make, step_fn, *pipeline, tracker)
            else:
                b = _fake.batch(batch, dev)
                tracker.phase = "forward"
                loss = _checked(step_fn(model, b))
                tracker.phase = "backward"
                tracker.where = "backward"
                loss.backward()
                del loss, b
            tracker.phase = "optimizer"
            tracker.where = "optimizer step"
            opt.step()
            if i == steps - 1:  # (the measured step's)
                held = _held.held(model, opt)
                held_on_host = _held.held(model, opt, rests_on_host(model))
            opt.zero_grad(set_to_none=True)
            tracker.check_peak()
    shape = tuple(mesh.shape)
    return MemoryEstimate(
        peak_bytes=tracker.peak,
        parts=tracker.peak_parts,
        when=tracker.peak_where,
        unsharded=tracker.peak_unsharded,
        settings=settings,
        host_peak_bytes=tracker.host_peak if device.type != "cpu" else 0,
        world_size=math.prod(shape),
        mesh_shape=shape,
        device=device.type,
        held=held,
        held_on_host=held_on_host,
        moments=tracker.moments or {},
        moment_unsharded=tracker.moment_unsharded,
    )


def estimate_memory(
    model: nn.Module | Callable[[DeviceMesh], nn.Module],
    batch: Any,
    *,
    mesh_shape: int | Sequence[int],
    device: str | None = None,
    shard: type | tuple[type, ...] | Callable[[nn.Module], bool] | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | Mapping[str, OffloadPolicy] | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | str | None = "auto",
    optimizer: str | Callable[[list[nn.Parameter]], torch.optim.Optimizer] = "adamw",
    step_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    compare: bool = True,
    microbatches: int = 1,
    in_flight: int | None = None,
    moments: bool = False,
    shard_over_replicas: bool = False,
) -> MemoryEstimate:
    """Simulate one training step on rank 0 and return its peak memory, split into parts.

    Nothing is allocated: the step runs on ``FakeTensor``s over torch's fake process group,
    so a model of any size and a mesh of any size can be planned on a laptop (see
    docs/debugging.md, "Planning and debugging"). The step is ``loss = step_fn(model,
    batch)``, ``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad()``; its
    second run is measured (the first builds the optimizer's state).

    Args:
        model: the model, unsharded, best built on the meta device (``with
            torch.device("meta"): model = Model(cfg)``; a real model works too, it is
            copied). It is sharded like a training script would: ``fully_shard`` on every
            module chosen by ``shard``, then on the root. Or a function ``build(mesh)``
            that builds and shards the model itself on the given mesh (any ``fully_shard``
            calls and settings of its own). A ``build`` that creates meshes of its own
            (e.g. an expert-parallel mesh) must do that outside the simulation's fake
            tensors, where ``DeviceMesh`` cannot read its ranks: build under
            ``with torch._subclasses.fake_tensor.unset_fake_temporarily(),
            torch.device("meta"):`` (nothing is allocated; see docs/moe.md).
        batch: a sample batch: tensors (on the meta device is enough: only shapes and
            dtypes matter) in a tuple, list, dict, or alone, as the model takes it.
        mesh_shape: ``N`` or ``(N,)`` for FSDP over ``N`` ranks; ``(R, S)`` for HSDP
            (``R`` replicas of ``S``-way sharding).
        device: the device type to plan for (``"cuda"``, ``"cpu"``; default: ``"cuda"``
            when one is available, else ``"cpu"``).
        shard: which submodules get their own ``fully_shard`` call: a module class, a
            tuple of them, or a function ``module -> bool``. Default: every module held in
            an ``nn.ModuleList`` (a model's layers).
        reshard_after_forward: ``fully_shard``'s, for every call but the root's (which stays
            ``None``: it keeps its parameters after the forward). With ``build``, applied
            with ``set_reshard_after_forward`` to every module but the root.
        mp_policy: ``fully_shard``'s, for every call.
        offload_policy: ``fully_shard``'s, for every call; or a mapping from parameter names
            relative to ``model`` (``fsdp2.cpu_offload_by_budget(model, budget)``), each
            call given the names under its module, relative to it.
        shard_placement_fn: ``fully_shard``'s for every call (``None``: every parameter on
            dim 0). ``"auto"`` (default): as torchtitan shards a mixture of experts' stacked
            3-D parameters, on dim 1 when dim 0 (the experts) is smaller than the shard size
            and dim 1 divides evenly over it, else on dim 0 ([Note: expert placement] in
            fsdp2/planning/_experts.py). A sharded model (``build``'s too) that still holds
            3-D parameters on dim 0 with fewer rows than shard ranks (most ranks hold
            padding) warns (``UserWarning``), saying what shards them on dim 1.
        optimizer: ``"adamw"`` (default), ``"adam"``, ``"sgd"``, ``"sgd_momentum"``, or a
            function ``params -> Optimizer``.
        step_fn: ``(model, batch) -> loss``. Default: call the model on the batch and take
            its output (or its ``.loss``), summed if it is not a scalar.
        compare: also simulate the other ``reshard_after_forward`` choices (``True``,
            ``False``) and, when ``model`` is a module, with and without CPU offload;
            they are in ``alternatives``.
        microbatches: more than 1: ``model`` is a pipeline stage and ``batch`` one
            micro-batch; the step is a pipeline schedule's for this stage ([Note: pipeline
            stages] in fsdp2/planning/stage.py): ``microbatches`` forwards and backwards,
            gradients and the gathered parameters of groups that do not reshard after
            forward held across micro-batches, one reduction at the end.
        in_flight: how many micro-batches' activations the schedule keeps at once on this
            stage (default: all, GPipe; 1F1B: the number of stages minus this stage's
            index).
        moments: also record, for every moment of the step, the parts at the most memory
            live then (``MemoryEstimate.moments``; a little slower). ``fsdp2 estimate``
            scales small models' moments to a large one's blocks.
        shard_over_replicas: wrap the optimizer (elementwise; unless already wrapped) with
            ``fsdp2.replica_optim.shard_over_replicas``: each HSDP group's gradients and
            optimizer state in pieces of ``ceil(n / R)`` of every ``n``-element local shard
            over the ``R`` replicas. Needs ``mesh_shape`` ``(R, S)``.

    Returns:
        A :class:`MemoryEstimate`: ``print`` it for a table.

    Raises:
        ValueError: a bad ``mesh_shape`` (a 1D one with ``shard_over_replicas``), an unknown
            optimizer, or an already sharded model (pass a ``build(mesh)`` function instead).
        TypeError: ``shard_over_replicas`` with an optimizer that is not elementwise; a
            ``shard_placement_fn`` that is no function, ``None`` or ``"auto"``.
        RuntimeError: a process group other than a fake one of the same size is already
            initialized.
    """
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"estimate_memory: microbatches must be an int >= 1, got {microbatches!r}")
    flight = microbatches if in_flight is None else in_flight
    if isinstance(flight, bool) or not isinstance(flight, int) or flight < 1:
        raise ValueError(f"estimate_memory: in_flight must be an int >= 1, got {in_flight!r}")
    pipeline = (microbatches, min(flight, microbatches)) if microbatches > 1 else None
    shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
    if not 1 <= len(shape) <= 2 or not all(isinstance(s, int) and s >= 1 for s in shape):
        raise ValueError(
            f"estimate_memory: mesh_shape must be N (FSDP) or (R, S) (HSDP) with positive "
            f"sizes, got {mesh_shape!r}"
        )
    if not isinstance(model, nn.Module):
        given = {
            "shard": shard,
            "reshard_after_forward": reshard_after_forward,
            "mp_policy": mp_policy,
            "offload_policy": offload_policy,
            "shard_placement_fn": None if shard_placement_fn == "auto" else shard_placement_fn,
        }
        if any(v is not None for v in given.values()):
            names = ", ".join(k for k, v in given.items() if v is not None)
            raise ValueError(
                f"estimate_memory: {names} apply to a model that estimate_memory shards; "
                "build(mesh) shards its model itself: pass them to its fully_shard calls"
            )
    elif _is_sharded(model):
        raise ValueError(
            f"estimate_memory: {type(model).__name__} is already sharded with fully_shard; "
            "pass the unsharded model, or a function build(mesh) that builds and shards it "
            "on the mesh it is given (the simulation shards a fresh copy for each setting)"
        )
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cuda" and not torch.backends.cuda.is_built():
        raise RuntimeError(
            "estimate_memory(device='cuda') needs a torch built with CUDA (fake CUDA "
            "tensors still go through its device code); this torch is CPU-only: plan with "
            "device='cpu' (the same parameters, gradients, optimizer state and "
            "communication buffers; kernels that differ by device, such as attention, "
            "may save different activations)"
        )
    if not (shard_placement_fn in (None, "auto") or callable(shard_placement_fn)):
        raise TypeError(
            'estimate_memory: shard_placement_fn must be a function, None or "auto", got '
            f"{shard_placement_fn!r}"
        )
    opt = _optimizer(optimizer)
    if shard_over_replicas:  # (a 1D mesh_shape: ValueError)
        opt = _held.over_replicas(opt, mesh_shape)
    step = step_fn or _default_step
    mp = mp_policy or MixedPrecisionPolicy()
    offload = _offload.unpinned(OffloadPolicy() if offload_policy is None else offload_policy)

    def builder(rshd: bool | int, off: _offload.Offload) -> Callable[[DeviceMesh], nn.Module]:
        assert isinstance(model, nn.Module)

        # Copied on the meta device (deepcopy does not work in the fake mode), then
        # materialized (fake) and sharded in the fake mode.
        meta = copy.deepcopy(model).to("meta")

        def build(mesh: DeviceMesh) -> nn.Module:  # (called once)
            ties = _held.ties(meta)
            m = meta.to_empty(device=dev)
            _held.retie(ties)  # tied parameters stay one parameter, as training keeps them
            kw: dict[str, Any] = {"mesh": mesh, "mp_policy": mp}
            kw["shard_placement_fn"] = (
                _experts.auto(mesh.shape[-1])
                if shard_placement_fn == "auto"
                else shard_placement_fn
            )
            blocks = _select_blocks(m, shard)
            calls = _offload.per_call(off, m, blocks)
            for block in blocks:
                fully_shard(
                    block, reshard_after_forward=rshd, offload_policy=calls[id(block)], **kw
                )
            fully_shard(m, offload_policy=calls[id(m)], **kw)
            return m

        return build

    runs: list[tuple[Callable[[DeviceMesh], nn.Module], bool | None, str]] = []
    if not isinstance(model, nn.Module):  # build(mesh): as built, then every block set
        runs.append((model, None, "as built"))
        if compare:
            runs += [(model, c, f"reshard_after_forward={c}") for c in (True, False)]
    else:
        first = True if reshard_after_forward is None else reshard_after_forward
        choices = [first]
        if compare:
            choices += [c for c in (True, False) if c is not first]
        named = _offload.describe(offload)
        for c in choices:
            runs.append((builder(c, offload), None, f"reshard_after_forward={c}{named}"))
        if compare and dev != "cpu":  # (on a CPU the offload moves nothing)
            other = OffloadPolicy() if named else CPUOffloadPolicy(pin_memory=False)
            for c in choices:
                name = f"reshard_after_forward={c}" + ("" if named else ", CPU offload")
                runs.append((builder(c, other), None, name))
    if shard_over_replicas:
        runs = [(b, r, f"{s}, shard_over_replicas") for b, r, s in runs]
    with _fake.world(math.prod(shape)):
        mesh = _fake.mesh(dev, shape)
        fix = _experts.fix_for(shard_placement_fn, not isinstance(model, nn.Module))
        results = [
            _simulate(b, batch, step, opt, mesh, r, s, pipeline, moments, fix) for b, r, s in runs
        ]
    return replace(results[0], alternatives=tuple(results[1:]))
