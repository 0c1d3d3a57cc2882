"""The step's matrices, buckets and exchanges: shards to their owners, Newton-Schulz on the
full matrices, results back (see ``fsdp2.muon``)."""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# ---------------------------------------------------------------------------------------------
# The step


@dataclass(eq=False)
class _Pieces:
    """Where each rank's local piece of a matrix sharded over several mesh dims (or by a
    ``_StridedShard``) lies in the full matrix: rank ``r`` of the route holds
    ``full[index[r]]``, of shape ``shapes[r]``. Each index is a pair of slices where the
    piece's rows and columns are contiguous ranges (TP + FSDP layouts), else of index tensors
    (on the route's device) broadcasting to the piece's shape."""

    index: list[tuple[Any, Any]]
    shapes: list[tuple[int, int]]


@dataclass(eq=False)
class _Matrix:
    """One parameter's part of a step: its local tensors and full shape."""

    local: torch.Tensor  # the local shard of the parameter
    grad: torch.Tensor  # ... of its gradient
    buf: torch.Tensor | None  # ... of its momentum buffer (set before the exchanges)
    group: dict[str, Any]  # its param group
    rows: int
    cols: int
    dim: int  # the tensor dim sharded (0 when not sharded)
    sizes: tuple[int, ...]  # each rank's extent along ``dim``
    pieces: _Pieces | None = None  # instead of ``dim`` and ``sizes``: see ``_Pieces``
    owner: int = 0

    def piece_shape(self, rank: int) -> tuple[int, int]:
        if self.pieces is not None:
            return self.pieces.shapes[rank]
        extent = self.sizes[rank]
        return (extent, self.cols) if self.dim == 0 else (self.rows, extent)

    def piece_numel(self, rank: int) -> int:
        rows, cols = self.piece_shape(rank)
        return rows * cols

    @property
    def cost(self) -> int:
        return self.rows * self.cols * min(self.rows, self.cols)


@dataclass(eq=False)
class _Route:
    """The matrices sharded over one process group (``None``: not sharded, no collectives),
    in parameter order."""

    pg: Any
    world: int
    rank: int  # this rank's index in ``pg``
    device: torch.device  # where the full matrices are orthogonalized
    matrices: list[_Matrix] = field(default_factory=list)


@dataclass(eq=False)
class _Bucket:
    """Matrices of one route exchanged together; ``order`` is the wire order (by owner, then
    parameter order), ``owned`` this rank's matrices."""

    route: _Route
    order: list[_Matrix]
    owned: list[_Matrix]
    to_owners: list[int]  # numel this rank sends to each rank (its shards of their matrices)
    from_ranks: list[int]  # numel this rank receives from each rank (shards of its matrices)
    own: int  # numel of this rank's shards of its own matrices (not sent: 0 in the lists)
    traffic: bool  # whether any rank sends anything (else no collective)


def _buckets(route: _Route, bucket_bytes: int) -> list[_Bucket]:
    """Split ``route``'s matrices into buckets (consecutive, at most ``bucket_bytes`` of
    bfloat16 full matrices unless one alone is larger) and pick the owners: within each
    bucket, largest Newton-Schulz cost first, each to the rank with the least cost so far
    (lowest rank on ties). Deterministic: the same on every rank."""
    groups: list[list[_Matrix]] = []
    size = 0
    for m in route.matrices:
        nbytes = 2 * m.rows * m.cols
        if not groups or size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(m)
        size += nbytes
    loads = [(0, r) for r in range(route.world)]  # a heap of (cost so far, rank)
    out = []
    for ms in groups:
        for i in sorted(range(len(ms)), key=lambda i: (-ms[i].cost, i)):
            load, rank = heapq.heappop(loads)
            ms[i].owner = rank
            heapq.heappush(loads, (load + ms[i].cost, rank))
        me = route.rank
        order = sorted(ms, key=lambda m: m.owner)  # stable: parameter order within an owner
        owned = [m for m in ms if m.owner == me]
        to_owners = [0] * route.world
        for m in ms:
            to_owners[m.owner] += m.piece_numel(me)
        from_ranks = [sum(m.piece_numel(r) for m in owned) for r in range(route.world)]
        own = to_owners[me]
        to_owners[me] = from_ranks[me] = 0
        traffic = any(m.piece_numel(r) for m in ms for r in range(route.world) if r != m.owner)
        out.append(_Bucket(route, order, owned, to_owners, from_ranks, own, traffic))
    return out


class _Exchange:
    """An ``all_to_all_single`` in flight (none without traffic), and this rank's shards of
    its own matrices, which stay here (``own``)."""

    def __init__(
        self,
        bucket: _Bucket,
        flat: torch.Tensor,
        send: list[int],
        receive: list[int],
        own: torch.Tensor,
    ) -> None:
        self.work: Any = None
        self.inp: torch.Tensor | None = None
        self.own = own
        self.out = flat.new_empty(sum(receive))
        route = bucket.route
        if route.pg is None or not bucket.traffic:
            return  # nothing to move: every size is 0
        self.inp = flat  # kept alive until the collective finished
        self.work = dist.all_to_all_single(
            self.out,
            flat,
            output_split_sizes=receive,
            input_split_sizes=send,
            group=route.pg,
            async_op=True,
        )

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.inp = None  # sent: its memory may go (unless the caller still holds it)
        return self.out


def _run(buckets: list[_Bucket]) -> None:
    """Momentum, exchanges, Newton-Schulz and the update, bucket by bucket: the next
    bucket's shards go out before this bucket's Newton-Schulz runs, and this rank's own
    shards are worked on while the others travel (their momentum after the shards went out,
    their update before the results come back)."""
    if not buckets:
        return
    to_owners = _send_to_owners(buckets[0])
    returning: deque[tuple[_Bucket, _Exchange]] = deque()
    for i, bucket in enumerate(buckets):
        received = to_owners.wait()  # the send buffer goes here (sent)
        own = to_owners.own
        if i + 1 < len(buckets):
            to_owners = _send_to_owners(buckets[i + 1])
        results = _orthogonalize(bucket, received, own)
        del received, own
        _apply(bucket, results, mine=True)
        returning.append((bucket, results))
        if len(returning) > 1:
            _apply(*returning.popleft(), mine=False)
    while returning:
        _apply(*returning.popleft(), mine=False)


def _send_to_owners(bucket: _Bucket) -> _Exchange:
    """Update the momentum of the bucket's shards and send each shard's update (bfloat16)
    to its matrix's owner: first the shards of the other ranks' matrices, then, while they
    travel, this rank's own, into the exchange's ``own`` buffer."""
    route = bucket.route
    flat = torch.empty(sum(bucket.to_owners), dtype=torch.bfloat16, device=route.device)
    own = torch.empty(bucket.own, dtype=torch.bfloat16, device=route.device)
    _pack(bucket, flat, mine=False)
    exchange = _Exchange(bucket, flat, bucket.to_owners, bucket.from_ranks, own)
    _pack(bucket, own, mine=True)
    return exchange


def _pack(bucket: _Bucket, into: torch.Tensor, *, mine: bool) -> None:
    """The momentum update of the bucket's shards of this rank's matrices (``mine``) or of
    the others', each shard's update written to ``into`` in bfloat16, in wire order."""
    offset = 0
    for m in bucket.order:
        if (m.owner == bucket.route.rank) != mine:
            continue
        assert m.buf is not None
        momentum = m.group["momentum"]
        m.buf.lerp_(m.grad, 1 - momentum)
        n = m.grad.numel()
        slot = into[offset : offset + n].view(m.grad.shape)
        offset += n
        if not m.group["nesterov"]:
            slot.copy_(m.buf)  # to bfloat16, in place
        elif slot.device == m.grad.device:
            torch.lerp(m.grad, m.buf, momentum, out=slot)  # the same rounding, no temporary
        else:  # offloaded shards, the exchange on the mesh's device
            slot.copy_(m.grad.lerp(m.buf, momentum))


def _orthogonalize(bucket: _Bucket, received: torch.Tensor, own: torch.Tensor) -> _Exchange:
    """Put this rank's matrices together from the shards received and its own, orthogonalize
    them and send every rank its shards of the results. The results overwrite the shards
    they came from in ``received`` (the return exchange's layout is the same) and in
    ``own``; the others come back into a new buffer. So at most about one bucket's worth of
    flat buffers is alive on a rank at once: its shards (sent, then ``own``) and those of
    its matrices (``received``, then the results coming back)."""
    route = bucket.route
    me = route.rank
    offsets = [0]
    for n in bucket.from_ranks[:-1]:
        offsets.append(offsets[-1] + n)
    offsets[me] = 0  # this rank's pieces: in ``own``
    for m in bucket.owned:
        pieces = []
        for r in range(route.world):
            n = m.piece_numel(r)
            source = own if r == me else received
            pieces.append(source[offsets[r] : offsets[r] + n].view(m.piece_shape(r)))
            offsets[r] += n
        if m.pieces is None:
            full = pieces[0] if route.world == 1 else torch.cat(pieces, dim=m.dim)
        else:
            full = received.new_empty(m.rows, m.cols)
            for index, piece in zip(m.pieces.index, pieces, strict=True):
                full[index] = piece
        g = m.group
        ortho = _newton_schulz(full, g["ns_coefficients"], g["ns_steps"], g["eps"])
        if m.pieces is None:
            results = torch.split(ortho, list(m.sizes), dim=m.dim)
        else:
            results = tuple(ortho[index] for index in m.pieces.index)
        for piece, result in zip(pieces, results, strict=True):
            piece.copy_(result)  # the shard's slot now holds its result
        del full, ortho, results, pieces
    return _Exchange(bucket, received, bucket.from_ranks, bucket.to_owners, own)


def _apply(bucket: _Bucket, exchange: _Exchange, *, mine: bool) -> None:
    """Weight decay and this rank's shards of the orthogonalized updates: of its own
    matrices (``mine``: the results are here) or of the others' (waits for them)."""
    source = exchange.own if mine else exchange.wait()
    offset = 0
    for m in bucket.order:
        if (m.owner == bucket.route.rank) != mine:
            continue
        n = m.local.numel()
        update = source[offset : offset + n].view(m.local.shape).to(m.local.device)
        offset += n
        g = m.group
        lr = _scalar(g["lr"])
        m.local.mul_(1 - lr * g["weight_decay"])
        m.local.add_(update, alpha=-_adjust_lr(lr, g["adjust_lr_fn"], m.rows, m.cols))


def _scalar(x: Any) -> Any:
    """A hyperparameter as ``torch.optim.Muon`` uses it (a tensor squeezed to 0-d)."""
    return x.squeeze() if isinstance(x, torch.Tensor) and x.dim() != 0 else x


def _adjust_lr(lr: Any, adjust_lr_fn: str | None, rows: int, cols: int) -> Any:
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    return lr


def _check_ns_settings(coefficients: Any, steps: int) -> None:
    if steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")


def _newton_schulz(
    update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalization of a full 2-D update, in bfloat16 (may
    overwrite ``update`` when it is bfloat16 already)."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b * A + c * A @ A
        x = torch.addmm(x, poly, x, beta=a)  # a * X + (b * A + c * A @ A) @ X
    return x.T if tall else x
