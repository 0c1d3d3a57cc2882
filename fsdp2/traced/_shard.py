"""``fully_shard_traced``: shard a module's parameters for the traced mode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp2._core.front.sharding import FSDPModule, _check_ignored
from fsdp2._core.params.placement import _shard_dim
from fsdp2._core.support.mesh import default_mesh, dp_tp_mesh, mesh_info
from fsdp2.api import MixedPrecisionPolicy, OffloadPolicy
from fsdp2.traced._gather import _Layout, _Plan, _rows, arm
from fsdp2.traced._module import _PLAN, _SLOTS, TracedModule, _traced_class


def _owned(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``root``'s modules whose parameters this call manages: not those under an earlier
    call's root (their parameters are sharded already)."""
    out, seen, stack = [], set(), [("", root)]
    while stack:
        path, mod = stack.pop()
        if id(mod) in seen or (mod is not root and hasattr(mod, _PLAN)):
            continue
        seen.add(id(mod))
        out.append((path, mod))
        for name, child in reversed(list(mod.named_children())):
            stack.append((f"{path}.{name}" if path else name, child))
    return out


def _check(
    module: nn.Module,
    mesh: DeviceMesh,
    reshard_after_forward: Any,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
) -> None:
    where = f"fully_shard_traced({type(module).__name__})"
    if isinstance(module, TracedModule):
        raise ValueError(f"{where}: the module is sharded by fully_shard_traced already")
    for path, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            what = "the module" if not path else f"its submodule {path!r}"
            raise ValueError(
                f"{where}: {what} is sharded by fsdp2.fully_shard already; the two modes do "
                "not mix in one model: shard every module with one of them"
            )
    try:  # fully_shard's mesh rules: 1D FSDP, or 2D HSDP with mesh_dim_names
        mesh_info(mesh)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None
    if not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"{where}: reshard_after_forward must be True or False in the traced mode, "
            f"got {reshard_after_forward!r} (no smaller-mesh copy yet)"
        )
    if mp_policy.grad_dtype is not None:
        raise NotImplementedError(f"{where}: MixedPrecisionPolicy.grad_dtype is not traced yet")
    if type(offload_policy) is not OffloadPolicy:
        raise NotImplementedError(f"{where}: offload_policy is not supported in the traced mode")


def _placed(
    fn: Callable[[nn.Parameter], Any] | None,
    p: nn.Parameter,
    fqn: str,
    mesh: DeviceMesh,
    name: str,
) -> _Layout:
    """A plain parameter's layout from ``shard_placement_fn``: ``None`` or ``Shard(dim)``
    (``fully_shard``'s rules: in range; even on a dim other than 0) or ``Replicate()``
    (whole on every rank of ``mesh``, its gradient all-reduced)."""
    placement = fn(p) if fn is not None else None
    if isinstance(placement, Replicate):
        return _Layout(p.shape, replicated=True)
    if placement is not None and not isinstance(placement, Shard):
        what = type(placement).__name__
        raise NotImplementedError(
            f"fully_shard_traced({name}): shard_placement_fn returned a {what} for {fqn!r}; "
            "the traced mode takes Shard(dim), Replicate() or None (no per-parameter meshes)"
        )
    try:  # fully_shard's rules for the dim
        dim = _shard_dim(placement, p, fqn, mesh_info(mesh), name)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("fully_shard(", "fully_shard_traced(", 1)) from None
    return _Layout(p.shape, dim=dim)


def _traced_tp_mesh(p: DTensor, mesh: DeviceMesh, fqn: str) -> DeviceMesh:
    """``fully_shard``'s rule for a TP parameter's mesh. See [Note: traced tensor parallel]."""
    try:
        return dp_tp_mesh(mesh, p, fqn)
    except ValueError as e:
        raise ValueError(f"fully_shard_traced: {e}") from e.__cause__


def _shard_tp(p: DTensor, plan: _Plan, cat: DeviceMesh, dp_ndim: int) -> tuple[DTensor, _Layout]:
    """Split a TP parameter's local tensor over the data-parallel shard dim: a DTensor on
    the concatenated mesh, of eager ``fully_shard``'s placements."""
    local = p.to_local().detach()
    per_rank, held = _rows(plan, local.shape[0])
    start = min(plan.rank * per_rank, local.shape[0])
    rows = local[start : start + held].clone()
    split = 1  # TP sharding dim 0 too: FSDP's rows are strided over the global rows
    for placement, size in zip(p.placements, p.device_mesh.shape, strict=True):
        if isinstance(placement, Shard) and placement.dim == 0:
            split *= size
    inner: Placement = _StridedShard(0, split_factor=split) if split > 1 else Shard(0)
    dp: list[Placement] = [inner] if dp_ndim == 1 else [Replicate(), inner]
    placements = (*dp, *p.placements)
    dt = DTensor.from_local(
        rows, cat, placements, run_check=False, shape=p.shape, stride=p.stride()
    )
    tp = (p.device_mesh, tuple(p.placements), p.shape, p.stride())
    return dt, _Layout(local.shape, tp)


def fully_shard_traced(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008  (frozen)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008  (frozen)
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters for ``torch.compile(fullgraph=True)``: the all-gathers
    and reduce-scatters are functional collectives in the traced graphs.

    Like ``fsdp2.fully_shard``: call it on each block, then on the root; every parameter
    of ``module`` not managed by an earlier call becomes a DTensor of eager
    ``fully_shard``'s placements on the same mesh (``Shard(0)``; ``(Replicate(), Shard(0))``
    on a 2D HSDP mesh; for a tensor-parallel DTensor, the (dp, tp) mesh and placements
    ``fully_shard`` gives it), so ``named_parameters()``, ``state_dict()`` and the
    optimizer see the same DTensors as with eager ``fully_shard``. Inside the forward of
    the module this call was made on, reading a managed parameter through its module
    (``module.weight``) all-gathers it over the mesh's shard dim (cast to
    ``mp_policy.param_dtype`` first; a tensor-parallel one comes back as a DTensor on its TP
    mesh), a collective every rank must make; a parameter registered on several modules
    (tied) is gathered once per forward. Its gradient is reduce-scattered in
    ``reduce_dtype`` over the shard dim, all-reduced over the replicate dim (HSDP) and
    averaged over both. Outside that forward the read returns the sharded DTensor, as with
    ``fully_shard``. ``module.set_requires_gradient_sync(False)`` accumulates unsharded
    gradients without communicating until a synced backward (set it before the forward).

    Args:
        module: the module to shard; its class is swapped for a ``TracedModule``
            subclass (its forward casts inputs and outputs per ``mp_policy``).
        mesh: a 1D mesh (FSDP), or a 2D mesh with ``mesh_dim_names`` (HSDP: dim 0
            replicates, dim 1 shards); default: the world, as ``fully_shard``. For tensor
            parallelism, the data-parallel mesh (``mesh["dp"]``), the parameters being
            DTensors on another dimension of its root (``mesh["tp"]``).
        reshard_after_forward: ``True``: when compiled, backward all-gathers again (the
            gather is recomputed, not saved); ``False``: the unsharded parameters are saved
            for backward. Eager (uncompiled) calls always save them.
        shard_placement_fn: as ``fully_shard``'s for plain parameters: ``Shard(dim)`` (even
            on a dim other than 0), ``Replicate()`` (whole on every rank, the gradient
            all-reduced) or ``None`` (``Shard(0)``); per-parameter meshes
            (``ShardPlacementResult``) and other placements for tensor-parallel parameters
            raise ``NotImplementedError``.
        ignored_params: parameters left as they are, as ``fully_shard``'s: not sharded, not
            gathered, their gradients not reduced.
        mp_policy: ``param_dtype``, ``reduce_dtype``, ``output_dtype``,
            ``cast_forward_inputs`` as in ``fully_shard``; ``grad_dtype`` not yet.
        offload_policy: only ``OffloadPolicy()`` (no offload).

    Returns:
        ``module``, sharded in place.

    Raises:
        NotImplementedError: a feature the traced mode does not have yet (offloading,
            0-dim parameters not placed ``Replicate()``, per-parameter meshes, ...),
            before any collective.
        ValueError: ``module`` is sharded already (by either mode); a mesh of more than 2
            dims, or a 2D one without ``mesh_dim_names``; a DTensor parameter on a mesh
            that is no other dimension of ``mesh``'s root, or ``Partial``.
    """
    mesh = default_mesh() if mesh is None else mesh
    try:
        ignored = _check_ignored(ignored_params)  # fully_shard's rules
    except TypeError as e:
        raise TypeError(f"fully_shard_traced({type(module).__name__}): {e}") from None
    _check(module, mesh, reshard_after_forward, mp_policy, offload_policy)
    owners = _owned(module)
    tp_meshes: dict[int, DeviceMesh] = {}  # id(parameter) -> the concatenated (dp, tp) mesh
    layouts: dict[int, _Layout] = {}  # id(parameter) -> its layout, for the plain ones
    for path, mod in owners:
        for name, p in mod._parameters.items():
            if p is None or id(p) in ignored:
                continue
            fqn = f"{path}.{name}" if path else name
            value: torch.Tensor = p  # a Parameter, or one wrapping a DTensor (TP)
            if isinstance(value, DTensor):
                tp_meshes[id(p)] = _traced_tp_mesh(value, mesh, fqn)
                if shard_placement_fn is not None and shard_placement_fn(p) is not None:
                    raise NotImplementedError(
                        f"fully_shard_traced: parameter {fqn!r} is tensor parallel; the "
                        "traced mode shards those on dim 0 only: return None for it from "
                        "shard_placement_fn"
                    )
            else:
                layouts[id(p)] = _placed(shard_placement_fn, p, fqn, mesh, type(module).__name__)
            if p.dim() == 0 and not (id(p) in layouts and layouts[id(p)].replicated):
                raise NotImplementedError(
                    f"fully_shard_traced: parameter {fqn!r} is 0-dim; the traced mode "
                    "shards none: keep it whole with shard_placement_fn returning Replicate()"
                )
    plan = _Plan(type(module).__name__, mesh, reshard_after_forward, mp_policy)
    slots: dict[int, int] = {}  # a tied parameter is sharded once, and has one slot
    for path, mod in owners:
        names: dict[str, int] = {}
        for name, p in list(mod._parameters.items()):
            if p is None or id(p) in ignored:
                continue
            if id(p) not in slots:
                plan.homes.append([])
                plan.fqns.append(f"{path}.{name}" if path else name)
                value = p
                if isinstance(value, DTensor):
                    dt, layout = _shard_tp(value, plan, tp_meshes[id(p)], mesh.ndim)
                else:
                    layout = layouts[id(p)]
                    dp: Placement = Replicate() if layout.replicated else Shard(layout.dim)
                    placed = [dp] if mesh.ndim == 1 else [Replicate(), dp]  # as fully_shard
                    dt = distribute_tensor(p.detach(), mesh, placed)
                slots[id(p)] = len(plan.params)
                plan.layouts.append(layout)
                plan.accs.append(None)
                arm(plan, slots[id(p)], nn.Parameter(dt, requires_grad=p.requires_grad))
            elif slots[id(p)] not in plan.tied:
                plan.tied.append(slots[id(p)])
            mod._parameters[name] = plan.params[slots[id(p)]]  # type: ignore[assignment]
            names[name] = slots[id(p)]
            plan.homes[slots[id(p)]].append((mod, name))
        root = mod is module
        if names or root:
            object.__setattr__(mod, _PLAN, plan)
            object.__setattr__(mod, _SLOTS, names)
            mod.__class__ = _traced_class(type(mod), tuple(names), root)
    return module
