"""fsdp2's modes for the models a framework shards (see [Note: modes in frameworks]).

# [Note: modes in frameworks]
# accelerate, the HF Trainer, Lightning and torchtitan shard the model, build the optimizer,
# accumulate and clip themselves, so a user cannot call ``set_deterministic(model)``,
# ``set_exchange_reduce(model, dtype)`` or ``shard_over_replicas(optimizer)`` at the right
# moment. ``use_fsdp2(deterministic=..., exchange_reduce=..., shard_over_replicas=...)``
# records the modes, and fsdp2 applies them where the framework's own calls pass:
# * every ``fully_shard`` / ``replicate`` through the switch: the model modes (the
#   deterministic reduction, the wire) on the module just sharded;
# * where the framework has built its optimizer from the sharded parameters (accelerate's
#   ``Accelerator._prepare_fsdp2``, which the HF Trainer uses too; Lightning's
#   ``Strategy.setup_optimizers`` and Fabric's ``Strategy.setup_optimizer``; torchtitan's
#   ``OptimizersContainer``): the model modes again (a model sharded by hand), the
#   checks of what the framework chose (a power-of-two accumulation count and world size for
#   the deterministic mode: ``ValueError`` naming its setting, before any collective), and
#   the optimizer wrapped for ``shard_over_replicas`` (its LR scheduler, built on the
#   framework's optimizer, drives the wrapper: they share ``param_groups``). The HF Trainer
#   accumulates itself and gives accelerate a count of 1, so its own
#   ``gradient_accumulation_steps`` is checked where it starts preparing
#   (``Trainer._prepare_for_training``);
# * the framework's gradient clipping (accelerate's ``clip_grad_norm_``, Lightning's
#   precision plugin and Fabric's strategy, torchtitan's ``clip_grad_norm_``) under the
#   deterministic mode: ``fsdp2.reduction.clip_grad_norm_``, whose norm is the same bits at
#   every world size. Under ``shard_over_replicas`` their own clipping is exact as it is
#   (the gradient pieces are the ``.grad``: [Note: pieces as .grad]).
# The patches are installed on the framework classes already imported when a mode is set,
# and again at each switched ``fully_shard`` (a framework imported later has imported
# itself by then), only while a mode is on; ``restore_torch_fsdp`` removes them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = [
    "Modes",
    "apply_to_model",
    "check_setup",
    "current",
    "deterministic_covers",
    "deterministic_modules",
    "exact_clip",
    "reset",
    "set_modes",
    "wrap_optimizer",
]


@dataclass(frozen=True)
class Modes:
    """The fsdp2 modes applied to models a framework shards (``use_fsdp2``'s arguments).

    Attributes:
        deterministic: ``fsdp2.reduction.set_deterministic`` on every module.
        exchange_reduce: the wire dtype of ``fsdp2.reduction.set_exchange_reduce`` (``None``:
            the default reduce-scatter).
        shard_over_replicas: the framework's optimizer wrapped by
            ``fsdp2.replica_optim.shard_over_replicas`` (HSDP meshes).
        elementwise: passed to ``shard_over_replicas`` for an optimizer class outside
            ``fsdp2.optim.ELEMENTWISE_OPTIMIZERS``.
    """

    deterministic: bool = False
    exchange_reduce: torch.dtype | None = None
    shard_over_replicas: bool = False
    elementwise: bool = False

    def on(self) -> bool:
        return self.deterministic or self.exchange_reduce is not None or self.shard_over_replicas


_MODES = Modes()


def current() -> Modes:
    """The modes in effect."""
    return _MODES


def set_modes(**changes: Any) -> Modes:
    """Change the modes named in ``changes`` (the others stay); refuse combinations fsdp2
    refuses on a model, before anything is sharded."""
    global _MODES
    new = replace(_MODES, **changes)
    if new.deterministic and new.exchange_reduce is not None:
        raise ValueError(
            "use_fsdp2: deterministic=True with exchange_reduce: the deterministic reduction "
            "sums in fp32 in one fixed order, and a low-precision wire would round each "
            "rank's partial sum, so the bits would change with the world size; choose one"
        )
    if new.deterministic and new.shard_over_replicas:
        raise ValueError(
            "use_fsdp2: deterministic=True with shard_over_replicas=True: the deterministic "
            "reduction does not shard gradients over the replicas yet; choose one"
        )
    if new.exchange_reduce is not None:
        from fsdp2.reduction import ExchangeReduceScatter

        ExchangeReduceScatter(new.exchange_reduce)  # a wire it does not know raises here
    _MODES = new
    return new


def reset() -> None:
    global _MODES
    _MODES = Modes()


# ---- what the modes do -------------------------------------------------------------------


def _fsdp_modules(model: Any) -> list[Any]:
    from fsdp2 import FSDPModule

    roots = model if isinstance(model, (list, tuple)) else [model]
    return [
        m
        for r in roots
        if isinstance(r, nn.Module)
        for m in r.modules()
        if isinstance(m, FSDPModule)
    ]


def apply_to_model(model: Any) -> None:
    """The model modes on every ``fully_shard`` module of ``model`` (a module or a list)
    that does not have them yet."""
    modes = _MODES
    modules = _fsdp_modules(model)
    if modes.deterministic:
        from fsdp2.reduction import set_deterministic

        for m in modules:
            if not all(g.reduce.exact for g in m._groups()):
                set_deterministic(m)
    if modes.exchange_reduce is not None:
        from fsdp2.reduction import ExchangeReduceScatter

        comm = ExchangeReduceScatter(modes.exchange_reduce)
        for m in modules:
            if any(g.reduce.comm is None for g in m._groups()):
                m.set_custom_reduce_scatter(comm)


def check_setup(model: Any, accumulation: int | None, setting: str) -> None:
    """What the framework chose must suit the modes: ``ValueError`` naming ``setting`` (its
    accumulation count) or the world size, before any collective."""
    if not _MODES.deterministic:
        return
    from fsdp2._core.comm.exact import is_power_of_two

    world = dist.get_world_size() if dist.is_initialized() else 1
    if accumulation is not None and world > 1 and not is_power_of_two(accumulation):
        raise ValueError(
            f"use_fsdp2(deterministic=True): {setting}={accumulation}; the deterministic "
            "reduction sums a power of two of micro-batches per rank (1, 2, 4, ...) to give "
            f"the same bits at every world size: set {setting} to one"
        )
    for m in _fsdp_modules(model):
        for g in m._groups():
            ranks = g.world * g.info.replicate_size
            if g.reduce.exact and g.reduce.divide_factor is None and not is_power_of_two(ranks):
                raise ValueError(
                    f"use_fsdp2(deterministic=True): {type(m).__name__} is sharded over "
                    f"{ranks} data-parallel ranks; the deterministic reduction divides the "
                    "summed gradient by them, exact only for a power of two: launch 1, 2, "
                    "4, ... data-parallel processes"
                )


def wrap_optimizer(optimizer: Any) -> Any:
    """``optimizer`` wrapped by ``shard_over_replicas`` when that mode is on and it steps
    parameters of HSDP modules; else itself."""
    if not _MODES.shard_over_replicas or not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    from fsdp2._core.support.unsharded import REPLICA_MARK, sharded_owners
    from fsdp2.replica_optim import shard_over_replicas

    if getattr(optimizer, REPLICA_MARK, False):
        return optimizer
    owners = sharded_owners()
    hsdp = any(
        id(p) in owners and owners[id(p)][0].info.replicate_group is not None
        for g in optimizer.param_groups
        for p in g["params"]
    )
    return shard_over_replicas(optimizer, elementwise=_MODES.elementwise) if hsdp else optimizer


def deterministic_covers(params: list[torch.Tensor]) -> bool:
    """Whether the deterministic mode is on and reduces one of ``params`` (so clipping them
    takes ``fsdp2.reduction.clip_grad_norm_``)."""
    if not _MODES.deterministic:
        return False
    from fsdp2._core.support.unsharded import sharded_of, sharded_owners

    owners = sharded_owners()
    for p in params:
        owner = owners.get(id(sharded_of(p)))
        if owner is not None and owner[0].reduce.exact:
            return True
    return False


def deterministic_modules(model: Any) -> list[Any]:
    """The ``fully_shard`` modules of ``model`` that reduce deterministically, when the mode
    is on (a framework's accumulation then skips their reduction but on the last
    micro-batch)."""
    if not _MODES.deterministic or not isinstance(model, nn.Module):
        return []
    return [m for m in _fsdp_modules(model) if any(g.reduce.exact for g in m._groups())]


def exact_clip(
    params: list[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """The framework's clipping under the deterministic mode: the norm that is the same
    bits at every world size."""
    from fsdp2.reduction import clip_grad_norm_

    return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
