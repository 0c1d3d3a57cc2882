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
        out.append(_Bucket(route, order, owned, to_owners, from_ranks))
    return out


class _Exchange:
    """An ``all_to_all_single`` in flight (or, without a process group, its input)."""

    def __init__(
        self,
        route: _Route,
        flat: torch.Tensor,
        send: list[int],
        receive: list[int],
        out: torch.Tensor | None = None,
    ) -> None:
        self.work: Any = None
        self.inp: torch.Tensor | None = None
        if route.pg is None:
            self.out = flat
            return
        self.inp = flat  # kept alive until the collective finished
        self.out = flat.new_empty(sum(receive)) if out is None else out
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
    bucket's shards go out before this bucket's Newton-Schulz runs."""
    if not buckets:
        return
    to_owners, sent = _send_to_owners(buckets[0])
    returning: deque[tuple[_Bucket, _Exchange]] = deque()
    for i, bucket in enumerate(buckets):
        received = to_owners.wait()
        spare = sent  # this bucket's send buffer: sent, it receives the results back
        if i + 1 < len(buckets):
            to_owners, sent = _send_to_owners(buckets[i + 1])
        returning.append((bucket, _orthogonalize(bucket, received, spare)))
        del received, spare
        if len(returning) > 1:
            _apply(*returning.popleft())
    while returning:
        _apply(*returning.popleft())


def _send_to_owners(bucket: _Bucket) -> tuple[_Exchange, torch.Tensor]:
    """Update the momentum of the bucket's shards and send each shard's update (bfloat16)
    to its matrix's owner. Returns the exchange and its send buffer (which has the layout
    the results come back in)."""
    route = bucket.route
    flat = torch.empty(sum(bucket.to_owners), dtype=torch.bfloat16, device=route.device)
    offset = 0
    for m in bucket.order:
        assert m.buf is not None
        momentum = m.group["momentum"]
        m.buf.lerp_(m.grad, 1 - momentum)
        update = m.grad.lerp(m.buf, momentum) if m.group["nesterov"] else m.buf
        n = update.numel()
        flat[offset : offset + n].view(update.shape).copy_(update)  # to bfloat16, in place
        offset += n
        del update
    return _Exchange(route, flat, bucket.to_owners, bucket.from_ranks), flat


def _orthogonalize(bucket: _Bucket, received: torch.Tensor, spare: torch.Tensor) -> _Exchange:
    """Put this rank's matrices together from the shards received, orthogonalize them and
    send every rank its shards of the results. The results overwrite the shards they came
    from in ``received`` (the return exchange's layout is the same), and come back into
    ``spare`` (this bucket's send buffer, already sent): two flat buffers per bucket."""
    route = bucket.route
    offsets = [0]
    for n in bucket.from_ranks[:-1]:
        offsets.append(offsets[-1] + n)
    for m in bucket.owned:
        pieces = []
        for r in range(route.world):
            n = m.piece_numel(r)
            pieces.append(received[offsets[r] : offsets[r] + n].view(m.piece_shape(r)))
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
            piece.copy_(result)  # the shard's slot in ``received`` now holds its result
        del full, ortho, results, pieces
    if route.pg is None:
        spare.copy_(received)  # one rank: the results are this rank's, in its order
        return _Exchange(route, spare, bucket.from_ranks, bucket.to_owners)
    return _Exchange(route, received, bucket.from_ranks, bucket.to_owners, out=spare)


def _apply(bucket: _Bucket, exchange: _Exchange) -> None:
    """Weight decay and this rank's shards of the orthogonalized updates."""
    received = exchange.wait()
    offset = 0
    for m in bucket.order:
        n = m.local.numel()
        update = received[offset : offset + n].view(m.local.shape).to(m.local.device)
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
