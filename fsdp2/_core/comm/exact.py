"""Sums in a fixed order: the canonical tree, the tree over a stream of micro-batches, and
the exchanges that reduce across ranks in that order (``fsdp2.reduction``'s engine).

[Note: canonical sum]
The sum of pieces x_0 .. x_{n-1} is S(x_0 .. x_{p-1}) + S(x_p .. x_{n-1}), with p the
largest power of two below n (S of one piece is itself). For n a power of two that is the
balanced pairwise tree. Its point: for n = m * k with k a power of two, S over n pieces
equals S over the m sums of k consecutive pieces (the splits of the n-tree fall on
multiples of k). So when each of W ranks sums k consecutive micro-batches (k a power of
two) and the W sums are summed in rank order, the tree is the one a single rank builds over
all W * k micro-batches: the bits do not depend on the world size. ``TreeSum`` builds the
tree over a stream (a binary counter: at most log2(k) + 1 partial sums alive), and the
exchanges sum what the ranks send in the same tree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "ExchangeWork",
    "TreeSum",
    "canonical_sum",
    "exchange_all_reduce",
    "exchange_reduce_scatter",
    "is_power_of_two",
]

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def canonical_sum(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """The canonical tree sum of ``pieces`` ([Note: canonical sum]), in place into the first
    piece of each split."""
    n = len(pieces)
    if n == 0:
        raise ValueError("canonical_sum: no pieces")
    if n == 1:
        return pieces[0]
    p = 1 << ((n - 1).bit_length() - 1)
    return canonical_sum(pieces[:p]).add_(canonical_sum(pieces[p:]))


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return a.add_(b)


class TreeSum:
    """The canonical sum of a stream of leaves (a leaf may be ``None``: no gradient in that
    micro-batch, which adds nothing), kept as a binary counter of partial sums."""

    __slots__ = ("levels",)

    def __init__(self) -> None:
        self.levels: list[tuple[int, torch.Tensor | None]] = []  # oldest (largest) first

    def push(self, leaf: torch.Tensor | None) -> None:
        level, x = 0, leaf
        while self.levels and self.levels[-1][0] == level:
            _, older = self.levels.pop()
            x = _add(older, x)
            level += 1
        self.levels.append((level, x))

    def fold(self) -> torch.Tensor | None:
        """The sum of every leaf pushed (S(older) + (... + S(newest))), and empty again."""
        total: torch.Tensor | None = None
        for _, x in reversed(self.levels):
            total = _add(x, total) if x is not None else total
        self.levels.clear()
        return total


class ExchangeWork:
    """A ``Work`` whose ``wait`` waits an exchange and then runs what finishes it (the sum,
    maybe a second exchange)."""

    __slots__ = ("work", "finish")

    def __init__(self, work: Any, finish: Callable[[], None] | None) -> None:
        self.work, self.finish = work, finish

    def wait(self, timeout: Any = None) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        return True


def _fp8_pack(rows: torch.Tensor, dtype: torch.dtype, block: int) -> tuple[torch.Tensor, Any]:
    """Each row as fp8 values (padded to whole blocks) followed by one fp32 scale per block,
    in one ``uint8`` row; and the function that reads received rows back as fp32."""
    world, numel = rows.shape
    blocks = -(-numel // block)
    padded = torch.zeros(world, blocks * block, dtype=torch.float32, device=rows.device)
    padded[:, :numel] = rows
    grid = padded.view(world, blocks, block)
    scale = grid.abs().amax(dim=-1, keepdim=True).div_(torch.finfo(dtype).max)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = (grid / scale).to(dtype).view(torch.uint8).view(world, -1)
    send = torch.cat([values, scale.view(world, blocks).view(torch.uint8)], dim=1)

    def unpack(recv: torch.Tensor) -> torch.Tensor:
        vals = recv[:, : blocks * block].contiguous().view(dtype).float()
        scales = recv[:, blocks * block :].contiguous().view(torch.float32)
        out = vals.view(world, blocks, block) * scales.view(world, blocks, 1)
        return out.view(world, -1)[:, :numel]

    return send, unpack


def _encode(rows: torch.Tensor, wire: torch.dtype, block: int) -> tuple[torch.Tensor, Any]:
    """``rows`` as they travel in ``wire`` (fp8: packed with per-block scales), and the
    function that reads received rows back as fp32."""
    if wire in FP8:
        return _fp8_pack(rows, wire, block)
    send = rows if rows.dtype == wire else rows.to(wire)
    return send, lambda recv: recv.float()


def exchange_reduce_scatter(
    output: torch.Tensor,
    rows: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    wire: torch.dtype,
    block: int,
    average: bool,
) -> tuple[ExchangeWork, int]:
    """Reduce-scatter the ``(world, numel)`` ``rows`` into ``output`` (``numel``): row ``r``
    goes to rank ``r`` in ``wire`` (one ``all_to_all_single``); each rank sums what it
    receives in fp32 in the canonical order, divides by the world size if ``average``, and
    casts into ``output`` at the wait. Returns the work and the bytes this rank sends."""
    world = rows.size(0)
    send, decode = _encode(rows, wire, block)
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv.view(-1), send.view(-1), group=group, async_op=True)

    def finish() -> None:
        # fp32 pieces (``recv`` itself when it is fp32: it is ours to sum into)
        total = canonical_sum(list(decode(recv).unbind(0)))
        if average:
            total.div_(world)
        output.copy_(total)

    return ExchangeWork(work, finish), send.numel() * send.element_size()


def exchange_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    wire: torch.dtype | None = None,
    block: int = 128,
    average: bool = False,
) -> tuple[ExchangeWork, int]:
    """Sum (or average) ``tensor`` (1D) over ``group`` in place, in the canonical order over
    the group's ranks: each rank sums one chunk of every rank's tensor in fp32 (an exchange in
    ``wire``), then the summed chunks travel back (in ``wire`` too, so every rank ends with
    the same values, its own chunk read back as the others read it); a ring all-reduce's
    bytes. Returns the work and the bytes this rank sends."""
    world = group.size()
    n = tensor.numel()
    chunk = -(-n // world)
    if n == world * chunk:  # sent as it is (only overwritten once the exchanges are done)
        rows = tensor.view(world, chunk)
    else:
        rows = tensor.new_zeros(world * chunk)
        rows[:n] = tensor
        rows = rows.view(world, chunk)
    mine = torch.empty(chunk, dtype=torch.float32, device=tensor.device)
    wire = wire or tensor.dtype
    first, sent = exchange_reduce_scatter(
        mine, rows, group, wire=wire, block=block, average=average
    )

    def finish() -> None:
        send, decode = _encode(mine.expand(world, chunk), wire, block)
        send = send.contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv.view(-1), send.view(-1), group=group)
        tensor.copy_(decode(recv).reshape(-1)[:n])

    # the second exchange's bytes equal the first's (same rows, same wire)
    return ExchangeWork(first, finish), 2 * sent
