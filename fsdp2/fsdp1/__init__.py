"""FSDP1 migration layer: FSDP1's configuration vocabulary and ``shard_model``, which turns a
``FullyShardedDataParallel(model, ...)`` call into ``fully_shard`` calls.

Import it as a submodule (``from fsdp2.fsdp1 import shard_model, ShardingStrategy``); the core
never imports it. The names and fields follow FSDP1's ``api`` module (torch 2.13), but
the classes are our own; torch's FSDP1 enums, ``MixedPrecision``, ``CPUOffload`` and wrap
policies are accepted too (duck-typed: nothing here imports torch's FSDP1). See
[Note: FSDP1 mapping].

This module holds the configuration classes, ``shard_model`` and its meshes; the rest of the
layer, re-exported here: ``_wrap.py`` (auto-wrap policies), ``_mixed_precision.py``
(``MixedPrecision``'s hooks), ``_summon.py`` (``summon_full_params``), ``_state_dict.py``
(state dict types and configs, model state dicts; [Note: FSDP1 state dicts]),
``_state_dict_type.py`` (the ``state_dict_type`` context), ``_optim.py`` (optimizer state
dicts; [Note: FSDP1 optimizer state dicts]) and ``_collectives.py``. The
layer reaches the core only through fsdp2's public API and ``fsdp2._core.front.seam``.

[Note: FSDP1 mapping]
``shard_model`` calls ``fully_shard`` on every wrap unit the policy selects, children before
parents (post-order), then on the root, so each unit is one parameter group as in FSDP1.

* ``auto_wrap_policy``: the units are the modules FSDP1 wraps for the same policy. Policy
  objects (anything with FSDP1's ``_run_policy``: ``ModuleWrapPolicy``, ``CustomPolicy``) and
  sets of classes select modules up front; a ``CustomPolicy`` kwargs dict may override
  ``sharding_strategy`` (any strategy: a unit of another kind than the model's gets a mesh of
  its kind, e.g. ``NO_SHARD`` units replicated inside a ``FULL_SHARD`` model, or
  ``HYBRID_SHARD`` blocks under a ``FULL_SHARD`` root) and ``mixed_precision``.
  Policy functions ``(module, recurse, nonwrapped_numel)`` (detected by signature, partials
  included) run FSDP1's recursion: ``recurse=True`` asks whether to descend, ``recurse=False``
  whether to wrap, ``nonwrapped_numel`` is the subtree's parameter numel minus what its
  children wrapped; the root is never asked to wrap. With ``mixed_precision`` FSDP1 ORs the
  policy with "is a ``_module_classes_to_ignore`` module", which also makes it descend
  everywhere; so does ``shard_model``. A ``module -> bool`` callable is asked once per
  module, children first. ``ignored_modules`` and their subtrees are never selected.
* ``FULL_SHARD`` / ``SHARD_GRAD_OP``: 1D mesh, ``reshard_after_forward`` ``True`` / ``False``.
* ``NO_SHARD``: :func:`fsdp2.replicate` over a 1D mesh of every rank: every rank keeps the
  whole parameters (``Replicate()`` DTensors, read in place by forward) and gradients are
  all-reduced, as DDP does.
* ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``: 2D mesh ``(world // ranks_per_node,
  ranks_per_node)``; ranks per node from ``device_mesh`` (2D) or ``LOCAL_WORLD_SIZE``;
  ``reshard_after_forward`` ``True`` / ``False``.
* ``MixedPrecision``: ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` with
  ``cast_forward_inputs`` for non-root units and ``cast_root_forward_inputs`` for the root;
  ``buffer_dtype`` casts the floating-point buffers once, in place; modules of
  ``_module_classes_to_ignore`` become their own units with full precision (their inputs are
  cast to their parameters' dtype, their outputs back to the inputs' dtype), as FSDP1 wraps
  them separately without mixed precision; with no ``auto_wrap_policy`` FSDP1 does not, and
  neither does ``shard_model`` (they run in ``param_dtype`` in the root unit).
  ``keep_low_precision_grads``: hooks outside the core cast the sharded gradients to
  ``param_dtype`` after each backward and back before the next one accumulates, as FSDP1.
* ``CPUOffload(offload_params=True)``: ``CPUOffloadPolicy(pin_memory=<accelerator available>)``.
* ``BackwardPrefetch.BACKWARD_PRE`` / ``BACKWARD_POST``: fsdp2's implicit backward prefetch
  (the next unit in reverse post-forward order, as both FSDP1 modes pick), issued in the
  current unit's pre-backward for both (FSDP1 issues ``BACKWARD_POST``'s after the unit's
  gradient computation). ``None``: no backward prefetch (empty
  ``set_modules_to_backward_prefetch`` lists).
* ``forward_prefetch``: fsdp2's implicit forward prefetch already all-gathers, in each unit's
  pre-forward, the unit that ran after it in the previous forward: FSDP1's
  ``forward_prefetch=True`` schedule (the first iteration's order, nothing prefetched in the
  first iteration) for static models. Nothing explicit is set, for ``False`` either (FSDP1
  would not prefetch; fsdp2 still does).
* ``ignored_modules``: their parameters are passed as ``ignored_params`` to every call; the
  modules are neither wrapped nor descended into.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp2 import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    replicate,
)
from fsdp2._core.front.seam import comm_device_type
from fsdp2.fsdp1._mixed_precision import (
    LowPrecisionGrads,
    cast_buffers,
    cast_outputs_to_input_dtype,
    relax_grad_dtype,
)
from fsdp2.fsdp1._optim import init_optim_state, optim_state_dict, optim_state_dict_to_load
from fsdp2.fsdp1._state_dict import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    as_enum,
    get_state_dict,
    load_state_dict,
    strip_fsdp1_prefixes,
)
from fsdp2.fsdp1._state_dict_type import get_state_dict_type, set_state_dict_type, state_dict_type
from fsdp2.fsdp1._summon import summon_full_params
from fsdp2.fsdp1._wrap import (
    AutoWrapPolicy,
    post_order_wrap,
    recursive_wrap,
    resolve_policy,
    size_based_policy,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "get_state_dict",
    "get_state_dict_type",
    "init_optim_state",
    "load_state_dict",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "set_state_dict_type",
    "shard_model",
    "size_based_policy",
    "state_dict_type",
    "strip_fsdp1_prefixes",
    "summon_full_params",
]

_D = TypeVar("_D", bound="DataclassInstance")


class ShardingStrategy(enum.Enum):
    """How parameters, gradients and optimizer state are split (FSDP1's names)."""

    FULL_SHARD = enum.auto()  # shard everything; re-gather params in backward
    SHARD_GRAD_OP = enum.auto()  # shard everything; keep params gathered from forward to backward
    NO_SHARD = enum.auto()  # replicate (DDP-like): all-reduce gradients
    HYBRID_SHARD = enum.auto()  # FULL_SHARD within a node, replicate across nodes
    _HYBRID_SHARD_ZERO2 = enum.auto()  # SHARD_GRAD_OP within a node, replicate across nodes


class BackwardPrefetch(enum.Enum):
    """When backward all-gathers the next unit's parameters (FSDP1's names); ``None`` in
    ``shard_model`` turns backward prefetch off. See [Note: FSDP1 mapping]."""

    BACKWARD_PRE = enum.auto()  # before the current unit's gradient computation
    BACKWARD_POST = enum.auto()  # after it (fsdp2 issues it before, as BACKWARD_PRE)


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP1's mixed precision configuration.

    Attributes:
        param_dtype: dtype of the gathered parameters used in forward and backward; ``None``
            keeps the original dtype.
        reduce_dtype: dtype of gradient reduction; ``None`` reduces in ``param_dtype``.
        buffer_dtype: dtype floating-point buffers are cast to (once, in place); ``None``
            leaves them alone.
        keep_low_precision_grads: after each backward the sharded parameters' ``.grad`` is
            cast to ``param_dtype`` (the parameters stay in full precision, so the optimizer
            must accept that); it is cast back at the next backward, which accumulates in full
            precision. Reduction still runs in ``reduce_dtype``: this saves gradient memory
            between backward and ``zero_grad``, not communication.
        cast_forward_inputs: cast floating-point inputs of non-root units to ``param_dtype``.
        cast_root_forward_inputs: cast floating-point inputs of the root to ``param_dtype``.
        _module_classes_to_ignore: with an ``auto_wrap_policy``, modules of these classes become
            their own units, kept in full precision.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[nn.Module]] = field(
        default=(nn.modules.batchnorm._BatchNorm,)
    )

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise ValueError(
                    f"MixedPrecision.{name} must be None or a floating-point dtype, got {value!r}"
                )
        for cls in self._module_classes_to_ignore:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise TypeError(
                    "MixedPrecision._module_classes_to_ignore must hold nn.Module subclasses, "
                    f"got {cls!r}"
                )


@dataclass(frozen=True)
class CPUOffload:
    """FSDP1's CPU offload configuration.

    Attributes:
        offload_params: keep sharded parameters, gradients and optimizer state on the CPU.
    """

    offload_params: bool = False


def _as_config(cls: type[_D], value: object, what: str) -> _D:
    """``value`` if it is a ``cls``; torch's FSDP1 dataclass of the same name converted field
    by field (so FSDP1 objects can be passed while imports move over); else ``TypeError``."""
    if isinstance(value, cls):
        return value
    names = [f.name for f in fields(cls)]
    if type(value).__name__ == cls.__name__ and all(hasattr(value, n) for n in names):
        return cls(**{n: getattr(value, n) for n in names})
    raise TypeError(f"shard_model: {what} must be fsdp2.fsdp1.{cls.__name__}, got {value!r}")


def shard_model(
    model: nn.Module,
    *,
    auto_wrap_policy: AutoWrapPolicy | None = None,
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    mixed_precision: MixedPrecision | None = None,
    cpu_offload: CPUOffload | None = None,
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
    forward_prefetch: bool = False,
    device_mesh: DeviceMesh | None = None,
    ignored_modules: Iterable[nn.Module] | None = None,
) -> nn.Module:
    """Shard ``model`` in place as ``FullyShardedDataParallel(model, ...)`` with the same
    arguments would, using ``fully_shard``; returns ``model`` (now an ``FSDPModule``).

    Unlike FSDP1 no wrapper module is created: parameter names, ``model.state_dict()`` keys and
    attribute access are unchanged. See [Note: FSDP1 mapping] for how each argument maps.

    Args:
        model: the root module; ``torch.distributed`` must be initialized.
        auto_wrap_policy: selects the units, as FSDP1 does with the same policy: a set of
            module classes; torch's FSDP1 policy objects as they are (``ModuleWrapPolicy``,
            ``CustomPolicy``; a ``CustomPolicy`` dict may override ``sharding_strategy`` (a
            unit of another kind gets a mesh of its kind) and ``mixed_precision``); FSDP1 policy
            functions ``(module, recurse, nonwrapped_numel) -> bool`` (``functools.partial``
            of torch's ``size_based_auto_wrap_policy``, ``transformer_auto_wrap_policy``,
            ``lambda_auto_wrap_policy``, ``_or_policy``, or your own); ``size_based_policy(n)``;
            or any ``module -> bool``, asked children first, after the wrapped children became
            ``FSDPModule``s. ``None`` wraps only the root.
        sharding_strategy: a ``ShardingStrategy`` (torch's enum of the same name is accepted).
        mixed_precision: a ``MixedPrecision`` (or torch's) or ``None`` (full precision).
        cpu_offload: ``CPUOffload(offload_params=True)`` (or torch's) offloads to CPU.
        backward_prefetch: ``BACKWARD_PRE`` or ``BACKWARD_POST``: fsdp2's implicit backward
            prefetch; ``None``: no backward prefetch.
        forward_prefetch: accepted; fsdp2 always prefetches the unit that ran next in the
            previous forward (FSDP1's ``forward_prefetch=True`` schedule).
        device_mesh: 1D for ``FULL_SHARD``/``SHARD_GRAD_OP``/``NO_SHARD`` (replicated over
            it; a 2D ``(world, 1)`` mesh is taken too), 2D ``(replicate, shard)`` for the
            hybrid strategies; ``None`` builds one over the default process group.
        ignored_modules: modules whose parameters are left alone (not sharded, not reduced).

    Raises:
        ValueError: the world size does not split into nodes of ``LOCAL_WORLD_SIZE`` ranks, a
            mesh of the wrong dimension for the strategy, the root in ``ignored_modules``, a
            bad policy or ``CustomPolicy`` override, or any error of ``fully_shard`` (e.g. a
            policy selecting a container).
        TypeError: arguments of the wrong type.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard_model: model must be an nn.Module, got {type(model).__name__}")
    strategy = as_enum(ShardingStrategy, sharding_strategy, "sharding_strategy")
    if backward_prefetch is not None:
        as_enum(BackwardPrefetch, backward_prefetch, "backward_prefetch")
    mp = None
    if mixed_precision is not None:
        mp = _as_config(MixedPrecision, mixed_precision, "mixed_precision")
    if cpu_offload is not None:
        cpu_offload = _as_config(CPUOffload, cpu_offload, "cpu_offload")
    ignored_roots = set(ignored_modules or ())
    if model in ignored_roots:
        raise ValueError("shard_model: the root module cannot be in ignored_modules")
    ignored = {m for root in ignored_roots for m in root.modules()}  # as FSDP1: whole subtrees
    ignored_params = {p for m in ignored for p in m.parameters()}
    root_kwargs: dict[str, object] = {
        "sharding_strategy": sharding_strategy,
        "mixed_precision": mixed_precision,
        "cpu_offload": cpu_offload,
        "backward_prefetch": backward_prefetch,
        "forward_prefetch": forward_prefetch,
        "device_mesh": device_mesh,
    }
    targets, recursive = resolve_policy(auto_wrap_policy, model, ignored, root_kwargs)

    meshes = {_mesh_kind(strategy): _mesh_for(strategy, device_mesh)}

    def mesh_of(unit_strategy: ShardingStrategy) -> DeviceMesh:
        # a unit overriding the strategy with another kind: that kind's default mesh (made
        # when first needed, in the same order on every rank)
        kind = _mesh_kind(unit_strategy)
        if kind not in meshes:
            meshes[kind] = _mesh_for(unit_strategy, None)
        return meshes[kind]

    offload: OffloadPolicy = OffloadPolicy()
    if cpu_offload is not None and cpu_offload.offload_params:
        offload = CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())

    full_precision_classes: tuple[type[nn.Module], ...] = ()
    if mp is not None:
        if auto_wrap_policy is not None:  # FSDP1 applies them only when auto-wrapping
            full_precision_classes = tuple(mp._module_classes_to_ignore)
        if mp.buffer_dtype is not None:
            cast_buffers(model, mp.buffer_dtype, ignored, full_precision_classes)
    low_precision_grads: list[tuple[nn.Module, torch.dtype]] = []

    def shard(module: nn.Module, is_root: bool, overrides: dict[str, object]) -> None:
        unit_strategy, unit_mp = strategy, mp
        for key, value in overrides.items():
            if key == "sharding_strategy":
                unit_strategy = as_enum(ShardingStrategy, value, "sharding_strategy")
            elif key == "mixed_precision":
                unit_mp = None if value is None else _as_config(MixedPrecision, value, key)
            else:
                raise ValueError(
                    f"shard_model: auto_wrap_policy overrides {key!r} of "
                    f"{type(module).__name__}; only sharding_strategy and mixed_precision "
                    "overrides are supported"
                )
        mp_policy = MixedPrecisionPolicy()
        if isinstance(module, full_precision_classes):
            dtype = next((p.dtype for p in module.parameters()), None)
            mp_policy = MixedPrecisionPolicy(
                param_dtype=dtype, cast_forward_inputs=dtype is not None
            )
        elif unit_mp is not None:
            cast = unit_mp.cast_root_forward_inputs if is_root else unit_mp.cast_forward_inputs
            mp_policy = MixedPrecisionPolicy(
                param_dtype=unit_mp.param_dtype,
                reduce_dtype=unit_mp.reduce_dtype,
                cast_forward_inputs=cast,
            )
        low_precision = (
            unit_mp is not None
            and unit_mp.keep_low_precision_grads
            and unit_mp.param_dtype is not None
            and not isinstance(module, full_precision_classes)
        )
        if low_precision:  # gradients of another dtype than the parameters: declared now,
            relax_grad_dtype(module, ignored_params)  # as fully_shard captures the policy
        if unit_strategy is ShardingStrategy.NO_SHARD:
            replicate(
                module,
                mesh=mesh_of(unit_strategy),
                mp_policy=mp_policy,
                offload_policy=offload,
                ignored_params=ignored_params or None,
            )
        else:
            fully_shard(
                module,
                mesh=mesh_of(unit_strategy),
                reshard_after_forward=unit_strategy
                in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD),
                mp_policy=mp_policy,
                offload_policy=offload,
                ignored_params=ignored_params or None,
            )
        if isinstance(module, full_precision_classes):
            cast_outputs_to_input_dtype(module)
        if low_precision:
            assert unit_mp is not None and unit_mp.param_dtype is not None
            low_precision_grads.append((module, unit_mp.param_dtype))

    if recursive is not None:
        recursive_wrap(model, recursive, mp is not None, full_precision_classes, ignored, shard)
    else:
        assert targets is not None
        if mp is not None:  # FSDP1 wraps these on their own, whatever the policy
            for m in model.modules():
                if m not in ignored and isinstance(m, full_precision_classes):
                    targets.setdefault(m, {})
        post_order_wrap(model, targets, ignored, shard)
    shard(model, True, {})

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if backward_prefetch is None:
        for unit in units:
            unit.set_modules_to_backward_prefetch([])
    if low_precision_grads:
        LowPrecisionGrads(model, low_precision_grads)
    return model


def _mesh_kind(strategy: ShardingStrategy) -> str:
    if strategy is ShardingStrategy.NO_SHARD:
        return "replicate"
    if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        return "hybrid"
    return "shard"


def _mesh_for(strategy: ShardingStrategy, device_mesh: DeviceMesh | None) -> DeviceMesh:
    if not dist.is_initialized():
        raise ValueError(
            "shard_model needs torch.distributed to be initialized: call "
            "torch.distributed.init_process_group() first"
        )
    hybrid = strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
    if device_mesh is not None:
        want = 2 if hybrid else 1
        if strategy is ShardingStrategy.NO_SHARD and device_mesh.ndim == 2:
            if device_mesh.size(1) != 1:
                raise ValueError(
                    "shard_model: NO_SHARD with a 2D device_mesh needs a shard dimension of size "
                    f"1, got shape {tuple(device_mesh.shape)}"
                )
            # the replicate dim alone: a 1D mesh over the same ranks
            return DeviceMesh.from_group(device_mesh.get_group(0), device_mesh.device_type)
        if device_mesh.ndim != want:
            raise ValueError(
                f"shard_model: {strategy.name} needs a {want}D device_mesh, got "
                f"{device_mesh.ndim}D (shape {tuple(device_mesh.shape)})"
            )
        if strategy is ShardingStrategy.NO_SHARD:
            if device_mesh.size() != dist.get_world_size():
                raise ValueError(
                    "shard_model: NO_SHARD with a 1D device_mesh must span the whole world "
                    f"({dist.get_world_size()} ranks), got {device_mesh.size()}"
                )
        return device_mesh

    world = dist.get_world_size()
    device_type = comm_device_type()
    if not hybrid:  # NO_SHARD too: replicate() over every rank
        return init_device_mesh(device_type, (world,))
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None:
        raise ValueError(
            f"shard_model: {strategy.name} needs the ranks per node: set LOCAL_WORLD_SIZE "
            "(torchrun does) or pass a 2D device_mesh=(replicate, shard)"
        )
    try:
        per_node = int(local)
    except ValueError:
        raise ValueError(f"shard_model: LOCAL_WORLD_SIZE must be an int, got {local!r}") from None
    if per_node < 1 or world % per_node != 0:
        raise ValueError(
            f"shard_model: {strategy.name} cannot split {world} ranks into nodes of "
            f"LOCAL_WORLD_SIZE={per_node} ranks; the world size must be a multiple of it "
            "(or pass a 2D device_mesh)"
        )
    return init_device_mesh(
        device_type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard")
    )
