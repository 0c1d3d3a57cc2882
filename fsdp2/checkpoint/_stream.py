"""Full tensors streamed in memory, bucket by bucket: ``iter_full_tensors``'s engine.
See [Note: streamed full tensors]."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from fsdp2._core.front.seam import gather_pieces
from fsdp2.checkpoint._save import (
    comm_device,
    coordinates,
    full_on_mesh,
    plain,
    row_layout,
    shard_dim,
)

__all__ = ["Item", "Term", "plan", "stream"]

# [Note: streamed full tensors]
# An inference engine fed after every optimizer step (RL post-training) wants the model's
# full tensors, in state-dict order, as fast as the wire allows. Walking ``state_dict()``
# with ``full_tensor()`` costs one all-gather per tensor (about 290 for a 0.5B model), each
# with DTensor's dispatch. Here every tensor sharded on dim 0 over one mesh dim (FSDP, the
# shard dim of HSDP; uneven sizes padded as ``torch.chunk`` splits them) joins a *bucket*
# of consecutive such tensors with the same process group and dtype, up to ``bucket_bytes``
# of memory (the gathered tensors and this rank's packed rows): each rank packs its (cast,
# padded) rows of every tensor of the bucket into one buffer, and the engine's all-gather
# (``seam.gather_pieces``) lands every rank's rows of each tensor in that tensor's own
# (padded) buffer: on gloo straight from the wire, elsewhere copied out of the rank-major
# result. The next bucket's all-gather is issued once the current one is waited for and
# its first tensor handed out, so it is on the wire while the consumer handles the rest.
# Memory: nothing here holds a tensor once handed out or an input once waited for, so with
# a consumer that holds one tensor at a time, at most the current bucket's tensors, the
# next one's and this rank's packed rows of the next are alive: under two buckets
# (measured in benchmarks/weight_sync.py); a tensor larger than a bucket goes alone.
# Other layouts (tensor or expert parallel placements, ``Shard(d>0)``, strided shards) are
# gathered alone with ``full_tensor()``; replicated and plain tensors need no collective.
# Every rank runs the same collectives in the same order (the plan depends only on the
# model); ranks outside ``ranks`` run them too and yield nothing (the buckets are cut from
# the whole list on every rank).
# LoRA merged on the way out (``merge_lora=True``): an item may carry *terms*, each adding
# ``transpose(B @ A) * scale`` (or a LoRA bias ``B.bias * scale``) to its value, as PEFT's
# ``merge`` does. Before the first bucket, every term's A and B are gathered whole (the
# adapters are small; bucketed like the rest and kept until the end). A "rows" item then
# merges only its own rows before packing them: ``B[rows] @ A``, or ``(B @ A[:, rows]).T``
# when transposed (embeddings, ``fan_in_fan_out``), so no rank forms the whole delta and
# the base weight is never gathered unmerged. Other items merge their full value.


@dataclass
class Term:
    """One LoRA term of a merged tensor: ``transpose(b @ a, transpose) * scale``, or
    ``b * scale`` when ``a`` is None (a LoRA bias). ``full_a``/``full_b`` are their full
    values, filled before the stream starts."""

    a: torch.Tensor | None
    b: torch.Tensor
    scale: float
    transpose: bool
    full_a: torch.Tensor | None = None
    full_b: torch.Tensor | None = None


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
    terms: list[Term] = field(default_factory=list)  # LoRA terms merged into it


@dataclass
class _Bucket:
    items: list[Item]
    group: dist.ProcessGroup
    size: int  # ranks in the group
    order: list[int]  # for each group rank, its coordinate on the mesh dim
    device: torch.device
    dtype: torch.dtype


def _kind(t: torch.Tensor) -> tuple[str, int | None]:
    """How ``t`` is gathered, and the mesh dim of a "rows" tensor's shard."""
    if not isinstance(t, DTensor) or t.numel() == 0:  # an empty one needs no collective
        return "local", None
    mesh = t.device_mesh
    if all(isinstance(p, Replicate) or mesh.size(i) == 1 for i, p in enumerate(t.placements)):
        return "local", None
    dim = shard_dim(t) if row_layout(t) else None
    return ("rows", dim) if dim is not None else ("full", None)


def plan(
    named: list[tuple[str, torch.Tensor, torch.dtype, list[str]]],
    terms: dict[str, list[Term]] | None = None,
) -> list[Item]:
    """The items, in order: how each tensor is gathered (``terms``: by yielded name)."""
    terms = terms or {}
    return [
        Item(name, t, dtype, *_kind(t), aliases, terms.get(name, []))
        for name, t, dtype, aliases in named
    ]


def _delta(term: Term, rows: slice | None) -> torch.Tensor:
    """``term``'s addend, for the full tensor or only its ``rows``, computed as PEFT's
    ``get_delta_weight`` does (a CPU half-precision product in fp32)."""
    b, a = cast(torch.Tensor, term.full_b), term.full_a
    if a is None:
        return (b if rows is None else b[rows]) * term.scale
    low = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
    if low:
        a, b = a.float(), b.float()
    if term.transpose:
        delta = (b @ (a if rows is None else a[:, rows])).T
    else:
        delta = (b if rows is None else b[rows]) @ a
    delta = delta * term.scale
    return delta.to(cast(torch.Tensor, term.full_b).dtype) if low else delta


def _merged(item: Item, value: torch.Tensor, rows: slice | None) -> torch.Tensor:
    """``value`` (the full tensor, or its ``rows``) with ``item``'s terms added, in its
    dtype (PEFT adds each in place)."""
    for term in item.terms:
        value = torch.add(value, _delta(term, rows)).to(value.dtype)
    return value


def _gather_terms(items: list[Item], bucket_bytes: int) -> None:
    """Fill every term's ``full_a``/``full_b`` (collective: every rank, same order)."""
    sources: dict[int, torch.Tensor] = {}
    for item in items:
        for term in item.terms:
            for t in (term.a, term.b):
                if t is not None:
                    sources.setdefault(id(t), t)
    if not sources:
        return
    named: list[tuple[str, torch.Tensor, torch.dtype, list[str]]] = [
        (f"lora term {i}", t, t.dtype, []) for i, t in enumerate(sources.values())
    ]
    fulls = {id(item.tensor): full for item, full in _fulls(plan(named), bucket_bytes)}
    for item in items:
        for term in item.terms:
            term.full_a = None if term.a is None else fulls[id(term.a)]
            term.full_b = fulls[id(term.b)]


def _segments(items: list[Item], bucket_bytes: int) -> list[_Bucket | Item]:
    """Consecutive "rows" items sharing a group and dtype, cut at ``bucket_bytes`` of
    memory (gathered tensors and this rank's packed input; a larger tensor alone); other
    items alone."""
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
        rows = -(-t.shape[0] // size) * (t.numel() // t.shape[0]) * item.dtype.itemsize
        nbytes = rows * (size + 1)  # its full (padded) tensor and this rank's packed rows
        fits = current is not None and used + nbytes <= bucket_bytes
        same = current is not None and current.group is group and current.dtype == item.dtype
        if current is None or not (same and fits):
            order = coordinates(mesh, dim, group)
            current = _Bucket([], group, size, order, comm_device(mesh), item.dtype)
            out.append(current)
            used = 0
        current.items.append(item)
        used += nbytes
    return out


@dataclass
class _Flight:
    bucket: _Bucket
    fulls: list[torch.Tensor]  # each tensor's padded full buffer, filled once waited
    wait: Callable[[], None]


def _issue(bucket: _Bucket) -> _Flight:
    """Pack this rank's rows of every tensor of ``bucket`` and issue one all-gather into
    each tensor's padded full buffer."""
    widths = []
    for item in bucket.items:
        shape = item.tensor.shape
        widths.append(-(-shape[0] // bucket.size) * (shape.numel() // shape[0]))
    packed = torch.empty(sum(widths), dtype=bucket.dtype, device=bucket.device)
    for item, rows in zip(bucket.items, packed.split(widths), strict=True):
        t = cast(DTensor, item.tensor)
        local = plain(t._local_tensor, item.name)
        if item.terms:
            first = t.device_mesh.get_local_rank(item.dim) * -(-t.shape[0] // bucket.size)
            local = _merged(item, local, slice(first, first + local.shape[0]))
        rows = rows.view(-1, *item.tensor.shape[1:])
        rows[: local.shape[0]].copy_(local)
        rows[local.shape[0] :].zero_()
    fulls: list[torch.Tensor] = []

    def make_rows() -> list[list[torch.Tensor]]:  # when the rows are needed, not before
        for w in widths:
            fulls.append(torch.empty(bucket.size * w, dtype=bucket.dtype, device=bucket.device))
        return [
            [full[c * w : (c + 1) * w] for full, w in zip(fulls, widths, strict=True)]
            for c in bucket.order  # group rank r's rows go to its coordinate's place
        ]

    wait = gather_pieces(packed, widths, make_rows, bucket.group, bucket.size, "iter_full_tensors")
    return _Flight(bucket, fulls, wait)


def _unpack(flight: _Flight) -> Iterator[tuple[Item, torch.Tensor]]:
    """The bucket's tensors (waited for). Nothing here keeps a tensor alive once handed
    out (nor the packed input once waited): a consumer that drops each tensor frees the
    bucket as it goes."""
    fulls = flight.fulls[::-1]
    flight.fulls.clear()  # the list the rows were made into: held by nothing now
    for item in flight.bucket.items:
        full = fulls.pop()
        shape = item.tensor.shape
        yield item, full[: shape.numel()].view(shape)
        del full


def _waited() -> None:
    pass


def _alone(item: Item) -> torch.Tensor:
    """A "full" or "local" item's full value (``full_tensor()`` is collective)."""
    t = item.tensor
    if item.kind == "full":
        dtype = t.dtype if item.terms else item.dtype  # merged before the cast
        return _merged(item, full_on_mesh(cast(DTensor, t), dtype, item.name), None).to(item.dtype)
    src = plain(t._local_tensor if isinstance(t, DTensor) else t.detach(), item.name)
    device = comm_device(t.device_mesh) if isinstance(t, DTensor) else src.device
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=item.dtype, device=device)
    if item.terms:
        return _merged(item, src.to(device), None).to(item.dtype)
    out = src.to(device=device, dtype=item.dtype)
    return out.clone() if out.data_ptr() == src.data_ptr() else out


def _fulls(
    items: list[Item], bucket_bytes: int, receive: bool = True
) -> Iterator[tuple[Item, torch.Tensor]]:
    """Every item with its full value, in order, the next bucket's all-gather issued once
    the current bucket's first tensor is handed out. With ``receive=False``, "local" items are
    skipped: the buckets are cut from the whole list all the same (a local item between
    two row tensors ends a bucket on every rank, or the ranks' all-gathers differ)."""
    segments = _segments(items, bucket_bytes)
    ahead: _Flight | None = None
    for i, segment in enumerate(segments):
        nxt = segments[i + 1] if i + 1 < len(segments) else None
        if isinstance(segment, _Bucket):
            flight = ahead or _issue(segment)
            flight.wait()  # before the next is issued: its packed input is freed first
            flight.wait = _waited
            ahead = None
            for n, pair in enumerate(_unpack(flight)):
                yield pair
                if n == 0 and isinstance(nxt, _Bucket):
                    # The consumer holds this bucket's first tensor and none of the last
                    # bucket's: the next one's all-gather goes on the wire now.
                    ahead = _issue(nxt)
        else:
            ahead = _issue(nxt) if isinstance(nxt, _Bucket) else None  # on the wire meanwhile
            if receive or segment.kind != "local":
                yield segment, _alone(segment)


def stream(
    items: list[Item], bucket_bytes: int, receive: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for ``items`` in order (each alias right after its
    tensor); with ``receive=False`` run the same collectives and yield nothing."""
    _gather_terms(items, bucket_bytes)
    for item, full in _fulls(items, bucket_bytes, receive):
        if receive:
            yield item.name, full
            for alias in item.aliases:
                yield alias, full
