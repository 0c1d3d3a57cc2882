"""A group's layout after ``fully_shard``: parameters that change under it.

Users and torch replace what a group laid out: ``nn.Module._apply`` (``to_empty``,
``.to(device or dtype)``) swaps the sharded parameters' local tensors,
``load_state_dict(assign=True)`` or an assignment registers new parameter objects, and
all-gather hooks may be patched onto local tensors. These functions bring the group back
to [Note: flat storage] (in param.py) through its public methods, keeping parameter
objects (so optimizers built in between stay valid). Above the group: lazy init (state.py),
the state-dict hooks, ``FSDPModule._apply`` and the step's start (step.py) call these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2._core.params.dtypes import check as check_grad_dtypes
from fsdp2._core.params.extension import VIEW, extension_of
from fsdp2._core.params.faces import sync_requires_grad
from fsdp2._core.params.param import FSDPParam

if TYPE_CHECKING:
    from fsdp2._core.params.group import ParamGroup


def adopt_registered(group: ParamGroup) -> None:
    """Take parameters registered in place of the group's sharded ones as the new
    sharded parameters, and move their values into the flat buffer.

    Runs after ``load_state_dict(assign=True)`` (a post-hook per owner module) and at
    lazy init (a parameter replaced after ``fully_shard``, e.g. ``module.weight =
    nn.Parameter(...)`` after ``to_empty``). The new parameter must be a DTensor with the
    sharded parameter's placements and local shape (ValueError otherwise, naming it).
    The flat buffer is rebuilt once none of the group's parameters is half-loaded (some
    still on meta while others are not), so loading module by module works: until then
    the adopted parameters' local tensors stay where they are, and ``resync_after_apply``
    (a no-op when every local tensor is in the flat buffer) moves them in later.
    """
    changed = False
    for p in group.params:
        m, n = p.owners[0]
        cur: torch.Tensor | None = m._parameters.get(n)
        if cur is None or cur is p.sharded or cur is p.unsharded:
            continue
        new = _as_sharded(p, cur)
        # the mark fully_shard put on the sharded parameter (fsdp2.muon's guard reads it)
        new.__dict__["_fsdp2_managed_by"] = p.sharded.__dict__.get("_fsdp2_managed_by", group.name)
        p.sharded = new
        for m2, n2 in p.owners:
            m2._parameters[n2] = new  # type: ignore[assignment]  # a DTensor Parameter
        if new.requires_grad != p.requires_grad:
            p.requires_grad = new.requires_grad
            if p.unsharded is not None:
                p.unsharded.requires_grad_(new.requires_grad)
        changed = True
    if changed:
        group.refresh_registrations()
    if len({p.sharded.is_meta for p in group.params}) == 1:  # not half-loaded
        resync_after_apply(group)


def before_forward(group: ParamGroup) -> None:
    """A forward is about to use ``group`` (its root's step begins, or its module runs
    outside the root's forward): follow ``requires_grad_`` calls ([Note: freezing]), take
    over a group ``unshard()`` left unsharded, and reshard one whose unsharded values are
    older than its sharded parameters, so that the forward gathers the new ones ([Note:
    stale unsharded] in group.py), and lay out a group converted in part since ([Note:
    conversion across modules]). Issues no collective; may raise (``ValueError``, and
    ``RuntimeError`` for a ``grad_dtype`` changed since ``fully_shard``: [Note: gradient
    dtypes] in dtypes.py)."""
    check_grad_dtypes(group.params)
    if group.resync_pending:
        _check_converted(group)
    sync_requires_grad(group)
    if group.stale():
        group.reshard()


def _as_sharded(p: FSDPParam, cur: torch.Tensor) -> DTensor:
    """``cur``, registered where ``p``'s sharded parameter was, checked to serve as
    ``p``'s new sharded parameter."""
    want = tuple(p.sharded.placements)
    if not isinstance(cur, DTensor):
        # Not adopted by sharding it into a new object: an optimizer built in between
        # would hold the plain tensor, which would then silently not train.
        raise ValueError(
            f"parameter {p.fqn} was replaced after fully_shard by a plain "
            f"{type(cur).__name__} of shape {tuple(cur.shape)}; a sharded model needs a "
            f"DTensor there (placements {want}), e.g. nn.Parameter(distribute_tensor(t, "
            "old.device_mesh, old.placements)), or copy the values into the existing "
            "parameter: with torch.no_grad(): old.copy_(distribute_tensor(t, "
            "old.device_mesh, old.placements))"
        )
    local, old_local = cur._local_tensor, p.sharded._local_tensor
    if tuple(cur.placements) != want or local.shape != old_local.shape:
        raise ValueError(
            f"parameter {p.fqn} was replaced (load_state_dict(assign=True) or "
            f"assignment) by a DTensor with placements {tuple(cur.placements)} and local "
            f"shape {tuple(local.shape)}; fsdp2 needs placements {want} and "
            f"local shape {tuple(old_local.shape)} (or a full tensor)"
        )
    if p.ext is not None and type(local) is not type(old_local):
        raise ValueError(
            f"load_state_dict(assign=True) put a DTensor of {type(local).__qualname__} at "
            f"{p.fqn}, which is a {type(old_local).__qualname__} parameter; assigning "
            "would drop the tensor subclass. Load without assign=True (values are "
            "copied into the subclass) or assign values of the same subclass"
        )
    if getattr(cur, "_is_param", False):
        return cur
    param = nn.Parameter(cur, cur.requires_grad)  # a detached DTensor flagged as a Parameter
    assert isinstance(param, DTensor)
    return param


def resync_after_apply(group: ParamGroup) -> None:
    """After ``nn.Module._apply`` (``to_empty``, ``.to(device or dtype)``) swapped the
    sharded params' local tensors, move them back into a flat buffer (of the new
    device/dtype) so [Note: flat storage] holds again. Parameter objects keep their
    identity. A group converted in part waits for the rest of its modules ([Note:
    conversion across modules]).

    [Note: conversion across modules]
    ``fully_shard([a, b])`` makes one group over modules that ``_apply`` converts one after
    the other: ``model.to_empty()`` runs ``a._apply`` (whose ``FSDPModule._apply`` resyncs
    its groups) while ``b``'s parameters are still on meta (torchtitan's
    ``fully_shard([model.norm, model.lm_head])``). Laying the group out then would copy out
    of meta tensors, and after ``model.to(dtype)`` would mix dtypes in one buffer. So a
    group whose flat parameters' local tensors disagree in dtype or device is left as it
    is and marked ``resync_pending``; the conversion of its last module finds them agreeing
    and lays it out once (torch's engine resets each parameter at its own module's
    ``_apply``: the same end state). A group still disagreeing when a forward uses it (only
    some of its modules were converted) raises ``ValueError`` naming its parameters, in
    ``before_forward``, before any collective.
    """
    group.refresh_registrations()  # the dtypes' policies back ([Note: gradient dtypes])
    _resync_ext(group)
    if not group.flat_params:
        group.resync_pending = False
        return
    locals_ = [p.sharded._local_tensor for p in group.flat_params]
    if len({(t.dtype, t.device) for t in locals_}) > 1:
        group.resync_pending = True  # the conversion of its other modules is to come
        return
    group.resync_pending = False
    flat = group.sharded_flat
    storage = flat.untyped_storage()._cdata  # its identity (fake tensors have no data_ptr)
    if all(
        t.dtype == flat.dtype
        and t.device == flat.device
        and (t.is_meta or t.untyped_storage()._cdata == storage)
        for t in locals_
    ):
        return
    dtype, device = locals_[0].dtype, locals_[0].device
    group.retype(dtype)
    group.relayout(dtype, device)


def _check_converted(group: ParamGroup) -> None:
    """A forward is about to use a group left converted in part ([Note: conversion across
    modules]): lay it out if its modules' conversions have all run since, else raise."""
    resync_after_apply(group)
    if not group.resync_pending:
        return
    kinds: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for p in group.flat_params:
        t = p.sharded._local_tensor
        kinds.setdefault((t.dtype, t.device), []).append(p.fqn)
    listing = "; ".join(
        f"{dtype} on {device}: {', '.join(names[:4])}" + (" ..." if len(names) > 4 else "")
        for (dtype, device), names in kinds.items()
    )
    raise ValueError(
        f"fully_shard({group.path}): a conversion (to_empty, .to, .half, ...) reached only some "
        f"of the modules or parameters of this fully_shard call, whose parameters now differ "
        f"({listing}). Convert all of them alike, e.g. through their common parent "
        "(model.to_empty(device=...), model.to(dtype))"
    )


def _resync_ext(group: ParamGroup) -> None:
    """Extension parameters whose local tensor changed (``to_empty``, ``.to``,
    ``assign=True``) get a fresh all-gather layout and unsharded parameter."""
    changed = False
    for p in group.ext_params:
        assert p.ext is not None
        p.spec = p.sharded._spec
        if not p.ext.stale(p.sharded._local_tensor):
            continue
        p.ext.free(group.path)
        p.ext.reset()
        p.unsharded = None
        changed = True
    if changed:
        group.refresh_registrations()
    dtypes = {p.sharded.dtype for p in group.params}
    if not group.flat_params and len(dtypes) == 1:
        group.retype(dtypes.pop())


def hooks_patched(group: ParamGroup) -> bool:
    """Whether a flat parameter's local tensor was given all-gather hooks (or, with one shard
    rank, the view hook: [Note: unsharded views] in views.py)."""
    return any(_patched(group, p) for p in group.flat_params)


def _patched(group: ParamGroup, p: FSDPParam) -> bool:
    local = p.sharded._local_tensor
    return hasattr(local, "fsdp_pre_all_gather") or (group.world == 1 and hasattr(local, VIEW))


def adopt_patched_hooks(group: ParamGroup) -> None:
    """Plain parameters whose local tensor was given the all-gather hooks after
    ``fully_shard`` (as instance attributes, e.g. after ``to_empty``) become extension
    parameters: their local tensor objects (which carry the hooks) get storage of their
    own and the flat buffer is rebuilt without them. Runs at lazy init and, while the
    group is sharded, when a step's forward begins (``hooks_patched`` is the cheap
    test)."""
    patched = [p for p in group.flat_params if _patched(group, p)]
    if not patched:
        return
    for p in patched:
        local = p.sharded._local_tensor
        if p.is_scalar or p.shard_dim != 0:
            raise NotImplementedError(
                f"parameter {p.fqn} was given all-gather hooks, but fsdp2 applies them "
                "only to parameters sharded on dim 0 (not 0-dim ones)"
            )
        p.ext = extension_of(local, p.fqn, patched=True)
        with torch.no_grad():
            local.data = local.detach().clone()  # the object keeps its hooks
        p.unsharded = None
        p.offset = -1
    group.split_params()
    group.relayout(group.sharded_flat.dtype, group.sharded_flat.device)
    group.refresh_registrations()
