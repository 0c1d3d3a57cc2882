"""What layers built on the core (the FSDP1 migration layer) may read or hook: the one
place they touch the core's objects, so that the core can change behind it.

* ``managed_params(module)``: the parameters a ``fully_shard`` group manages, each with
  its sharded DTensor parameter and the ``(module, attribute)`` pairs that register it.
* ``on_backward_end(module, callback)``: run ``callback`` after every backward that
  ``module``'s root drives, once its gradients have landed on the sharded parameters.
* ``comm_device_type()``: the device type the default process group communicates on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from ._mesh import comm_device_type
from ._state import FSDPState, state_of

__all__ = ["ManagedParam", "comm_device_type", "managed_params", "on_backward_end"]


@dataclass(frozen=True)
class ManagedParam:
    """One managed parameter: ``sharded`` is its DTensor parameter (registered on the
    owners whenever the group is resharded); ``owners`` the ``(module, name)`` pairs that
    register it (more than one for tied parameters)."""

    sharded: nn.Parameter
    owners: tuple[tuple[nn.Module, str], ...]


def _states(module: nn.Module, recurse: bool) -> list[FSDPState]:
    mods = module.modules() if recurse else [module]
    out: list[FSDPState] = []
    for m in mods:
        st = state_of(m)
        if st is not None and all(st is not o for o in out):
            out.append(st)
    return out


def managed_params(
    module: nn.Module, *, recurse: bool = False, reshard: bool = False
) -> list[ManagedParam]:
    """The parameters managed by ``module``'s ``fully_shard`` group (and, with
    ``recurse``, by every group in ``module``'s subtree), in the order ``fully_shard``
    found them (the same on every rank). ``[]`` for a module without one.
    With ``reshard``, each group is resharded first, so the sharded parameters are the
    registered ones."""
    out: list[ManagedParam] = []
    for st in _states(module, recurse):
        group = st.group
        if group is None:
            continue
        if reshard:
            group.reshard()
        out.extend(ManagedParam(p.sharded, tuple(p.owners)) for p in group.params)
    return out


def on_backward_end(module: nn.Module, callback: Callable[[], None]) -> None:
    """Run ``callback()`` at the end of every backward driven by the root whose tree
    holds ``module`` (hooks of every module in that tree run, in registration order),
    after fsdp2 has landed (and, with CPU offload, synchronized) the gradients.

    Raises:
        ValueError: ``module`` was not passed to ``fully_shard``.
    """
    st = state_of(module)
    if st is None:
        raise ValueError(f"{type(module).__name__} was not passed to fully_shard")
    st.backward_end_callbacks.append(callback)
