"""A group's dtypes: the dtype of its flat buffer (``group_dtype``), and each parameter's
gradient dtypes: the policy ``fully_shard`` captured (``GradPolicy`` in param.py, with
``MixedPrecisionPolicy.grad_dtype``: ``apply_policy``), put back on the parameter's faces
whenever they are replaced (``install``), refused when changed (``check``), and the dtypes a
gradient is accumulated, reduced and landed in.

# [Note: other dtypes]
# The flat buffer holds one dtype: that of the parameters that must be in it (0-dim ones, or
# ones sharded on a dim other than 0), else the dtype holding most of the trainable
# parameters' elements (of all parameters' when none is trainable). A parameter of another
# dtype (fp32 norms beside bf16 weights, a frozen float8 or bf16 weight next to fp32
# trainable ones) keeps its own storage and is gathered as bytes in the group's one
# all-gather, like an extension parameter whose hooks fsdp2 plays itself: the input is its
# local shard (cast to ``param_dtype`` under mixed precision if it is floating, as torch's
# FSDP2 does), the unsharded parameter views the output. Its gradient joins the group's one
# reduce-scatter ([Note: gradient dtypes]). torch's FSDP2 (2.13, 2.14) asserts one dtype for
# a group's trainable parameters (pytorch issue 156784; PR 194434 lifts it).

# [Note: gradient dtypes]
# torch lets a leaf tensor's gradient have a dtype of its own: ``Tensor.grad_dtype`` (2.13+),
# by default the tensor's dtype (following it through conversions), or set explicitly: a
# fixed dtype, or ``None`` for any. ``fully_shard`` captures each parameter's policy before it
# replaces the parameter (``GradPolicy.of``: explicit or default; torch main has
# ``Tensor._has_grad_dtype_override`` to tell them apart, 2.13 and 2.14 do not, so the
# parameter is asked: ``param.explicit_override``); ``MixedPrecisionPolicy.grad_dtype`` is an
# explicit policy for the group's floating-point parameters (pytorch PR 197368). For a
# parameter computing in ``c`` (``param_dtype``, else its own dtype):
#
# * the sharded gradient (``param.grad``, what the optimizer reads) is in the explicit dtype,
#   in the reduction's dtype for an explicit ``None``, else in the parameter's own dtype;
# * the unsharded gradient (what backward accumulates, also across backwards without
#   gradient sync) is in ``reduce_dtype`` if the policy sets one, else in the explicit dtype
#   (``None``: whatever backward gives), else in ``c``: bf16 compute with an fp32
#   ``grad_dtype`` sums 256 + 1 - 256 as 1, not 0 (pytorch PR 194434's rule; PR 197203 would
#   accumulate in ``c``);
# * the group's one reduce-scatter runs in ``reduce_dtype`` if set, else in the promoted
#   dtype of its unsharded gradients' dtypes (fp32 for bf16 and fp32), fixed by the policies
#   (an explicit ``None`` counts as ``c``), so every rank packs the same dtype; each
#   parameter's slice is then cast to its sharded gradient's dtype (one flat cast when they
#   agree), and the gradient DTensor's spec carries that dtype.
#
# The captured policy is put back whenever the sharded parameter is replaced or its data
# swapped: after ``.to()`` / ``_apply`` (torch's swap of a DTensor parameter resets it), after
# ``load_state_dict(assign=True)`` (the new parameter's own ``grad_dtype`` is overwritten),
# and on every unsharded parameter fsdp2 builds. Changing it after ``fully_shard`` is refused
# (``check``, RuntimeError, torch main's text) before any collective: at every forward and
# ``unshard()`` by value, and at the first forward, a conversion and a load also an explicit
# value equal to the dtype (asked as at capture). A conversion that would put an existing
# gradient in another dtype than its parameter's policy, or change the dtype or device of a
# pending (unreduced) gradient, is refused first (``FSDPModule._apply``): clear the gradients
# with ``model.zero_grad(set_to_none=True)``, as torch main asks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fsdp2._core.params.param import FSDPParam, GradPolicy, explicit_override
from fsdp2._core.support.compat import GRAD_DTYPE, TORCH_RELEASE

if TYPE_CHECKING:
    from fsdp2.api import MixedPrecisionPolicy

__all__ = [
    "apply_policy",
    "check",
    "compute_dtype",
    "group_dtype",
    "install",
    "landing_dtypes",
    "promoted",
    "unsharded_grad_dtype",
]

CHANGED = (
    "Changing grad_dtype after fully_shard() is not supported. Configure grad_dtype before "
    "calling fully_shard()."
)


def group_dtype(params: list[FSDPParam], name: str) -> torch.dtype:
    """The dtype of a group's flat buffer (see [Note: other dtypes]).

    Raises:
        NotImplementedError: 0-dim parameters or ones sharded on a dim other than 0 (which
            only the flat buffer holds) have several dtypes.
    """
    held = [p for p in params if p.ext is None and (p.is_scalar or p.shard_dim != 0)]
    if len({p.sharded.dtype for p in held}) > 1:
        listing = ", ".join(f"{p.fqn}: {p.sharded.dtype}" for p in held)
        raise NotImplementedError(
            f"fully_shard({name}): its 0-dim parameters and those sharded on a dim other than 0 "
            f"need one dtype (fsdp2 gathers the other dtypes only for parameters sharded on dim "
            f"0), got {listing}. Cast them alike, or shard them in fully_shard calls of their own"
        )
    if held:
        return held[0].sharded.dtype
    plain = [p for p in params if p.ext is None] or params
    voters = [p for p in plain if p.requires_grad] or plain
    numel: dict[torch.dtype, int] = {}
    for p in voters:
        numel[p.sharded.dtype] = numel.get(p.sharded.dtype, 0) + p.shape.numel()
    return max(numel, key=numel.__getitem__)  # ties: the first parameter's


def apply_policy(params: list[FSDPParam], mp: MixedPrecisionPolicy, name: str) -> None:
    """Check the captured policies and add ``mp.grad_dtype`` to them, at ``fully_shard``.

    Raises:
        ValueError: a parameter's ``grad_dtype`` is not floating-point, or differs from
            ``mp.grad_dtype``.
        RuntimeError: ``mp.grad_dtype`` on a torch without ``Tensor.grad_dtype``.
    """
    want = mp.grad_dtype
    if want is not None and not GRAD_DTYPE:
        raise RuntimeError(
            f"fully_shard({name}): MixedPrecisionPolicy(grad_dtype={want}) needs torch's "
            f"Tensor.grad_dtype, which torch {TORCH_RELEASE} lacks; upgrade torch (2.13+)"
        )
    for p in params:
        policy = p.grad_policy
        if policy.explicit and policy.dtype is not None and not policy.dtype.is_floating_point:
            raise ValueError(
                f"fully_shard({name}): parameter {p.fqn} has grad_dtype={policy.dtype}, not a "
                "floating-point dtype; set its grad_dtype to a floating-point dtype or None "
                "(any dtype) before fully_shard"
            )
        if want is None or not p.sharded.dtype.is_floating_point:
            continue
        if policy.explicit and policy.dtype != want:
            raise ValueError(
                f"fully_shard({name}): parameter {p.fqn} has grad_dtype={policy.dtype}, but "
                f"MixedPrecisionPolicy(grad_dtype={want}) asks for {want}; set one of them"
            )
        p.grad_policy = GradPolicy(True, want)


def compute_dtype(p: FSDPParam, mp: MixedPrecisionPolicy) -> torch.dtype:
    """The dtype ``p`` is gathered and computed in."""
    cast = mp.param_dtype
    return cast if cast is not None and p.sharded.dtype.is_floating_point else p.sharded.dtype


def unsharded_grad_dtype(p: FSDPParam, mp: MixedPrecisionPolicy) -> torch.dtype | None:
    """The dtype backward accumulates ``p``'s unsharded gradient in (``None``: any)."""
    policy = p.grad_policy
    if not policy.explicit:
        return compute_dtype(p, mp)
    return mp.reduce_dtype if mp.reduce_dtype is not None else policy.dtype


def promoted(params: list[FSDPParam], mp: MixedPrecisionPolicy, name: str) -> torch.dtype | None:
    """The promoted dtype of ``params``' unsharded gradients (an explicit ``None`` counts as
    the compute dtype): the reduction's without ``reduce_dtype``. ``None`` for no params.

    Raises:
        ValueError: two of the dtypes have no promotion (float8).
    """
    out: torch.dtype | None = None
    for p in params:
        d = unsharded_grad_dtype(p, mp) or compute_dtype(p, mp)
        if out is None or d == out:
            out = d
            continue
        try:
            out = torch.promote_types(out, d)
        except RuntimeError as e:
            raise ValueError(
                f"fully_shard({name}): the gradient of parameter {p.fqn} ({d}) cannot be "
                f"reduced with the group's other gradients ({out}): {e}. Set reduce_dtype, "
                "or shard it in a fully_shard call of its own"
            ) from None
    return out


def landing_dtypes(params: list[FSDPParam], reduced: torch.dtype) -> list[torch.dtype]:
    """The dtype each of ``params``' reduced gradients lands in (``reduced``: the
    reduction's, kept under an explicit ``None``)."""
    out = []
    for p in params:
        policy = p.grad_policy
        out.append((policy.dtype or reduced) if policy.explicit else p.sharded.dtype)
    return out


def install(params: list[FSDPParam], mp: MixedPrecisionPolicy) -> None:
    """Put the captured policies on ``params``' sharded parameters and the unsharded
    gradient dtypes on their unsharded ones (after either was built or replaced)."""
    if not GRAD_DTYPE:
        return
    for p in params:
        policy, sharded = p.grad_policy, p.sharded
        if policy.explicit:
            sharded.grad_dtype = policy.dtype  # an override in torch's eyes too
        elif sharded.grad_dtype != sharded.dtype:  # e.g. an assigned parameter's own
            sharded.grad_dtype = sharded.dtype
            policy.pinned = True
        u = p.unsharded
        if u is not None and policy.explicit and u.dtype.is_floating_point:
            want = unsharded_grad_dtype(p, mp)
            if u.grad_dtype != want:
                u.grad_dtype = want


def check(params: list[FSDPParam], *, thorough: bool = False) -> None:
    """Refuse a ``grad_dtype`` changed on a sharded parameter since ``fully_shard`` (see
    [Note: gradient dtypes]): by value; ``thorough`` also an explicit value equal to the
    dtype of a parameter captured with the default.

    Raises:
        RuntimeError: torch main's text, then the parameter and its dtypes.
    """
    if not GRAD_DTYPE:
        return
    for p in params:
        policy, sharded = p.grad_policy, p.sharded
        now = sharded.grad_dtype
        if policy.explicit:
            ok = now == policy.dtype
        else:
            ok = now == sharded.dtype
            if ok and thorough and not policy.pinned:
                ok = not explicit_override(sharded)
        if not ok:
            was = policy.dtype if policy.explicit else f"the default ({sharded.dtype})"
            raise RuntimeError(
                f"{CHANGED} Parameter {p.fqn} has grad_dtype {now} (explicitly set), "
                f"fully_shard found {was}."
            )
