"""A parameter's two faces, the sharded DTensor and the unsharded parameter, and the
``requires_grad_`` calls made on either ([Note: freezing])."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fsdp2._core.params.param import FSDPParam


class _Group(Protocol):
    """What the sync reads of a parameter group (``GroupLayout``)."""

    params: list[FSDPParam]
    draining: list[FSDPParam]

    def refresh_registrations(self) -> None: ...


def sync_requires_grad(group: _Group) -> None:
    """Follow ``requires_grad_`` calls made since the last step ([Note: freezing]).

    Runs before a forward uses the group (``relayout.before_forward``) and whenever the
    group's registered parameters switch faces (``register_sharded`` /
    ``register_unsharded``). Cheap when nothing changed: a flag read or two per parameter
    (about 12 us per 100 parameters).

    [Note: freezing]
    ``module.requires_grad_(False)`` after ``fully_shard`` flips the flag of whatever its
    ``parameters()`` give: the sharded DTensors (between steps), or, where only the
    registered tensors are reachable (a plain submodule while its group is unsharded), the
    unsharded ones. The unsharded parameter is what forward uses, so autograd saw the old
    flag and the frozen weights kept training (0.09 from the replica after 5 steps). Here
    either face's new flag is copied to the other and to ``FSDPParam.requires_grad``, and
    the group's trainable list is rebuilt. A parameter frozen between no-sync micro-steps
    may hold an unreduced gradient, as the replica keeps its ``.grad``: it stays among the
    group's gradient parameters (``draining``) until the next synced reduction took it. A
    frozen parameter of another dtype than its group's trainable ones may be unfrozen: its
    gradient joins the group's reduction ([Note: gradient dtypes] in dtypes.py).

    A flip is read from the registered face, so the sync also runs when the registered face
    changes: otherwise a flip on the face leaving (freeze a block while its group is
    unsharded) then one on the face arriving (reshard by a state-dict round trip, unfreeze
    the model) left the leaving face stale, and the next sync took it for the newer flip and
    froze the block again (no gradient, no update: fsdp2.replicate's groups stay unsharded
    after a forward. Found by the call-order property suite's long profile.)
    """
    changed = False
    for p in group.params:
        new = p.sharded.requires_grad
        if new is p.requires_grad:
            u = p.unsharded
            if u is None or u.requires_grad is new:
                continue
            new = u.requires_grad  # flipped on the unsharded parameter (registered now)
        p.requires_grad = new
        if not new:
            group.draining.append(p)  # may hold gradients not reduced yet (no sync)
        elif p in group.draining:
            group.draining.remove(p)
        if p.sharded.requires_grad is not new:
            p.sharded.requires_grad_(new)
        if p.unsharded is not None and p.unsharded.requires_grad is not new:
            p.unsharded.requires_grad_(new)
        changed = True
    if changed:
        group.refresh_registrations()
