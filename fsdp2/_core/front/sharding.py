"""``fully_shard``: argument validation, finding the managed parameters,
building the group and state, swapping the class. The methods the sharded
modules gain live in ``module.py``."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, overload

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp2._core.front.module import (
    FSDPModule,
    GradientReductionHandle,
    UnshardHandle,
    _fsdp_class,
)
from fsdp2._core.front.offload import by_offload, offload_policies
from fsdp2._core.front.state_dict import register_load_reshard, register_state_dict_hooks
from fsdp2._core.params.group import ParamGroup
from fsdp2._core.params.param import FSDPParam
from fsdp2._core.params.placement import mesh_tag, place
from fsdp2._core.runtime.slot import TrainingState
from fsdp2._core.runtime.state import FSDPState, state_of
from fsdp2._core.support.clean_exit import install_exit_drain
from fsdp2._core.support.mesh import MeshInfo, default_mesh, mesh_info, spmd_mesh_info
from fsdp2._core.support.pipeline import maybe_enable
from fsdp2._core.support.unsharded import install_optimizer_check
from fsdp2.api import (
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    as_mixed_precision_policy,
)

__all__ = [
    "FSDPModule",
    "GradientReductionHandle",
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
    offload_policy: OffloadPolicy | Mapping[str, OffloadPolicy] = ...,
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
    offload_policy: OffloadPolicy | Mapping[str, OffloadPolicy] = ...,
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
    offload_policy: OffloadPolicy | Mapping[str, OffloadPolicy] = OffloadPolicy(),
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
        offload_policy: see :class:`OffloadPolicy` / :class:`CPUOffloadPolicy`; or a
            mapping from parameter names (relative to ``module``, as its
            ``named_parameters()`` names them; for a list, relative to each module of
            it) to policies: names absent are not offloaded, a name that is no parameter
            of this call (a submodule's already sharded, an ignored one) raises
            ``ValueError``. Each policy gets a group of its own (its own collectives).
            :func:`cpu_offload_by_budget` builds such a mapping.
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
    modules = check_modules(module)
    if dp_mesh_dims is not None:
        if mesh is None:
            raise ValueError(
                "fully_shard(dp_mesh_dims=...) needs mesh=, the full mesh with named dims "
                "that the parameters are DTensors on"
            )
        info = spmd_mesh_info(mesh, dp_mesh_dims)
    else:
        info = mesh_info(default_mesh() if mesh is None else mesh)
    shard_modules(
        modules,
        info,
        mesh=mesh,
        dp_mesh_dims=dp_mesh_dims,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        make_class=_fsdp_class,
    )
    maybe_enable()  # torch's pipeline schedules: see [Note: stages under torch's schedules]
    return module


def shard_modules(
    modules: list[nn.Module],
    info: MeshInfo,
    *,
    mesh: DeviceMesh | None,
    dp_mesh_dims: DataParallelMeshDims | None,
    reshard_after_forward: bool | int | None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | Mapping[str, OffloadPolicy],
    ignored_params: set[nn.Parameter] | None,
    make_class: Callable[[type], type],
) -> None:
    """What ``fully_shard`` and ``replicate`` share once the mesh is known: the groups,
    the state, the hooks and the class swap (``make_class`` of each module's class)."""
    post_forward = normalize_reshard_after_forward(reshard_after_forward, info.shard_size)
    mp_policy = as_mixed_precision_policy(mp_policy)  # torch's policies too, read by field
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(
            f"shard_placement_fn must be callable, got {type(shard_placement_fn).__name__}"
        )
    ignored = _check_ignored(ignored_params)
    name = _group_name(modules)
    found = _collect_params(modules, ignored, name)
    default, by_param = offload_policies(offload_policy, modules, found, ignored, name, _OWNER_ATTR)
    placed = place(found, info, mesh, dp_mesh_dims, name, shard_placement_fn)
    layouts = list(placed.values())
    for g, _ in layouts:  # a per-parameter mesh: validate against its own shard size
        if g is not info:
            _other_post_forward(reshard_after_forward, g, name)
    if len({g.device for g, _ in layouts} | {info.device}) > 1:
        devices = ", ".join(sorted({str(g.device) for g, _ in layouts} | {str(info.device)}))
        raise ValueError(
            f"fully_shard({name}): shard_placement_fn named meshes on different devices "
            f"({devices}); every mesh of one call must be on the call's device"
        )
    groups: list[ParamGroup] = []
    # a group per mesh and offload policy (see [Note: offload by name] in offload.py)
    parts = [
        (group_info, part, policy, (mesh_tag(group_info) if len(layouts) > 1 else "") + otag)
        for group_info, entries in layouts
        for policy, part, otag in by_offload(entries, default, by_param)
    ]
    for group_info, entries, policy, tag in parts:
        params = [FSDPParam(fqn, owners, p, group_info, dim) for fqn, p, owners, dim in entries]
        originals = [p.sharded for p in params]
        group = ParamGroup(
            params,
            group_info,
            mp_policy=mp_policy,
            offload_policy=policy,
            reshard_after_forward=post_forward
            if group_info is info
            else _other_post_forward(reshard_after_forward, group_info, name),
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
        m.__class__ = make_class(type(m))


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


def _other_post_forward(value: object, info: MeshInfo, name: str) -> bool | int:
    """``reshard_after_forward`` for a group on another mesh than the call's: as given,
    except that a replicated group (one shard rank) takes an int as ``True``."""
    if info.shard_size == 1 and isinstance(value, int) and not isinstance(value, bool):
        return True
    return _post_forward_quietly(value, info.shard_size, name)


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


def check_modules(module: object, what: str = "fully_shard") -> list[nn.Module]:
    """The modules of a ``fully_shard`` / ``replicate`` call, checked (``what`` names the
    call in errors)."""
    items: list[object] = list(module) if isinstance(module, (list, tuple)) else [module]
    if not items:
        raise ValueError(f"{what} got an empty list of modules")
    modules: list[nn.Module] = []
    for m in items:
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"{what} expects an nn.Module or a list of them, got {type(m).__name__}"
            )
        if type(m).forward is nn.Module.forward:
            verb = "shard" if what == "fully_shard" else "replicate"
            raise ValueError(
                f"{what} cannot {verb} {type(m).__name__}: it has no forward, so fsdp2 would "
                "never see its parameters used. Apply it to its children instead, e.g. "
                f"`for block in model.layers: {what}(block)`"
            )
        if state_of(m) is not None:
            by = getattr(m, "_fsdp2_api", "fully_shard")
            done = "replicated by replicate" if by == "replicate" else "sharded by fully_shard"
            raise ValueError(
                f"{type(m).__name__} is already {done}; {what} applies once per module (a "
                "module is either sharded or replicated)"
            )
        modules.append(m)
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError(f"{what} got the same module twice in its list")
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


def _move_buffers(modules: list[nn.Module], device: torch.device) -> None:
    for _, m in _managed_modules(modules):
        for bname, b in m._buffers.items():
            if b is not None and b.device != device and not b.is_meta:
                m._buffers[bname] = b.to(device)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (e.g. ``generate``) run with unsharded
    parameters, like ``forward``: the pre/post-forward logic wraps it. A no-op
    on modules that are not :class:`FSDPModule`.

    Raises:
        ValueError: ``module`` has no such method.
    """
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r} to register")
    orig = getattr(module, method_name)
    state = state_of(module)
    assert state is not None

    @functools.wraps(orig)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward(module, args, kwargs)
        out = orig(*args, **kwargs)
        if state.groups and state.slot.training_state is TrainingState.IDLE:
            # The method called the module's own forward (Hugging Face's generate on the
            # root): that forward's end already ended this one (resharded, registered the
            # backward, ended the root's forward), as torch's FSDP2 leaves it.
            return state._cast_output(out)
        return state._post_forward(module, args, out)

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Make several FSDP roots (e.g. pipeline-parallel stages) share
    communication resources. fsdp2 owns no streams or buffers per root (c10d
    runs collectives on the process group's streams), so this only validates.

    Raises:
        ValueError: an element is not an :class:`FSDPModule`.
    """
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"share_comm_ctx expects FSDP modules, got {type(m).__name__}")
