"""What a rank holds, counted for :func:`fsdp2.estimate_memory`: its shards' bytes, and the
parameters registered by more than one module (tied embeddings), which ``to_empty`` unties;
and the optimizer of ``estimate_memory(..., shard_over_replicas=True)``, whose gradients are
held in pieces over HSDP's replicas (each ``.grad`` a ``PieceGrad`` whose local tensor is
the piece, [Note: pieces as .grad] in fsdp2/_core/replicas/piece_grad.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


def over_replicas(
    build: Callable[[list[nn.Parameter]], torch.optim.Optimizer], mesh_shape: Any
) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """``build``'s optimizer wrapped by ``fsdp2.replica_optim.shard_over_replicas`` (one that
    is wrapped already, e.g. with ``elementwise=True``, is kept as it is), on an HSDP mesh."""
    from fsdp2.replica_optim import ReplicaShardedOptimizer, shard_over_replicas

    if isinstance(mesh_shape, int) or len(mesh_shape) != 2:
        raise ValueError(
            "estimate_memory: shard_over_replicas shards HSDP's gradients and optimizer state "
            f"over its replicas: it needs an HSDP mesh_shape (R, S), got {mesh_shape!r}"
        )

    def wrapped(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        opt = build(params)
        return opt if isinstance(opt, ReplicaShardedOptimizer) else shard_over_replicas(opt)

    return wrapped


def held(
    model: nn.Module, opt: torch.optim.Optimizer, only: Sequence[torch.Tensor] | None = None
) -> dict[str, int]:
    """The bytes of this rank's shards of the parameters, their gradients (or pieces of them)
    and the optimizer state (``MemoryEstimate.held``); tied parameters once. ``only``: of
    these parameters alone (``MemoryEstimate.held_on_host``)."""

    def local(t: torch.Tensor) -> int:
        if isinstance(t, DTensor):  # (PieceGrad too) its local tensor, read without an op
            t = t._local_tensor
        elif hasattr(t, "to_local"):
            t = t.to_local()
        return t.numel() * t.element_size()

    keep = None if only is None else {id(p) for p in only}
    params = list({id(p): p for p in model.parameters()}.values())
    if keep is not None:
        params = [p for p in params if id(p) in keep]
    states = [s for p, s in opt.state.items() if keep is None or id(p) in keep]
    state = [v for s in states for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": sum(local(p) for p in params),
        "gradients": sum(local(p.grad) for p in params if p.grad is not None),  # pieces too
        # a 0-dim step counter is state too, but a few bytes per parameter tensor
        "optimizer state": sum(local(v) for v in state),
    }


def ties(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The ``(module, name)`` pairs that register one parameter, for each parameter that
    more than one does (tied embeddings): ``to_empty`` unties them."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for n, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, n))
    return [o for o in owners.values() if len(o) > 1]


def retie(ties: list[list[tuple[nn.Module, str]]]) -> None:
    for (m0, n0), *rest in ties:
        p = m0._parameters[n0]
        for m, n in rest:
            m._parameters[n] = p
