"""Gradient clipping over gradients that live on several meshes.

``torch.nn.utils.clip_grad_norm_`` stacks every gradient's norm in one op, and
DTensor ops cannot mix meshes: with tensor parallelism, parameters that TP
leaves alone (e.g. norms without sequence parallel) have gradients on the
data-parallel mesh while the rest live on the ``(dp, tp)`` mesh, and torch's
function raises. This one reduces each mesh's norm separately, combines the
plain results, and scales each mesh's gradients with one foreach op.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from fsdp2._core.replicas.piece_state import Slot, clip_slots
from fsdp2._core.support.unsharded import any_replica_sharded, sharded_of, sharded_owners

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` (DTensors on any meshes, or plain
    tensors) to a total ``norm_type`` norm of at most ``max_norm``, in place.

    Same arguments as ``torch.nn.utils.clip_grad_norm_``. Returns the total
    norm before clipping as a plain tensor, equal on every rank (the norm over
    the full, unsharded gradients). Every rank must call it (it communicates).
    ``model.parameters()`` may be taken at any point of a step: where a group
    registers its unsharded parameters (``set_reshard_after_backward(False)``,
    ``unshard()``), their sharded parameters' gradients are clipped, the ones the
    optimizer steps with (``torch.nn.utils.clip_grad_norm_`` would miss them). The
    gradients that ``fsdp2.replica_optim`` keeps in pieces over HSDP's replicas count too.
    """
    params = sharded_params(parameters)
    if any_replica_sharded():  # gradients held in pieces by fsdp2.replica_optim
        owners = sharded_owners()
        if any(id(p) in owners and owners[id(p)][0].reduce.replica_shard for p in params):
            slots = [Slot(p, owners.get(id(p))) for p in params]
            return clip_slots(slots, max_norm, norm_type, error_if_nonfinite, foreach)
    by_mesh = by_grad_mesh(params)
    if not by_mesh:
        return torch.tensor(0.0)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in group if p.grad is not None], norm_type, error_if_nonfinite, foreach
        )
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.nn.utils.get_total_norm(norms, norm_type, error_if_nonfinite, foreach)
    clip_with_norm(by_mesh, max_norm, total, foreach)
    return total


def sharded_params(parameters: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``parameters`` as the sharded parameters behind them (registered temporaries mapped
    to theirs), each once, in order."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    return list({id(s): s for s in map(sharded_of, params)}.values())


def by_grad_mesh(params: list[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """The parameters with a gradient, by their gradient's mesh (``None``: plain)."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(p)
    return by_mesh


def clip_with_norm(
    by_mesh: dict[object, list[torch.Tensor]],
    max_norm: float,
    total: torch.Tensor,
    foreach: bool | None,
) -> None:
    """Scale each mesh's gradients by ``max_norm / total`` (at most 1): one foreach op each."""
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach)
