"""Muon over sharded parameters: each matrix orthogonalized whole, on one rank.

``torch.optim.Muon`` orthogonalizes every 2-D update with a Newton-Schulz iteration, an
operation on the whole matrix. Stepping ``fully_shard``'s sharded parameters it does not
compute that (on DTensors, every product of the iteration runs as sharded DTensor ops, with
collectives in each iteration and partial products summed in bfloat16; on local shards, it
would orthogonalize each shard). ``Muon`` here gives the numbers ``torch.optim.Muon`` gives
on an unsharded replica with the same (averaged) gradients, bit for bit:

1. The momentum update, elementwise, runs on each rank's local shard; the state
   ``momentum_buffer`` is a DTensor sharded like its parameter (so ``state_dict()``,
   ``get_optimizer_state_dict`` and ``torch.distributed.checkpoint`` work as for any optimizer,
   also across world sizes).
2. Each matrix gets one *owner* among the ranks that shard it, chosen greedily by the
   Newton-Schulz cost (``m * n * min(m, n)``), the same on every rank. The ranks send their
   shards of the update (in bfloat16, the precision the iteration runs in) to the owner,
   which puts the full matrix together, orthogonalizes it and sends every rank its shard of
   the result back. The owner's own shard never goes through the collective (the momentum
   update writes it straight where the owner reads it, and its result stays there).
3. Each rank applies weight decay and its shard of the orthogonalized update, scaled by the
   adjusted learning rate, to its local shard.

The communication goes by buckets of about ``bucket_bytes`` of full matrices, in two
``all_to_all_single`` calls per bucket (shards to the owners, results back) over the process
group of the mesh dim that shards the parameters; the next bucket's first exchange is issued
before this bucket's Newton-Schulz runs, so they overlap; and a rank works on its own
shards while the others travel (their momentum after the other shards went out, their
update before the results come back). Plain (unsharded) tensors,
replicated DTensors and meshes of one rank take the same path without collectives.

Tensor parallelism + FSDP (``parallelize_module`` on ``mesh["tp"]``, then ``fully_shard`` on
the data-parallel mesh: a colwise weight is ``(_StridedShard(0, sf=tp), Shard(0))`` on
``(dp, tp)``, a rowwise one ``(Shard(0), Shard(1))``; HSDP + TP adds a ``Replicate()``): a
matrix split over several mesh dims is exchanged over the group of all of them (this rank's
submesh over those dims, flattened with ``DeviceMesh._flatten`` when the optimizer is built:
collective, cached by torch on the root mesh; the default group when it spans every rank).
Its owner is one of those ranks; each rank's piece is ``full[rows][:, cols]``, the rows and
columns being what the placements leave of ``arange(m)`` and ``arange(n)`` when split as
``distribute_tensor`` splits a tensor (contiguous ranges for TP + FSDP, copied as slices; index
tensors otherwise), computed once per layout. The owner writes every rank's piece into the
full matrix and cuts the results back out the same way. A matrix split by one ``Shard``
mesh dim only (mesh dims of one rank do not count) takes the path above: its pieces are
``torch.cat``-ed and ``torch.split``. Replicas (HSDP's, or TP's for a matrix TP does not
split) repeat the same work each.

Memory, per bucket in flight (at most two), in bfloat16: this rank's shards of the other
owners' matrices (the send buffer, dropped once sent, then the results coming back into a
new one), its shards of its own matrices, and the other ranks' shards of its matrices (the
receive buffer, whose shards the results overwrite, dropped once sent back): about one
bucket's full matrices at 2 ranks, less at more; plus one full matrix with its
Newton-Schulz temporaries at a time.

Known limits: ``Partial`` placements are refused (``NotImplementedError``), and so are
several ``Shard``/``_StridedShard`` placements on a mesh without ``mesh_dim_names`` (flattening
needs them); every rank of a shard group must step with the same parameters having gradients
(true under ``fully_shard``); every rank must build the optimizer with the same parameters in
the same order (flattening a mesh is collective). The flattened mesh is registered on the
root mesh like any ``_flatten``'s, so DTensor's redistribution then merges consecutive
all-gathers over those dims into one, which torch 2.13 gets wrong for an uneven
``(Shard(d), Shard(d))`` (``full_tensor()`` of such a DTensor has padding in it): not a
layout ``fully_shard`` makes (FSDP over a TP ``Shard(d)`` is ``_StridedShard``), but one
``distribute_tensor`` can.

Importing ``fsdp2`` also installs a global optimizer step pre-hook that stops a matrix-wise
optimizer (one of ``fsdp2.optim.MATRIX_WISE_OPTIMIZERS``: ``torch.optim.Muon`` and its
subclasses) from stepping ``fully_shard``'s sharded parameters: its first step raises
``RuntimeError`` naming the parameter before it changes anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from fsdp2.muon._groups import muon_param_groups
from fsdp2.muon._optimizer import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_EPS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    Muon,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_EPS",
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_NS_STEPS",
    "Muon",
    "install_matrix_wise_guard",
    "muon_param_groups",
]

_OWNER_ATTR = "_fsdp2_managed_by"  # set on every sharded parameter by fully_shard
_CHECKED_ATTR = "_fsdp2_matrix_wise_checked"  # per optimizer: the param_groups sizes checked


# ---------------------------------------------------------------------------------------------
# The guard against matrix-wise optimizers on shards


def _guard(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The global step pre-hook: see ``install_matrix_wise_guard``."""
    if _classes is None:
        return
    if not isinstance(optimizer, _classes()) or isinstance(optimizer, Muon):
        return
    sizes = tuple(len(g["params"]) for g in optimizer.param_groups)
    if optimizer.__dict__.get(_CHECKED_ATTR) == sizes:
        return
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            owner = getattr(p, _OWNER_ATTR, None) if isinstance(p, DTensor) else None
            if owner is not None and _splits(p):
                name = type(optimizer).__name__
                raise RuntimeError(
                    f"{name} works on whole matrices, but param_groups[{gi}]['params'][{pi}] "
                    f"(shape {tuple(p.shape)}, placements {tuple(p.placements)}) is sharded by "
                    f"fsdp2's fully_shard({owner}): stepping its shards does not give the "
                    "full-matrix update. Use fsdp2.optim.Muon for sharded parameters (same "
                    "arguments and numbers as torch.optim.Muon, each matrix orthogonalized "
                    "whole on one rank); fsdp2.optim.muon_param_groups splits a model's "
                    "parameters between Muon and AdamW."
                )
    optimizer.__dict__[_CHECKED_ATTR] = sizes


def _splits(p: DTensor) -> bool:
    """Whether ``p``'s local tensor is less than the full matrix: a placement other than
    ``Replicate()`` (``Shard``, ``_StridedShard``) on a mesh dim of more than one rank."""
    mesh = p.device_mesh
    return any(
        not isinstance(pl, Replicate) and mesh.size(i) > 1 for i, pl in enumerate(p.placements)
    )


_guard_handle: RemovableHandle | None = None
_classes: Callable[[], tuple[type[torch.optim.Optimizer], ...]] | None = None


def install_matrix_wise_guard(
    classes: Callable[[], tuple[type[torch.optim.Optimizer], ...]],
) -> RemovableHandle:
    """Install (once; ``import fsdp2`` does it) the global optimizer step pre-hook that
    refuses a matrix-wise optimizer over ``fully_shard``'s sharded parameters.

    Before each step of an optimizer that is an instance of one of
    ``fsdp2.optim.MATRIX_WISE_OPTIMIZERS`` (``torch.optim.Muon`` and its subclasses; not
    ``fsdp2.optim.Muon``), the hook checks the parameters once (again when the number of
    parameter groups or of parameters in a group changes) and raises ``RuntimeError``,
    naming the parameter, when one is a DTensor that ``fully_shard`` sharded (it carries
    ``_fsdp2_managed_by``) with a ``Shard`` placement on a mesh dim of more than one rank:
    such a step does not compute what the optimizer computes on the full matrix (for
    ``torch.optim.Muon`` on DTensors, every Newton-Schulz product runs as sharded DTensor
    ops, with collectives in each iteration and partial products summed in bfloat16; an
    optimizer working on local tensors would orthogonalize each shard). Parameters whose
    local tensor is the whole matrix (world size 1, ``Replicate()`` placements) and plain
    tensors pass. Any other optimizer costs one ``isinstance`` check per step.

    It cannot detect a matrix-wise optimizer it is not told about: add such a class to
    ``fsdp2.optim.MATRIX_WISE_OPTIMIZERS`` (rebind the tuple) to have it checked. Nor does
    it check DTensors sharded by something other than ``fully_shard`` (tensor parallelism
    alone), nor steps whose ``param_groups`` hold local tensors (``step_on_local_shards``,
    which refuses non-elementwise optimizers itself).

    Args:
        classes: returns the optimizer classes to check, read at each step
            (``fsdp2.optim`` passes a function returning its ``MATRIX_WISE_OPTIMIZERS``, so
            rebinding that tuple takes effect).

    Returns:
        the hook's handle (``remove()`` uninstalls it; calling this again reinstalls it).
    """
    global _guard_handle, _classes
    _classes = classes
    hooks = None if _guard_handle is None else _guard_handle.hooks_dict_ref()
    if _guard_handle is None or hooks is None or _guard_handle.id not in hooks:
        _guard_handle = register_optimizer_step_pre_hook(_guard)
    return _guard_handle
