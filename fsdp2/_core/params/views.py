"""Unsharded views: extension parameters whose unsharded parameter views their own sharded
storage, so that their group gathers them not at all.

# [Note: unsharded views]
# A hook of a torch PR branch (after PR 194114, with ``test_fully_shard_unsharded_views.py``;
# not merged; asked for by torchao MXFP8 inference users)
#
#     fsdp_get_unsharded_view(self, mesh, module, mp_policy) -> Tensor | None
#
# lets a subclass skip the all-gather where none is needed: with one shard rank, for a frozen
# parameter (requires_grad False) that mixed precision does not cast and CPU offload does not
# move, the tensor it returns (built over the local shard's own storage: a zero-copy
# unsharded parameter for CUDA graphs and in-place weight updates) is the unsharded
# parameter. ``None`` declines (the parameter is all-gathered as usual); a tensor of another
# shape, dtype or device, or not contiguous, raises ValueError. fsdp2 asks at the first unshard
# that can use a view, keeps the view (the same object) from unshard to unshard, never frees
# its storage at reshard, and asks again when the local shard is another object
# (``load_state_dict(assign=True)``, ``to_empty``, ``.to()``: a CUDA graph captured over the
# old storage must be captured again). ``load_state_dict`` without ``assign`` copies into the
# local shard, so the view sees the new values at once (so does any in-place edit of the
# sharded parameter). A parameter that became trainable or is cast drops its view and is
# gathered; one already gathered keeps its own storage (as torch's).
#
# A subclass with the view hook but no all-gather hooks can only be used through its view:
# ``fully_shard`` raises TypeError where the view cannot apply (several shard ranks,
# trainable, cast, offloaded), and an unshard raises RuntimeError if it stops applying or the
# hook declines. Plain parameters need no hook: at one shard rank they view the group's flat
# sharded buffer already ([Note: replicated groups] in mesh.py), trainable ones too, and so
# does a group's flat buffer next to extension parameters that may all use views
# (``GroupLayout._aliasable``); a plain local shard given the hook as an instance attribute
# after ``fully_shard`` becomes an extension parameter that asks it (relayout.py's
# ``adopt_patched_hooks``). Before each unshard ``take_views`` decides, per parameter, which
# extension parameters view and which the all-gather moves (``GroupLayout.gathered``); a group
# with none to move issues no all-gather (``GroupLayout.no_gather``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from fsdp2._core.params.extension import VIEW, Extension

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp2._core.params.param import FSDPParam
    from fsdp2.api import MixedPrecisionPolicy

__all__ = ["blocker", "check_view_only", "take_views"]


def blocker(
    p: FSDPParam, world: int, mp_policy: MixedPrecisionPolicy, offloaded: bool
) -> str | None:
    """Why extension parameter ``p`` of a group sharded over ``world`` ranks cannot use an
    unsharded view (None: it can, if it is on the compute device)."""
    if world != 1:
        return f"it is sharded over {world} ranks"
    if p.requires_grad:
        return "it requires grad"
    cast = mp_policy.param_dtype
    if cast is not None and cast != p.sharded.dtype:
        return f"mixed precision casts it from {p.sharded.dtype} to {cast}"
    if offloaded:
        return "CPU offload moves it to the host"
    return None


def check_view_only(
    params: list[FSDPParam], world: int, mp_policy: MixedPrecisionPolicy, offloaded: bool
) -> None:
    """``fully_shard``'s check of subclasses usable through their view alone.

    Raises:
        TypeError: one of them cannot use a view in this group.
    """
    for p in params:
        if p.ext is None or p.ext.gathers:
            continue
        why = blocker(p, world, mp_policy, offloaded)
        if why is not None:
            raise TypeError(
                f"parameter {p.fqn} is a {type(p.sharded).__qualname__} that defines {VIEW} "
                "but not fsdp_pre_all_gather / fsdp_post_all_gather, so fsdp2 can only use it "
                f"through its unsharded view, and {why}; a view needs one shard rank, a frozen "
                "parameter, no mixed-precision cast and no CPU offload. Define the all-gather "
                "hooks too (see docs/tensor_subclasses.md)"
            )


def take_views(
    ext_params: list[FSDPParam],
    mesh: DeviceMesh,
    device: torch.device,
    mp_policy: MixedPrecisionPolicy,
    offloaded: bool,
) -> tuple[list[FSDPParam], bool]:
    """Before an unshard of a group of one shard rank (``mesh``) computing on ``device``: give
    every extension parameter that can use a view its view. Returns the parameters the
    all-gather must move, and whether any ``FSDPParam.unsharded`` changed (the registrations
    are then stale).

    Raises (before any collective):
        ValueError: a hook returned a view of another shape, dtype or device.
        RuntimeError: a parameter usable through its view alone has none.
    """
    gathered: list[FSDPParam] = []
    changed = False
    for p in ext_params:
        ext = p.ext
        assert ext is not None
        before = p.unsharded
        why = blocker(p, 1, mp_policy, offloaded)
        local = p.sharded._local_tensor
        if why is None and local.device != device:
            why = f"it is on {local.device}, not on {device}"
        if not _view(ext, p, why is None, mesh, mp_policy):
            if not ext.gathers:
                raise RuntimeError(
                    f"parameter {p.fqn} is a {type(local).__qualname__} usable only through its "
                    f"unsharded view ({VIEW}; it has no all-gather hooks), but "
                    + (why or f"its {VIEW} returned None")
                    + "; keep it frozen, uncast and on the compute device, or define "
                    "fsdp_pre_all_gather / fsdp_post_all_gather"
                )
            gathered.append(p)
        changed |= p.unsharded is not before
    return gathered, changed


def _view(
    ext: Extension,
    p: FSDPParam,
    eligible: bool,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
) -> bool:
    """Make or keep ``p``'s unsharded parameter a view of its local shard, if ``eligible``
    and the subclass's hook returns one; whether ``p`` needs no all-gather."""
    local = p.sharded._local_tensor
    if ext.view_of is not None:
        if eligible and ext.view_of is local:
            return True
        ext.view_of, p.unsharded = None, None  # a new local shard, or no view any more
    if not eligible or p.unsharded is not None:
        return False  # an unsharded parameter of its own is kept, as torch's
    hook = getattr(local, VIEW, None)
    if hook is None:
        return False
    t = hook(mesh, p.owners[0][0], mp_policy)
    if t is None:
        return False
    if (
        not isinstance(t, torch.Tensor)
        or t.shape != p.shape
        or t.dtype != local.dtype
        or t.device != local.device
        or not t.is_contiguous()
    ):
        got = (
            f"a {type(t).__qualname__} of shape {tuple(t.shape)}, {t.dtype} on {t.device}"
            + ("" if t.is_contiguous() else ", not contiguous")
            if isinstance(t, torch.Tensor)
            else repr(t)
        )
        raise ValueError(
            f"parameter {p.fqn}: {VIEW} must return None or a contiguous tensor with the "
            f"parameter's local shape, dtype, and device ({tuple(p.shape)}, {local.dtype} on "
            f"{local.device}), got {got}"
        )
    p.unsharded = nn.Parameter(p.wrap_unsharded(t), requires_grad=False)
    ext.view_of = local
    return True
