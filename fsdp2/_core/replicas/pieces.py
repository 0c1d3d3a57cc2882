"""HSDP's gradients and optimizer state sharded over the replicas too: the pieces.

# [Note: pieces]
# On an HSDP mesh (``R`` replicas of ``S`` shards) a group reduce-scatters its gradients over
# the shard group and then all-reduces its rank's shard over the replicate group, so every
# replica holds the whole shard's gradient and steps the whole shard: the gradient and the
# optimizer state are held ``R`` times. With replica sharding (``ReduceSettings.replica_shard``,
# set by ``fsdp2.replica_optim``) the all-reduce becomes a reduce-scatter over the replicas:
# each parameter's local shard, flattened (``n`` elements), is cut into ``R`` pieces of
# ``c = ceil(n / R)`` elements (the last ones shorter, possibly empty: ``piece_range``), and
# replica rank ``r`` keeps piece ``r`` of every parameter's gradient (in the parameter's
# dtype, held as the parameter's ``.grad``: [Note: pieces as .grad] in piece_grad.py). The
# optimizer steps views of the pieces of the local shard, and ``gather_pieces`` all-gathers
# the updated pieces over the replicas back into every replica's local shard. An all-reduce
# is a reduce-scatter and an all-gather: the bytes across replicas are the same when
# gradients are reduced in the parameters' dtype.
#
# Each parameter is cut on its own (not the group's flat shard), so which parameters have a
# gradient (frozen, unused) never moves another parameter's piece, and a piece is a 1D slice of
# its parameter's contiguous local shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fsdp2._core.comm.collectives import all_gather
from fsdp2._core.comm.transport import Pending
from fsdp2._core.support.labels import label

if TYPE_CHECKING:
    from fsdp2._core.params.group import ParamGroup
    from fsdp2._core.params.param import FSDPParam

__all__ = [
    "finish_gather",
    "gather_pieces",
    "gather_rows",
    "piece_range",
    "piece_views",
    "whole_rows",
]


def piece_range(numel: int, replicas: int, rank: int) -> tuple[int, int, int]:
    """``(start, length, c)``: replica ``rank``'s piece of a flattened local shard of
    ``numel`` elements cut into ``replicas`` pieces of ``c = ceil(numel / replicas)``."""
    c = -(-numel // replicas)
    start = min(rank * c, numel)
    return start, min(c, numel - start), c


def piece_views(params: list[FSDPParam], output: torch.Tensor) -> list[torch.Tensor]:
    """The flattened local gradients of ``params`` inside a rank's reduce-scatter output
    (each parameter's slot is ``padded_numel`` long, its gradient the first ``local_numel``)."""
    views, offset = [], 0
    for p in params:
        views.append(output.narrow(0, offset, p.local_numel))
        offset += p.padded_numel
    return views


def gather_rows(
    group: ParamGroup, pieces: list[torch.Tensor], numels: list[int], what: str
) -> Pending:
    """Issue ONE all-gather over ``group``'s replicas of this rank's ``pieces`` (each of the
    flattened local shard of ``numels[i]`` elements, padded to ``ceil(n / R)``);
    ``whole_rows`` reads the result."""
    pg = group.info.replicate_group
    assert pg is not None
    replicas = group.info.replicate_size

    def pack() -> list[torch.Tensor]:
        padded = []
        for piece, n in zip(pieces, numels, strict=True):
            c = -(-n // replicas)
            padded.append(
                piece
                if piece.numel() == c
                else torch.cat([piece, piece.new_zeros(c - piece.numel())])
            )
        return [torch.cat(padded).to(group.device)]

    return all_gather(pack, pg, replicas, lambda: f"replicas: {what}")[0]  # type: ignore[return-value]


def whole_rows(rows: torch.Tensor, numels: list[int]) -> list[torch.Tensor]:
    """Each flattened local shard whole (views of ``rows``, the ``(replicas, sum of c)``
    result of ``gather_rows``)."""
    out, offset = [], 0
    for n in numels:
        c = -(-n // rows.size(0))
        out.append(rows.narrow(1, offset, c).reshape(-1)[:n])
        offset += c
    return out


def gather_pieces(group: ParamGroup, params: list[FSDPParam]) -> Pending:
    """Issue the all-gather over the replicas of ``params``' updated pieces (of their local
    shards); ``finish_gather`` copies the result back into every local shard."""
    pg = group.info.replicate_group
    assert pg is not None
    replicas, rank = group.info.replicate_size, pg.rank()
    pieces = []
    for p in params:
        start, length, _ = piece_range(p.local_numel, replicas, rank)
        pieces.append(p.sharded._local_tensor.view(-1).narrow(0, start, length))
    return gather_rows(group, pieces, [p.local_numel for p in params], group.path)


def finish_gather(group: ParamGroup, params: list[FSDPParam], pending: Pending) -> None:
    """Wait for ``gather_pieces``' all-gather and copy every replica's pieces into place."""
    with label("all_gather wait", lambda: f"replicas: {group.path}"):
        rows = pending.wait()
    for p, whole in zip(params, whole_rows(rows, [p.local_numel for p in params]), strict=True):
        p.sharded._local_tensor.view(-1).copy_(whole)
