"""FSDP1 migration layer: FSDP1's configuration vocabulary and ``shard_model``, which turns a
``FullyShardedDataParallel(model, ...)`` call into ``fully_shard`` calls.

Import it as a submodule (``from fsdp2.fsdp1 import shard_model, ShardingStrategy``); the core
never imports it. The names and fields follow FSDP1's ``api`` module (torch 2.13), but
the classes are our own. See [Note: FSDP1 mapping].

[Note: FSDP1 mapping]
``shard_model`` calls ``fully_shard`` on every wrap unit the policy selects, children before
parents (post-order), then on the root, so each unit is one parameter group as in FSDP1.

* ``FULL_SHARD`` / ``SHARD_GRAD_OP``: 1D mesh, ``reshard_after_forward`` ``True`` / ``False``.
* ``NO_SHARD``: 2D mesh ``(world, 1)`` named ``("replicate", "shard")``: every rank keeps the
  whole parameters and gradients are all-reduced.
* ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``: 2D mesh ``(world // ranks_per_node,
  ranks_per_node)``; ranks per node from ``device_mesh`` (2D) or ``LOCAL_WORLD_SIZE``;
  ``reshard_after_forward`` ``True`` / ``False``.
* ``MixedPrecision``: ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` with
  ``cast_forward_inputs`` for non-root units and ``cast_root_forward_inputs`` for the root;
  ``buffer_dtype`` casts the floating-point buffers once, in place; modules of
  ``_module_classes_to_ignore`` become their own units with full precision (their inputs are
  cast to their parameters' dtype), as FSDP1 wraps them separately without mixed precision.
* ``CPUOffload(offload_params=True)``: ``CPUOffloadPolicy(pin_memory=<accelerator available>)``.
* ``BackwardPrefetch.BACKWARD_PRE``, ``BACKWARD_POST`` and ``None``: fsdp2's implicit backward
  prefetch (the previous unit in post-forward order), which is what ``BACKWARD_PRE`` does;
  ``BACKWARD_POST`` has no separate schedule.
* ``forward_prefetch=True``: each unit (in ``model.modules()`` order, root first) prefetches the
  next one with ``set_modules_to_forward_prefetch``. FSDP1 records the order of the first
  iteration instead; for models that run their units in definition order it is the same.
* ``ignored_modules``: their parameters are passed as ``ignored_params`` to every call; the
  modules are neither wrapped nor descended into.
"""

from __future__ import annotations

import enum
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ._fsdp1_state import (
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
    _as_enum,
    _device_type,
    get_state_dict,
    load_state_dict,
    strip_fsdp1_prefixes,
    summon_full_params,
)
from .api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .fully_shard import FSDPModule, fully_shard

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
    "load_state_dict",
    "shard_model",
    "size_based_policy",
    "strip_fsdp1_prefixes",
    "summon_full_params",
]

_E = TypeVar("_E", bound=enum.Enum)
_V = TypeVar("_V")


class ShardingStrategy(enum.Enum):
    """How parameters, gradients and optimizer state are split (FSDP1's names)."""

    FULL_SHARD = enum.auto()  # shard everything; re-gather params in backward
    SHARD_GRAD_OP = enum.auto()  # shard everything; keep params gathered from forward to backward
    NO_SHARD = enum.auto()  # replicate (DDP-like): all-reduce gradients
    HYBRID_SHARD = enum.auto()  # FULL_SHARD within a node, replicate across nodes
    _HYBRID_SHARD_ZERO2 = enum.auto()  # SHARD_GRAD_OP within a node, replicate across nodes


class BackwardPrefetch(enum.Enum):
    """When backward all-gathers the next unit's parameters (FSDP1's names); both map to
    fsdp2's implicit backward prefetch, see [Note: FSDP1 mapping]."""

    BACKWARD_PRE = enum.auto()  # before the current unit's gradient computation
    BACKWARD_POST = enum.auto()  # after it (same schedule in fsdp2)


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP1's mixed precision configuration.

    Attributes:
        param_dtype: dtype of the gathered parameters used in forward and backward; ``None``
            keeps the original dtype.
        reduce_dtype: dtype of gradient reduction; ``None`` reduces in ``param_dtype``.
        buffer_dtype: dtype floating-point buffers are cast to (once, in place); ``None``
            leaves them alone.
        keep_low_precision_grads: FSDP1 keeps gradients in ``param_dtype``; fsdp2 always
            returns gradients in the sharded parameters' dtype, so ``True`` only warns.
        cast_forward_inputs: cast floating-point inputs of non-root units to ``param_dtype``.
        cast_root_forward_inputs: cast floating-point inputs of the root to ``param_dtype``.
        _module_classes_to_ignore: modules of these classes become their own units, kept in
            full precision.
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


@dataclass(frozen=True)
class _SizeBasedPolicy:
    min_num_params: int

    def __call__(self, module: nn.Module) -> bool:
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            return False  # no forward: fully_shard rejects containers
        return _nonwrapped_numel(module) >= self.min_num_params


def size_based_policy(min_num_params: int = int(1e8)) -> Callable[[nn.Module], bool]:
    """An auto-wrap policy (FSDP1's ``size_based_auto_wrap_policy``): wrap a module if its
    subtree holds at least ``min_num_params`` parameter elements not already in a wrapped
    unit below it (``shard_model`` visits children first). Shared parameters count once.
    ``nn.ModuleList``/``nn.ModuleDict`` are never selected (``fully_shard`` needs a forward);
    their parameters count toward the enclosing module."""
    if not isinstance(min_num_params, int) or min_num_params < 0:
        raise ValueError(
            f"size_based_policy: min_num_params must be an int >= 0, got {min_num_params!r}"
        )
    return _SizeBasedPolicy(min_num_params)


AutoWrapPolicy = set[type[nn.Module]] | frozenset[type[nn.Module]] | Callable[[nn.Module], bool]


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
        auto_wrap_policy: a set of module classes (FSDP1's ``ModuleWrapPolicy``), a
            ``size_based_policy(n)``, or any ``module -> bool``; ``None`` wraps only the root.
            Callables see modules children-first, after the wrapped children became
            ``FSDPModule``s.
        sharding_strategy: a ``ShardingStrategy`` (torch's enum of the same name is accepted).
        mixed_precision: a ``MixedPrecision`` or ``None`` (full precision).
        cpu_offload: ``CPUOffload(offload_params=True)`` offloads to CPU.
        backward_prefetch: ``BACKWARD_PRE``, ``BACKWARD_POST`` or ``None``: all use fsdp2's
            implicit backward prefetch.
        forward_prefetch: each unit explicitly prefetches the next one in forward.
        device_mesh: 1D for ``FULL_SHARD``/``SHARD_GRAD_OP``, 2D ``(replicate, shard)`` for the
            hybrid strategies; ``None`` builds one over the default process group.
        ignored_modules: modules whose parameters are left alone (not sharded, not reduced).

    Raises:
        ValueError: the world size does not split into nodes of ``LOCAL_WORLD_SIZE`` ranks, a
            mesh of the wrong dimension for the strategy, the root in ``ignored_modules``, a
            bad policy, or any error of ``fully_shard`` (e.g. a policy selecting a container).
        TypeError: arguments of the wrong type.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard_model: model must be an nn.Module, got {type(model).__name__}")
    strategy = _as_enum(ShardingStrategy, sharding_strategy, "sharding_strategy")
    if backward_prefetch is not None:
        _as_enum(BackwardPrefetch, backward_prefetch, "backward_prefetch")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            "shard_model: mixed_precision must be fsdp2.fsdp1.MixedPrecision, "
            f"got {type(mixed_precision).__name__}"
        )
    if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
        raise TypeError(
            "shard_model: cpu_offload must be fsdp2.fsdp1.CPUOffload, "
            f"got {type(cpu_offload).__name__}"
        )
    should_wrap = _policy_fn(auto_wrap_policy)
    ignored = set(ignored_modules or ())
    if model in ignored:
        raise ValueError("shard_model: the root module cannot be in ignored_modules")
    ignored_params = {p for m in ignored for p in m.parameters()}

    mesh = _mesh_for(strategy, device_mesh)
    reshard = strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
    offload: OffloadPolicy = OffloadPolicy()
    if cpu_offload is not None and cpu_offload.offload_params:
        offload = CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())

    mp = mixed_precision
    full_precision_classes: tuple[type[nn.Module], ...] = ()
    if mp is not None:
        full_precision_classes = tuple(mp._module_classes_to_ignore)
        if mp.keep_low_precision_grads:
            warnings.warn(
                "MixedPrecision.keep_low_precision_grads=True is ignored: fsdp2 returns "
                "gradients in the sharded parameters' dtype",
                stacklevel=2,
            )
        if mp.buffer_dtype is not None:
            _cast_buffers(model, mp.buffer_dtype, ignored, full_precision_classes)

    def shard(module: nn.Module, is_root: bool) -> None:
        mp_policy = MixedPrecisionPolicy()
        if isinstance(module, full_precision_classes):
            dtype = next((p.dtype for p in module.parameters()), None)
            mp_policy = MixedPrecisionPolicy(
                param_dtype=dtype, cast_forward_inputs=dtype is not None
            )
        elif mp is not None:
            cast = mp.cast_root_forward_inputs if is_root else mp.cast_forward_inputs
            mp_policy = MixedPrecisionPolicy(
                param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype, cast_forward_inputs=cast
            )
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=reshard,
            mp_policy=mp_policy,
            offload_policy=offload,
            ignored_params=ignored_params or None,
        )

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if child not in ignored:
                visit(child)
        if module is model or isinstance(module, FSDPModule):
            return
        if isinstance(module, full_precision_classes) or should_wrap(module):
            shard(module, is_root=False)

    visit(model)
    shard(model, is_root=True)

    if forward_prefetch:
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit, nxt in zip(units[:-1], units[1:], strict=True):
            unit.set_modules_to_forward_prefetch([nxt])
    return model


def _policy_fn(policy: object) -> Callable[[nn.Module], bool]:
    if policy is None:
        return lambda module: False
    if isinstance(policy, (set, frozenset)):
        classes = tuple(policy)
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise ValueError(
                    f"shard_model: auto_wrap_policy set must hold nn.Module classes, got {cls!r}"
                )
        return lambda module: isinstance(module, classes)
    if callable(policy):
        return policy
    raise ValueError(
        "shard_model: auto_wrap_policy must be None, a set of module classes, "
        f"size_based_policy(n) or a callable module -> bool, got {policy!r}"
    )


def _nonwrapped_numel(module: nn.Module) -> int:
    seen: set[int] = set()
    total = 0

    def walk(m: nn.Module) -> None:
        nonlocal total
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        for child in m.children():
            if not isinstance(child, FSDPModule):
                walk(child)

    walk(module)
    return total


def _cast_buffers(
    model: nn.Module,
    dtype: torch.dtype,
    ignored: set[nn.Module],
    full_precision_classes: tuple[type[nn.Module], ...],
) -> None:
    def walk(m: nn.Module) -> None:
        if m in ignored or isinstance(m, full_precision_classes):
            return
        for name, buf in m.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point():
                setattr(m, name, buf.to(dtype))
        for child in m.children():
            walk(child)

    walk(model)


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
            return device_mesh
        if device_mesh.ndim != want:
            raise ValueError(
                f"shard_model: {strategy.name} needs a {want}D device_mesh, got "
                f"{device_mesh.ndim}D (shape {tuple(device_mesh.shape)})"
            )
        if strategy is ShardingStrategy.NO_SHARD:
            if device_mesh.size() != dist.get_world_size():
                raise ValueError(
                    "shard_model: NO_SHARD with a 1D device_mesh must span the whole world "
                    f"({dist.get_world_size()} ranks), got {device_mesh.size()}; pass a 2D "
                    "(replicate, 1) mesh instead"
                )
            return init_device_mesh(
                device_mesh.device_type,
                (device_mesh.size(), 1),
                mesh_dim_names=("replicate", "shard"),
            )
        return device_mesh

    world = dist.get_world_size()
    device_type = _device_type()
    if strategy is ShardingStrategy.NO_SHARD:
        return init_device_mesh(device_type, (world, 1), mesh_dim_names=("replicate", "shard"))
    if not hybrid:
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
