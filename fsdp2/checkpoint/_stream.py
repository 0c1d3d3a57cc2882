"""Full tensors streamed in memory, bucket by bucket: ``iter_full_tensors``'s engine.
See [Note: streamed full tensors]."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp2._core.compat import all_gather_single
from fsdp2.checkpoint._save import _comm_device, plain

__all__ = ["Item", "plan", "stream"]

# [Note: streamed full tensors]
# An inference engine fed after every optimizer step (RL post-training) wants the model's
# full tensors, in state-dict order, as fast as the wire allows. Walking ``state_dict()``
# with ``full_tensor()`` costs one all-gather per tensor (about 290 for a 0.5B model), each
# with DTensor's dispatch. Here every tensor sharded on dim 0 over one mesh dim (FSDP, the
# shard dim of HSDP; uneven sizes padded as ``torch.chunk`` splits them) joins a *bucket*
# of consecutive such tensors with the same process group and dtype, up to ``bucket_bytes``
# of gathered bytes: each rank packs its (cast, padded) rows of every tensor of the bucket
# into one buffer and one all-gather brings every rank's buffer; the full tensors are cut
# out of it (a copy each: rank-major rows are not contiguous per tensor). The next bucket's
# all-gather is issued before the current bucket's tensors are yielded, so it is on the
# wire while the consumer handles them; in flight at once: this bucket's gathered buffer
# and the next one's input and output, about two buckets. Other layouts (tensor or expert
# parallel placements, ``Shard(d>0)``, strided shards) are gathered alone with
# ``full_tensor()``; replicated and plain tensors need no collective. Every rank runs the
# same collectives in the same order (the plan depends only on the model); ranks outside
# ``ranks`` run them too but skip the copies out and yield nothing.


@dataclass
class Item:
    """One tensor to stream: ``name`` (as yielded), the model's ``tensor``, the ``dtype``
    to yield it in, and how it is gathered (``kind``: "rows" bucketed, "full" alone,
    "local" without a collective)."""

    name: str
    tensor: torch.Tensor
    dtype: torch.dtype
    kind: str
    dim: int | None = None  # the mesh dim of a "rows" tensor's shard
    aliases: list[str] = field(default_factory=list)  # tied names yielded after it


@dataclass
class _Bucket:
    items: list[Item]
    group: dist.ProcessGroup
    size: int  # ranks in the group
    order: list[int]  # for each group rank, its coordinate on the mesh dim
    device: torch.device
    dtype: torch.dtype


def _rows_dim(t: torch.Tensor) -> int | None:
    """The mesh dim of a DTensor sharded on tensor dim 0 over exactly one mesh dim of more
    than one rank and replicated on the others (FSDP, HSDP); ``None`` otherwise."""
    if not isinstance(t, DTensor) or t.dim() == 0:
        return None
    placements = t.placements
    if any(type(p) not in (Shard, Replicate) for p in placements):
        return None
    sharded = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    if len(sharded) != 1 or cast(Shard, placements[sharded[0]]).dim != 0:
        return None
    return sharded[0] if t.device_mesh.size(sharded[0]) > 1 else None


def _needs_no_collective(t: torch.Tensor) -> bool:
    if not isinstance(t, DTensor):
        return True
    mesh = t.device_mesh
    return all(isinstance(p, Replicate) or mesh.size(i) == 1 for i, p in enumerate(t.placements))


def plan(named: list[tuple[str, torch.Tensor, torch.dtype, list[str]]]) -> list[Item]:
    """The items, in order: how each tensor is gathered."""
    items = []
    for name, t, dtype, aliases in named:
        dim = _rows_dim(t)
        if dim is not None:
            kind = "rows"
        elif _needs_no_collective(t):
            kind = "local"
        else:
            kind = "full"
        items.append(Item(name, t, dtype, kind, dim, aliases))
    return items


def _segments(items: list[Item], bucket_bytes: int) -> list[_Bucket | Item]:
    """Consecutive "rows" items sharing a group and dtype, cut at ``bucket_bytes`` of
    gathered bytes (a larger tensor alone); other items alone."""
    out: list[_Bucket | Item] = []
    current: _Bucket | None = None
    used = 0
    for item in items:
        if item.kind != "rows":
            out.append(item)
            current = None
            continue
        t = cast(DTensor, item.tensor)
        mesh, dim = t.device_mesh, cast(int, item.dim)
        group, size = mesh.get_group(dim), mesh.size(dim)
        nbytes = -(-t.shape[0] // size) * size * (t.numel() // t.shape[0]) * item.dtype.itemsize
        fits = current is not None and used + nbytes <= bucket_bytes
        if current is None or current.group is not group or current.dtype != item.dtype or not fits:
            ranks = mesh.mesh
            order = [
                int((ranks == g).nonzero()[0][dim]) for g in dist.get_process_group_ranks(group)
            ]
            current = _Bucket([], group, size, order, _comm_device(mesh), item.dtype)
            out.append(current)
            used = 0
        current.items.append(item)
        used += nbytes
    return out


@dataclass
class _Flight:
    bucket: _Bucket
    output: torch.Tensor
    work: Any
    per_rank: int


def _issue(bucket: _Bucket) -> _Flight:
    """Pack this rank's rows of every tensor of ``bucket`` and issue one all-gather."""
    shapes = [item.tensor.shape for item in bucket.items]
    chunks = [-(-s[0] // bucket.size) for s in shapes]
    widths = [c * (s.numel() // s[0]) for c, s in zip(chunks, shapes, strict=True)]
    per_rank = sum(widths)
    packed = torch.empty(per_rank, dtype=bucket.dtype, device=bucket.device)
    at = 0
    for item, chunk, width in zip(bucket.items, chunks, widths, strict=True):
        rows = packed[at : at + width].view(chunk, *item.tensor.shape[1:])
        local = plain(cast(DTensor, item.tensor)._local_tensor, item.name)
        rows[: local.shape[0]].copy_(local)
        rows[local.shape[0] :].zero_()
        at += width
    output = torch.empty(bucket.size * per_rank, dtype=bucket.dtype, device=bucket.device)
    work = all_gather_single(output, packed, bucket.group, async_op=True)
    return _Flight(bucket, output, work, per_rank)


def _unpack(flight: _Flight) -> Iterator[tuple[Item, torch.Tensor]]:
    bucket = flight.bucket
    flight.work.wait()
    by_rank = flight.output.view(bucket.size, flight.per_rank)
    slots = sorted(range(bucket.size), key=lambda k: bucket.order[k])  # mesh order
    at = 0
    for item in bucket.items:
        shape = item.tensor.shape
        chunk = -(-shape[0] // bucket.size)
        width = chunk * (shape.numel() // shape[0])
        pieces = [by_rank[k, at : at + width].view(chunk, *shape[1:]) for k in slots]
        yield item, torch.cat(pieces)[: shape[0]]
        at += width


def _alone(item: Item) -> torch.Tensor:
    """A "full" or "local" item's full value (``full_tensor()`` is collective)."""
    t = item.tensor
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        src = plain(t._local_tensor, item.name)
        local = src.to(device=_comm_device(mesh), dtype=item.dtype)
        if item.kind == "local":
            return local.clone() if local.data_ptr() == src.data_ptr() else local
        spread = DTensor.from_local(
            local, mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
        return spread.full_tensor()
    out = plain(t, item.name).detach().to(item.dtype)
    return out.clone() if out is t or out.data_ptr() == t.data_ptr() else out


def stream(
    items: list[Item], bucket_bytes: int, receive: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for ``items`` in order (also each alias), the next
    bucket's all-gather in flight while the current one's tensors are yielded; with
    ``receive=False`` run the same collectives and yield nothing."""
    segments = _segments(items, bucket_bytes)
    flights: dict[int, _Flight] = {}

    def launch(i: int) -> None:
        if i < len(segments) and i not in flights and isinstance(segments[i], _Bucket):
            flights[i] = _issue(cast(_Bucket, segments[i]))

    for i, segment in enumerate(segments):
        launch(i)
        launch(i + 1)  # on the wire while this segment is handed out
        if isinstance(segment, _Bucket):
            flight = flights.pop(i)
            if not receive:
                flight.work.wait()
                continue
            for item, full in _unpack(flight):
                yield item.name, full
                for alias in item.aliases:
                    yield alias, full
            continue
        item = segment
        if item.kind == "local" and not receive:
            continue
        full = _alone(item)
        if receive:
            yield item.name, full
            for alias in item.aliases:
                yield alias, full
