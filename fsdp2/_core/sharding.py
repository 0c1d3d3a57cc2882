"""``fully_shard``: argument validation, finding the managed parameters,
building the group and state, swapping the class. The methods the sharded
modules gain live in ``module.py``."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, overload

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from fsdp2._core.clean_exit import install_exit_drain
from fsdp2._core.group import ParamGroup
from fsdp2._core.mesh import MeshInfo, default_mesh, mesh_info, spmd_mesh_info
from fsdp2._core.module import (
    FSDPModule,
    UnshardHandle,
    _fsdp_class,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from fsdp2._core.param import FSDPParam
from fsdp2._core.state import FSDPState, state_of
from fsdp2._core.state_dict import register_load_reshard, register_state_dict_hooks
from fsdp2._core.unsharded import install_optimizer_check
from fsdp2.api import (
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardPlacementResult,
    as_mixed_precision_policy,
    as_offload_policy,
)

__all__ = [
    "FSDPModule",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]

_OWNER_ATTR = "_fsdp2_managed_by"


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
) -> FSDPModule: ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> Any:
    """Shard ``module``'s parameters across ``mesh`` and train it data-parallel.

    Call it bottom-up: on each block, then on the root. One call makes one
    parameter *group*: the parameters of ``module``'s subtree minus those of
    submodules already sharded. Each group is all-gathered in one collective
    before its forward (and, if resharded, again before its backward) and its
    gradients are reduce-scattered in one collective after its backward.

    The module is changed in place: its class becomes ``FSDP<Class>`` (a
    subclass of both :class:`FSDPModule` and the original class) and each
    managed parameter is replaced by an ``nn.Parameter`` wrapping a
    :class:`~torch.distributed.tensor.DTensor` sharded on dim 0 (placements
    ``(Shard(0),)`` on a 1D mesh, ``(Replicate(), Shard(0))`` on a 2D HSDP
    mesh). 0-dim parameters are replicated (``Replicate()``). Uneven dim-0
    sizes are padded internally; ``p.full_tensor()`` is the original and
    ``p.to_local()`` this rank's ``torch.chunk`` piece. Buffers move to the
    mesh's device and stay unsharded. Outside forward and backward the
    registered parameters are always the sharded ones, so the optimizer,
    ``state_dict`` and gradient clipping see DTensors.

    Args:
        module: a module, or a list of modules to shard as one group (one
            all-gather for all of them). Containers without ``forward``
            (``nn.ModuleList``, ``nn.ModuleDict``) cannot be sharded themselves.
        mesh: 1D mesh (FSDP) or 2D mesh (HSDP: replicate x shard). ``None``
            builds a 1D mesh over the default process group.
        reshard_after_forward: ``True`` frees the unsharded parameters after
            forward and all-gathers again in backward; ``False`` keeps them
            until after backward; an ``int`` ``k`` (a divisor of the shard
            world size) keeps a copy sharded over ``k`` ranks, so the backward
            all-gather runs over ``k`` ranks. ``None`` (default): ``True``,
            except ``False`` for the root (whose backward comes first).
        shard_placement_fn: called with each managed parameter; returns
            ``None`` (shard on dim 0) or ``Shard(d)`` to shard on dim ``d``
            (e.g. the expert dim of MoE weights). ``d > 0`` needs
            ``shape[d]`` divisible by the shard world size.
        mp_policy: mixed precision, see :class:`MixedPrecisionPolicy`.
        offload_policy: see :class:`OffloadPolicy` / :class:`CPUOffloadPolicy`.
        ignored_params: parameters left as they are: not sharded, not moved,
            gradients not reduced.
        dp_mesh_dims: a :class:`DataParallelMeshDims` saying which dims of
            ``mesh`` are data parallel. ``mesh`` is then the full SPMD mesh
            (e.g. ``("dp", "tp")``) and every managed parameter must already be
            a DTensor on it with ``Replicate()`` on those dims (e.g. TP
            placements on ``"tp"``). ``shard`` names the dim(s) to shard over,
            ``replicate`` the dim(s) to replicate over (HSDP with ``shard``;
            without it, plain replication with all-reduced gradients); several
            names are flattened into one dim. The sharded parameters are
            DTensors on ``mesh`` with ``Shard(0)`` (``_StridedShard`` when a dim
            to its right also shards dim 0) on the shard dim, other placements
            kept; with several shard names, on ``mesh`` with those dims
            replaced by the flattened one. Same collectives as
            ``fully_shard(module, mesh=mesh["dp"])`` on TP parameters.

    Returns:
        ``module`` (or the list), now :class:`FSDPModule` instances.

    Raises:
        TypeError / ValueError: for bad arguments, modules already sharded,
            parameters shared with another group, mixed parameter dtypes.
    """
    modules = _check_modules(module)
    if dp_mesh_dims is not None:
        if mesh is None:
            raise ValueError(
                "fully_shard(dp_mesh_dims=...) needs mesh=, the full mesh with named dims "
                "that the parameters are DTensors on"
            )
        info = spmd_mesh_info(mesh, dp_mesh_dims)
    else:
        info = mesh_info(default_mesh() if mesh is None else mesh)
    post_forward = normalize_reshard_after_forward(reshard_after_forward, info.shard_size)
    mp_policy = as_mixed_precision_policy(mp_policy)  # torch's policies too, read by field
    offload_policy = as_offload_policy(offload_policy)
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(
            f"shard_placement_fn must be callable, got {type(shard_placement_fn).__name__}"
        )
    ignored = _check_ignored(ignored_params)
    name = _group_name(modules)
    found = _collect_params(modules, ignored, name)
    placed = _place(found, info, mesh, dp_mesh_dims, name, shard_placement_fn)
    layouts = list(placed.values())
    sizes = {g.shard_size for g, _ in layouts if g is not info}
    for size in sizes:  # a per-parameter mesh: validate against its own shard size
        _post_forward_quietly(reshard_after_forward, size, name)
    if len({g.device for g, _ in layouts} | {info.device}) > 1:
        devices = ", ".join(sorted({str(g.device) for g, _ in layouts} | {str(info.device)}))
        raise ValueError(
            f"fully_shard({name}): shard_placement_fn named meshes on different devices "
            f"({devices}); every mesh of one call must be on the call's device"
        )
    groups: list[ParamGroup] = []
    for group_info, entries in layouts:
        tag = _mesh_tag(group_info) if len(layouts) > 1 else ""
        params = [FSDPParam(fqn, owners, p, group_info, dim) for fqn, p, owners, dim in entries]
        originals = [p.sharded for p in params]
        group = ParamGroup(
            params,
            group_info,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=post_forward
            if group_info is info
            else _post_forward_quietly(reshard_after_forward, group_info.shard_size, name),
            name=name + tag,
            mesh_tag=tag,
        )
        register_state_dict_hooks(group)
        for orig in originals:  # sharing one with a later group is an error
            setattr(orig, _OWNER_ATTR, name)
        for fp in params:  # the sharded parameters too (fsdp2.muon's matrix-wise guard)
            setattr(fp.sharded, _OWNER_ATTR, name)
        groups.append(group)
    _move_buffers(modules, info.device)
    FSDPState(modules, groups, mp_policy, info.device, auto_reshard=reshard_after_forward is None)
    register_load_reshard(modules, groups)
    install_optimizer_check()  # see [Note: optimizers holding unsharded parameters]
    install_exit_drain()  # see [Note: clean exit]
    for m in modules:
        m.__class__ = _fsdp_class(type(m))
    return module


def normalize_reshard_after_forward(value: object, shard_size: int) -> bool | int:
    """Validate ``reshard_after_forward`` and map it to ``True``/``False`` or an
    int strictly between 1 and ``shard_size``."""
    if value is None or isinstance(value, bool):
        return True if value is None else value
    if not isinstance(value, int):  # ValueError, as torch's FSDP2 raises
        raise ValueError(f"reshard_after_forward must be a bool, an int or None, got {value!r}")
    if value < 1 or value > shard_size or shard_size % value:
        raise ValueError(
            f"reshard_after_forward={value} must divide the shard world size {shard_size} "
            "(e.g. the number of ranks per node); use True or False otherwise"
        )
    if value == 1:
        warnings.warn(
            "reshard_after_forward=1 keeps the full parameters after forward "
            "(same as False); pass False to say so",
            stacklevel=3,
        )
        return False
    return True if value == shard_size else value


def _post_forward_quietly(value: object, shard_size: int, name: str) -> bool | int:
    """``normalize_reshard_after_forward`` for one of a call's other meshes: warned once
    already, and errors name the call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return normalize_reshard_after_forward(value, shard_size)
        except ValueError as e:
            raise ValueError(
                f"fully_shard({name}): {e} (a mesh named by shard_placement_fn has "
                f"{shard_size} ranks to shard over)"
            ) from None


def _check_modules(module: object) -> list[nn.Module]:
    items: list[object] = list(module) if isinstance(module, (list, tuple)) else [module]
    if not items:
        raise ValueError("fully_shard got an empty list of modules")
    modules: list[nn.Module] = []
    for m in items:
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"fully_shard expects an nn.Module or a list of them, got {type(m).__name__}"
            )
        if type(m).forward is nn.Module.forward:
            raise ValueError(
                f"fully_shard cannot shard {type(m).__name__}: it has no forward, so its "
                "parameters would never be all-gathered. Shard its children instead, e.g. "
                "`for block in model.layers: fully_shard(block)`"
            )
        if state_of(m) is not None:
            raise ValueError(f"{type(m).__name__} is already sharded by fully_shard")
        modules.append(m)
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard got the same module twice in its list")
    return modules


def _check_ignored(ignored: object) -> set[int]:
    if ignored is None:
        return set()
    if not isinstance(ignored, (set, frozenset, list, tuple)):
        raise TypeError(f"ignored_params must be a set of parameters, got {type(ignored).__name__}")
    for p in ignored:
        if not isinstance(p, nn.Parameter):
            raise TypeError(
                f"ignored_params must hold nn.Parameter objects, got {type(p).__name__}"
            )
    return {id(p) for p in ignored}


def _group_name(modules: list[nn.Module]) -> str:
    names = [type(m).__name__ for m in modules]
    return names[0] if len(names) == 1 else "[" + ", ".join(names) + "]"


def _managed_modules(modules: list[nn.Module]) -> Iterable[tuple[str, nn.Module]]:
    """The subtrees of ``modules`` minus already-sharded submodules, with paths."""
    seen: set[int] = set()
    stack = [
        (f"[{i}]" if len(modules) > 1 else "", m) for i, m in reversed(list(enumerate(modules)))
    ]
    while stack:
        path, m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        yield path, m
        for child_name, child in reversed(list(m._modules.items())):
            if child is None or state_of(child) is not None:
                continue
            stack.append((f"{path}.{child_name}" if path else child_name, child))


def _collect_params(
    modules: list[nn.Module], ignored: set[int], name: str
) -> list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]]:
    """The parameters this call manages, each once: ``(fqn, parameter, owners)``."""
    by_id: dict[int, tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    for path, m in _managed_modules(modules):
        for pname, p in m._parameters.items():
            if p is None or id(p) in ignored:
                continue
            fqn = f"{path}.{pname}" if path else pname
            if id(p) in by_id:
                by_id[id(p)][2].append((m, pname))
                continue
            owner = p.__dict__.get(_OWNER_ATTR)
            if owner is not None:
                raise ValueError(
                    f"fully_shard({name}): parameter {fqn} is shared with fully_shard({owner}), "
                    "which already sharded it; put the modules that share it in one call: "
                    "fully_shard([a, b])"
                )
            by_id[id(p)] = (fqn, p, [(m, pname)])
    return list(by_id.values())


# [Note: per-parameter meshes]
# ``shard_placement_fn(param)`` may return a ``ShardPlacementResult`` (ours, or torch's,
# read by attribute) naming the mesh a parameter shards over. The call's parameters are
# then grouped by ``(shard process group, replicate process group)``, in the order they
# were found, and each group becomes a ``ParamGroup`` of its own with its own collectives
# (the state's ``Slot`` holds them all; see [Note: several groups] in step.py). A mesh is
# known by its object (with its ``dp_mesh_dims``): two mesh objects over the same process
# groups are an error (which one's placements would the group's DTensors carry?), as in
# torch. The call's own mesh is one of them, for parameters the function returns ``None``
# or a ``Shard`` for.

_Entry = tuple[str, nn.Parameter, list[tuple[nn.Module, str]], int]


def _place(
    found: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
    info: MeshInfo,
    mesh: DeviceMesh | None,
    dims: DataParallelMeshDims | None,
    name: str,
    fn: Callable[[nn.Parameter], Any] | None,
) -> dict[tuple[Any, ...], tuple[MeshInfo, list[_Entry]]]:
    """Each parameter's shard dim and mesh, grouped by process groups (see
    [Note: per-parameter meshes]). Raises before any collective."""
    if fn is None:  # every parameter on the call's mesh, dim 0
        entries = [(fqn, p, owners, 0) for fqn, p, owners in found]
        return {(info.shard_group, info.replicate_group): (info, entries)} if entries else {}
    infos: dict[tuple[int, Any], MeshInfo] = {}
    if mesh is not None:
        infos[(id(mesh), _dims_key(dims))] = info
    by_pgs: dict[tuple[Any, ...], tuple[MeshInfo, list[_Entry]]] = {}
    for fqn, p, owners in found:
        result = fn(p) if fn is not None else None
        placement, p_info = result, info
        if result is not None and not isinstance(result, Shard):
            placement, p_mesh, p_dims = _result_fields(result, fqn, name)
            key = (id(p_mesh), _dims_key(p_dims))
            known = infos.get(key)
            if known is None:
                known = infos[key] = _mesh_info_of(p_mesh, p_dims, fqn, name)
            p_info = known
        dim = _shard_dim(placement, p, fqn, p_info, name)
        pgs = (p_info.shard_group, p_info.replicate_group)
        entry = by_pgs.get(pgs)
        if entry is None:
            by_pgs[pgs] = (p_info, [(fqn, p, owners, dim)])
        elif entry[0] is not p_info:
            raise ValueError(
                f"fully_shard({name}): {fqn} shards over mesh {p_info.mesh}, a different mesh "
                f"object than {entry[0].mesh} over the same process groups (used by "
                f"{entry[1][0][0]}); return the same mesh object for every parameter of a "
                "process group"
            )
        else:
            entry[1].append((fqn, p, owners, dim))
    return by_pgs


def _dims_key(dims: Any) -> tuple[Any, ...] | None:
    """``dp_mesh_dims`` as a dict key (torch's ``DataParallelMeshDims`` is not hashable)."""
    if dims is None:
        return None
    return (getattr(dims, "shard", None), getattr(dims, "replicate", None))


def _result_fields(result: object, fqn: str, name: str) -> tuple[Any, DeviceMesh, Any]:
    """``(placement, mesh, dp_mesh_dims)`` of a ``ShardPlacementResult``: ours, or torch's
    (``placement`` and ``mesh_info``: its ``mesh``, or with ``dp_mesh_dims`` its
    ``spmd_mesh``)."""
    if isinstance(result, ShardPlacementResult):
        return result.placement, result.mesh, result.dp_mesh_dims
    mi = getattr(result, "mesh_info", None)
    if mi is None or not hasattr(result, "placement"):
        raise TypeError(
            f"fully_shard({name}): shard_placement_fn returned {result!r} for {fqn}; "
            "return None, a Shard(dim) or a fsdp2.ShardPlacementResult(placement, mesh)"
        )
    dims = getattr(mi, "dp_mesh_dims", None)
    if dims is not None:
        return result.placement, mi.spmd_mesh, dims
    p_mesh = mi.mesh
    shard, rep = getattr(mi, "shard_mesh_dim", None), getattr(mi, "replicate_mesh_dim", None)
    expected = (0, None) if p_mesh.ndim == 1 else (1, 0)
    if (shard, rep) != expected:
        raise ValueError(
            f"fully_shard({name}): shard_placement_fn returned a mesh info with "
            f"shard_mesh_dim={shard}, replicate_mesh_dim={rep} on a {p_mesh.ndim}D mesh for "
            f"{fqn}; fsdp2 shards over the last dim and replicates over dim 0 of a 2D mesh "
            "(FSDPMeshInfo(mesh, shard_mesh_dim=0) on a 1D mesh, HSDPMeshInfo(mesh, "
            "shard_mesh_dim=1, replicate_mesh_dim=0) on a 2D one)"
        )
    return result.placement, p_mesh, None


def _mesh_info_of(mesh: object, dims: Any, fqn: str, name: str) -> MeshInfo:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard({name}): the ShardPlacementResult for {fqn} names "
            f"{type(mesh).__name__} as its mesh; pass a DeviceMesh"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"fully_shard({name}): {fqn} shards over mesh {mesh}, which does not include "
            f"this rank ({dist.get_rank()}); every rank must name a mesh it belongs to "
            "(e.g. its row of the expert mesh)"
        )
    if dims is not None:
        return spmd_mesh_info(mesh, dims)
    return mesh_info(mesh)


def _mesh_tag(info: MeshInfo) -> str:
    """How messages and timeline lanes name one of a call's groups: by its mesh dims."""
    mesh = info.spmd.mesh if info.spmd is not None else info.mesh
    names = mesh.mesh_dim_names
    if info.spmd is not None and names is not None:
        names = tuple(names[i] for i in info.spmd.shard_dims + info.spmd.replicate_dims)
    if names:
        return f" (mesh {'/'.join(names)})"
    return f" (mesh {'x'.join(str(n) for n in mesh.shape)})"


def _shard_dim(placement: Any, p: nn.Parameter, fqn: str, info: MeshInfo, name: str) -> int:
    if placement is None or p.dim() == 0:
        return 0
    if not isinstance(placement, Shard):
        raise TypeError(
            f"fully_shard({name}): shard_placement_fn returned {placement!r} for {fqn}; "
            "return a Shard(dim) or None"
        )
    d = placement.dim + p.dim() if placement.dim < 0 else placement.dim
    if not 0 <= d < p.dim():
        raise ValueError(
            f"fully_shard({name}): Shard({placement.dim}) is out of range for {fqn} of shape "
            f"{tuple(p.shape)}"
        )
    if d != 0 and p.shape[d] % info.shard_size:
        raise ValueError(
            f"fully_shard({name}): {fqn} has size {p.shape[d]} on dim {d}, not divisible by "
            f"the shard world size {info.shard_size}; sharding on a dim other than 0 must be "
            "even (shard it on dim 0 instead, or pad the parameter)"
        )
    return d


def _move_buffers(modules: list[nn.Module], device: torch.device) -> None:
    for _, m in _managed_modules(modules):
        for bname, b in m._buffers.items():
            if b is not None and b.device != device and not b.is_meta:
                m._buffers[bname] = b.to(device)
