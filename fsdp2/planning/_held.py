"""What a rank holds, counted for :func:`fsdp2.estimate_memory`: its shards' bytes, and the
parameters registered by more than one module (tied embeddings), which ``to_empty`` unties."""

from __future__ import annotations

import torch
import torch.nn as nn


def held(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """The bytes of this rank's shards of the parameters, their gradients and the optimizer
    state (``MemoryEstimate.held``); tied parameters once."""

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list({id(p): p for p in model.parameters()}.values())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": sum(local(p) for p in params),
        "gradients": sum(local(p.grad) for p in params if p.grad is not None),
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
