"""Double backward: a backward with ``create_graph=True`` and the backward of the graph it
built (a gradient penalty, meta-learning).

# [Note: double backward]
# ``torch.autograd.grad(loss, x, create_graph=True)`` builds a new graph (the gradient's)
# whose nodes save the unsharded parameters, e.g. ``W`` for ``grad_x = grad_y @ W``. A
# normal backward reshards each group once its gradients are taken, which frees exactly
# those storages: the later backward through the gradient's graph then read freed memory
# (both engines failed with "setStorage: ... storage of size 0"). So:
#
# * a backward with grad mode on inside it (``create_graph=True``) reduces nothing and
#   reshards nothing: the groups it gathered stay unsharded (``StepContext.create_graph``).
#   Gradients it accumulates into parameters would carry a graph, which a reduce-scatter
#   cannot carry: that raises (``check_no_graph_grads``), naming the parameter;
# * until the next backward without ``create_graph`` has finished, the groups are held
#   (``GraphHold``): that backward hands nothing to reduction from its hooks (the gradient's
#   graph may still add to a group after the group's own backward is done) and its final
#   callback reduces every group's gradients once, then reshards as usual;
# * that backward may not reach a single fsdp2 hook (a penalty alone: ``(g ** 2).sum()``
#   runs only the gradient's graph), so while held, every unsharded trainable parameter has
#   a post-accumulate-grad hook that starts the step's backward (and so queues its final
#   callback) if nothing else did.
#
# A forward starting while held (the gradient's graph was dropped unused) ends the hold.
# Memory: every group a create_graph backward gathered stays unsharded until the backward
# that consumes its graph; gradients with respect to the sharded parameters themselves are
# not available (the graph runs through the unsharded ones): take them with respect to
# inputs or activations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fsdp2._core.params.group import ParamGroup

__all__ = ["GraphHold", "check_no_graph_grads"]


def check_no_graph_grads(groups: list[ParamGroup]) -> None:
    """Raise if a backward with ``create_graph=True`` gave a parameter a gradient that
    carries a graph (``loss.backward(create_graph=True)``)."""
    for g in groups:
        for p in g.grad_params:
            u = p.unsharded
            grad = None if u is None else u.grad
            if grad is not None and grad.requires_grad:
                raise RuntimeError(
                    f"fsdp2: backward(create_graph=True) gave parameter {p.fqn} a gradient "
                    "that carries an autograd graph; fsdp2 reduce-scatters gradients into "
                    "its sharded parameters, which is not differentiable, so second-order "
                    "terms through parameter gradients are not supported. For a gradient "
                    "penalty take the gradient with respect to inputs or activations: "
                    "torch.autograd.grad(loss, x, create_graph=True), then backward() once. "
                    "See docs/reliability.md (double backward)"
                )


class GraphHold:
    """The groups a ``create_graph`` backward left unsharded, until the backward of its
    graph has finished; see [Note: double backward]."""

    def __init__(self) -> None:
        self.active = False
        self._hooks: list[Any] = []

    def begin(self, groups: list[ParamGroup], on_grad: Callable[[], None]) -> None:
        """Hold: ``on_grad`` runs whenever a gradient lands on an unsharded trainable
        parameter of ``groups``."""
        self.active = True
        if self._hooks:
            return  # held already (several create_graph backwards in a row)

        def hook(_: torch.Tensor) -> None:
            on_grad()

        for g in groups:
            for p in g.grad_params:
                u = p.unsharded
                if u is not None and u.requires_grad:
                    self._hooks.append(u.register_post_accumulate_grad_hook(hook))

    def end(self) -> None:
        self.active = False
        for h in self._hooks:
            h.remove()
        self._hooks = []
