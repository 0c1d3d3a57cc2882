"""``fully_shard_traced``: shard a module's parameters for the traced mode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fsdp2._core.front.sharding import FSDPModule
from fsdp2._core.support.mesh import default_mesh
from fsdp2.api import MixedPrecisionPolicy, OffloadPolicy
from fsdp2.traced._gather import _Plan
from fsdp2.traced._module import _PLAN, TracedModule, _traced_class


def _owned(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``root``'s modules whose parameters this call manages: not those under an earlier
    call's root (their parameters are sharded already)."""
    out, seen, stack = [], set(), [("", root)]
    while stack:
        path, mod = stack.pop()
        if id(mod) in seen or (mod is not root and hasattr(mod, _PLAN)):
            continue
        seen.add(id(mod))
        out.append((path, mod))
        for name, child in reversed(list(mod.named_children())):
            stack.append((f"{path}.{name}" if path else name, child))
    return out


def _check(
    module: nn.Module,
    mesh: DeviceMesh,
    reshard_after_forward: Any,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    unsupported: dict[str, Any],
) -> None:
    where = f"fully_shard_traced({type(module).__name__})"
    if isinstance(module, TracedModule):
        raise ValueError(f"{where}: the module is sharded by fully_shard_traced already")
    for path, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            what = "the module" if not path else f"its submodule {path!r}"
            raise ValueError(
                f"{where}: {what} is sharded by fsdp2.fully_shard already; the two modes do "
                "not mix in one model: shard every module with one of them"
            )
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"{where}: only a 1D mesh (FSDP) is traced yet, got a {mesh.ndim}D mesh (HSDP); "
            "use fsdp2.fully_shard for HSDP"
        )
    if not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"{where}: reshard_after_forward must be True or False in the traced mode, "
            f"got {reshard_after_forward!r} (no smaller-mesh copy yet)"
        )
    if mp_policy.grad_dtype is not None:
        raise NotImplementedError(f"{where}: MixedPrecisionPolicy.grad_dtype is not traced yet")
    if type(offload_policy) is not OffloadPolicy:
        raise NotImplementedError(f"{where}: offload_policy is not supported in the traced mode")
    for name, value in unsupported.items():
        if value is not None:
            raise NotImplementedError(f"{where}: {name} is not supported in the traced mode yet")


def fully_shard_traced(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008  (frozen)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008  (frozen)
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters for ``torch.compile(fullgraph=True)``: the all-gathers
    and reduce-scatters are functional collectives in the traced graphs.

    Like ``fsdp2.fully_shard``: call it on each block, then on the root; every parameter
    of ``module`` not managed by an earlier call becomes a ``Shard(0)`` DTensor on ``mesh``
    (``named_parameters()``, ``state_dict()`` and the optimizer see the same DTensors as
    with eager ``fully_shard``). Inside the forward of the module this call was made on,
    reading a managed parameter through its module (``module.weight``) all-gathers it
    (cast to ``mp_policy.param_dtype`` first), a collective every rank must make; its
    gradient is reduce-scattered in ``reduce_dtype`` and averaged over the mesh. Outside
    that forward the read returns the sharded DTensor, as with ``fully_shard``.

    Args:
        module: the module to shard; its class is swapped for a ``TracedModule``
            subclass (its forward casts inputs and outputs per ``mp_policy``).
        mesh: a 1D mesh (default: the world, as ``fully_shard``).
        reshard_after_forward: ``True``: when compiled, backward all-gathers again (the
            gather is recomputed, not saved); ``False``: the unsharded parameters are saved
            for backward. Eager (uncompiled) calls always save them.
        shard_placement_fn, ignored_params: not supported yet (``NotImplementedError``).
        mp_policy: ``param_dtype``, ``reduce_dtype``, ``output_dtype``,
            ``cast_forward_inputs`` as in ``fully_shard``; ``grad_dtype`` not yet.
        offload_policy: only ``OffloadPolicy()`` (no offload).

    Returns:
        ``module``, sharded in place.

    Raises:
        NotImplementedError: a feature the traced mode does not have yet (a 2D mesh,
            offloading, tensor-parallel DTensor parameters, 0-dim parameters, ...),
            before any collective.
        ValueError: ``module`` is sharded already (by either mode).
    """
    mesh = default_mesh() if mesh is None else mesh
    unsupported = {"shard_placement_fn": shard_placement_fn, "ignored_params": ignored_params}
    _check(module, mesh, reshard_after_forward, mp_policy, offload_policy, unsupported)
    owners = _owned(module)
    for path, mod in owners:
        for name, p in mod._parameters.items():
            fqn = f"{path}.{name}" if path else name
            if isinstance(p, DTensor):
                raise NotImplementedError(
                    f"fully_shard_traced: parameter {fqn!r} is a DTensor already (tensor "
                    "parallel?): the traced mode shards plain parameters only yet"
                )
            if p is not None and p.dim() == 0:
                raise NotImplementedError(
                    f"fully_shard_traced: parameter {fqn!r} is 0-dim; the traced mode "
                    "shards dim 0 only"
                )
    plan = _Plan(mesh, reshard_after_forward, mp_policy)
    sharded: dict[int, nn.Parameter] = {}  # a tied parameter is sharded once
    for _, mod in owners:
        names = []
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in sharded:
                dt = distribute_tensor(p.detach(), mesh, [Shard(0)])
                sharded[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            mod._parameters[name] = sharded[id(p)]
            names.append(name)
        root = mod is module
        if names or root:
            object.__setattr__(mod, _PLAN, plan)
            mod.__class__ = _traced_class(type(mod), tuple(names), root)
    return module
