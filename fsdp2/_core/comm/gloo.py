"""fsdp2's collectives on gloo (CPU): all-gathers and reduce-scatters by sends and
receives, faster than gloo's own and bitwise equal to them. Called by collectives.py only.
See [Note: gloo all-gather], [Note: gloo reduce-scatter], [Note: gloo straight in and out]."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from fsdp2._core.comm.transport import Pending, pack_for_reduce_scatter

__all__ = [
    "EXCHANGE_MIN_BYTES",
    "Received",
    "all_gather_by_exchange",
    "all_gather_into",
    "by_exchange",
    "is_gloo",
    "pair_exchange",
    "reduce_scatter_by_all_reduce",
    "reduce_scatter_by_exchange",
    "reduce_scatter_grads",
    "sends_any_straight",
]


# [Note: gloo all-gather]
# gloo's all_gather_single gathers into a temporary as large as the output and copies it
# out, blocking the calling thread for part of it: 12 MiB on 2 ranks here took 14-17 ms,
# against 4-5 ms for sending the input to the peer and receiving the peer's straight into
# its row of the output (4 ranks on 2 cores: 23-63 ms against 10-12 ms). An all-gather is
# copies only, so this is bitwise gloo's result at any world size, without the temporary
# (an output's worth of memory while the all-gather is in flight). Each rank posts all its
# sends and receives at once; gloo matches a pair's messages of one tag in the order they
# were posted, and every rank issues fsdp2's all-gathers in the same order (as for any
# collective). This rank's own row is not copied into the output at issue: ``Pending.wait``
# fills it, and a plain group copies its parameters' rows out of its shard directly
# (``Pending.wait_rows``: one copy instead of two). Below 256 KiB per rank gloo's own
# all-gather is used: with many tiny groups (benchmarks/overhead.py, 1 KiB each) sends and
# receives made the step 6-16% slower, while from 256 KiB up they are faster (measured in a
# prefetch pattern: 256 KiB 0.34 vs 0.51 ms, 4 MiB 2.8 vs 3.7 ms). Custom all-gathers
# (``set_custom_all_gather``) are called as they are.

# [Note: gloo reduce-scatter]
# gloo's reduce_scatter_tensor costs about twice an all-reduce of the same input, and
# blocks the calling thread for part of it: 12 MiB on 2 ranks here took 13-19 ms, against
# 9-11 ms for all_reduce and 5-6 ms for one send plus one receive of the peer's half
# (the add included). So on gloo fsdp2 reduce-scatters by its own means:
# - 2 ranks: each rank sends the peer its row and receives the peer's row of its own,
#   then adds its own row into the received one (``_Exchange``). a + b is the same bits
#   in either order, so this is bitwise gloo's result (SUM; AVG divides by 2, exact).
# - more ranks: an in-place all-reduce of the packed input, then a copy of this rank's
#   row (the copy lets the packed buffer go: gradients must not keep every rank's rows
#   alive). gloo's all-reduce rows are bitwise its reduce-scatter's; a sum of our own
#   over more than two ranks would not be (the order differs).
# tests/core/comm/test_gloo_reduce.py holds both at 2 and 4 ranks, SUM and AVG, fp32 and bf16.
# The exchange's sends carry their own tag, apart from users' point-to-point traffic.
# Custom reduce-scatters (``set_custom_reduce_scatter``) are called as they are.


def is_gloo(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether collectives on ``device`` tensors over ``group`` run on gloo."""
    return device.type == "cpu" and "gloo" in str(dist.get_backend(group))


EXCHANGE_MIN_BYTES = 256 * 1024  # see [Note: gloo all-gather]


def by_exchange(nbytes: int, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether to all-gather ``nbytes`` per rank over ``group`` by sends and receives."""
    return nbytes >= EXCHANGE_MIN_BYTES and is_gloo(group, device)


class _Exchange:
    """Two ranks' reduce-scatter by one send and one receive: ``wait`` adds this rank's own
    row to the row received from the peer (in place) once both are done."""

    __slots__ = ("works", "recv", "own", "avg")

    def __init__(self, works: _Works, recv: torch.Tensor, own: torch.Tensor, avg: bool) -> None:
        self.works, self.recv, self.own, self.avg = works, recv, own, avg

    def wait(self) -> None:
        if not self.works.wait():
            return
        self.recv.add_(self.own)  # a + b: the same bits in either order
        if self.avg:
            self.recv.div_(2)
        self.own = self.recv  # drop the packed input


_EXCHANGE_TAG = 0x46534450  # p2p tags of fsdp2's exchanges (apart from users' own sends)
_GATHER_TAG = 0x46534447


# [Note: dropped exchanges]
# A gloo send or receive must not die unwaited. Say a step raised with exchanges in flight
# and its model was then dropped, not ``reset_iter_state``d (which waits). Then the next
# collective on that process group hung on every rank, even a gloo collective of another
# model (tests/reliability/test_dropped_step.py: 3 hangs in 3 before this; in CI, a test
# after one whose recompute raised hung 4 times in about 11). So every exchange's works are
# held by a ``_Works``. If it dies unwaited, it hands them to ``_DROPPED``, which keeps them
# and their tensors alive, and each new exchange waits for those. Every rank posted them
# (a failure all ranks share), so the wait ends. A failure only some ranks saw leaves the
# ranks at odds anyway, and debug mode names it.
_DROPPED: list[list[Any]] = []


class _Works:
    """Point-to-point works waited as one; handed to ``_DROPPED`` if dropped unwaited."""

    __slots__ = ("works",)

    def __init__(self, works: list[Any]) -> None:
        self.works: list[Any] | None = works
        _wait_dropped()  # every new exchange: see [Note: dropped exchanges]

    def wait(self) -> bool:
        """Wait for the works; False if they were waited before."""
        if self.works is None:
            return False
        for w in self.works:
            w.wait()
        self.works = None
        return True

    def __del__(self) -> None:
        if self.works:
            _DROPPED.append(self.works)


def _wait_dropped() -> None:
    """Wait for the works of exchanges dropped in flight (see [Note: dropped exchanges])."""
    while _DROPPED:
        for w in _DROPPED.pop():
            w.wait()


def all_gather_by_exchange(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
) -> Pending:
    """All-gather into the ``(world, numel)`` ``output`` by sending ``input`` to every peer
    and receiving each peer's straight into its row (see [Note: gloo all-gather]). This
    rank's own row is left to ``Pending.wait`` (or read from ``input`` by ``wait_rows``)."""
    me, world = group.rank(), output.size(0)
    works = []
    for k in range(1, world):
        dst, src = (me + k) % world, (me - k) % world
        works.append(dist.isend(input, group=group, group_dst=dst, tag=_GATHER_TAG))
        works.append(dist.irecv(output[src], group=group, group_src=src, tag=_GATHER_TAG))
    return Pending(output, _Works(works), input, own_row=me)  # type: ignore[arg-type]


# [Note: gloo straight in and out]
# A plain group's all-gather by exchange can skip the rank-major output altogether: the
# unsharded parameters already have one buffer each, whose rank-``r`` row is rank ``r``'s
# slice of that parameter (its piece of the flat shard). So ``all_gather_into`` sends the
# shard piece by piece and receives each peer's pieces straight into those rows; nothing
# is copied out but this rank's own row (from its shard). Likewise a 2-rank reduce-scatter
# (``reduce_scatter_grads``) sends each gradient's rows that belong to the peer straight
# from the gradient and receives the peer's rows of this rank's slice straight into the
# reduced output, then adds its own rows from the gradients: no packed input. A message
# costs about 30 us to post here, as much as copying 64 KiB, so pieces under
# ``DIRECT_MIN_BYTES`` go the old way: neighbouring small pieces of an all-gather in one
# message received into a staging buffer and copied out; a reduce-scatter's small
# gradients packed rank-major as before, in one message. The bits are the same as the
# packed path's: copies, and the same a + b per element. On the benchmark Llama this takes
# the all-gather copy-out and the reduce-scatter packing (about 240 MiB of copies per rank
# per step) off the step's thread; see docs/benchmarks.md.

DIRECT_MIN_BYTES = 64 * 1024


@functools.lru_cache(maxsize=256)
def _segments(
    sizes: tuple[int, ...], itemsize: int
) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """The messages that carry pieces ``sizes`` (back to back in one flat tensor):
    ``(start, numel, pieces)``, each piece of at least ``DIRECT_MIN_BYTES`` alone, runs of
    smaller neighbours together, empty pieces in none."""
    segs: list[tuple[int, int, tuple[int, ...]]] = []
    run: list[int] = []
    start = off = 0
    for i, n in enumerate(sizes):
        if n * itemsize >= DIRECT_MIN_BYTES:
            if run:
                segs.append((start, off - start, tuple(run)))
                run = []
            segs.append((off, n, (i,)))
        elif n:
            if not run:
                start = off
            run.append(i)
        off += n
    if run:
        segs.append((start, off - start, tuple(run)))
    return tuple(segs)


class Received:
    """An all-gather received straight into per-parameter rows (``all_gather_into``):
    ``wait`` finishes the receives, copies the staged small pieces out and this rank's own
    row from its shard."""

    __slots__ = ("works", "staged", "own")

    def __init__(
        self,
        works: _Works,
        staged: list[tuple[torch.Tensor, list[int], list[torch.Tensor]]],
        own: tuple[torch.Tensor, list[int], list[torch.Tensor]] | None,
    ) -> None:
        self.works, self.staged, self.own = works, staged, own

    def wait_works(self) -> None:
        self.works.wait()

    def fill(self) -> None:
        """Copy what did not arrive in place (staged pieces, this rank's own row)."""
        for buf, sizes, dsts in self.staged:
            torch.split_with_sizes_copy(buf, sizes, out=dsts)
        self.staged = []
        if self.own is not None:
            src, sizes, dsts = self.own
            torch.split_with_sizes_copy(src, sizes, out=dsts)
            self.own = None

    def wait(self) -> None:
        self.wait_works()
        self.fill()


def all_gather_into(
    input: torch.Tensor, sizes: list[int], rows: list[list[torch.Tensor]], group: dist.ProcessGroup
) -> Received:
    """All-gather the flat ``input`` (pieces of ``sizes``, back to back) into
    ``rows[r][i]``: rank ``r``'s piece ``i`` (each ``(sizes[i],)``, allocated), by sends and
    receives (see [Note: gloo straight in and out])."""
    me, world = group.rank(), len(rows)
    segs = _segments(tuple(sizes), input.element_size())
    works: list[Any] = []
    staged: list[tuple[torch.Tensor, list[int], list[torch.Tensor]]] = []
    for k in range(1, world):
        dst, src = (me + k) % world, (me - k) % world
        for start, n, idx in segs:
            piece = input.narrow(0, start, n)
            works.append(dist.isend(piece, group=group, group_dst=dst, tag=_GATHER_TAG))
            if len(idx) == 1:
                into = rows[src][idx[0]]
            else:
                into = torch.empty(n, dtype=input.dtype, device=input.device)
                staged.append((into, [sizes[i] for i in idx], [rows[src][i] for i in idx]))
            works.append(dist.irecv(into, group=group, group_src=src, tag=_GATHER_TAG))
    return Received(_Works(works), staged, (input, sizes, rows[me]))


class _ExchangeGrads:
    """``reduce_scatter_grads``'s work: ``wait`` adds this rank's own rows (from the
    gradients, and from the packed small ones) into what the peer sent, in place."""

    __slots__ = ("works", "dsts", "owns", "small", "avg", "output")

    def __init__(
        self,
        works: _Works,
        dsts: list[torch.Tensor],
        owns: list[torch.Tensor],
        small: tuple[torch.Tensor, torch.Tensor, list[int], list[torch.Tensor]] | None,
        avg: bool,
        output: torch.Tensor,
    ) -> None:
        self.works, self.dsts, self.owns, self.small, self.avg = works, dsts, owns, small, avg
        self.output = output

    def wait(self) -> None:
        if not self.works.wait():  # done
            return
        if self.dsts:
            torch._foreach_add_(self.dsts, self.owns)  # a + b: the same bits in either order
        if self.small is not None:
            recv, own, sizes, dsts = self.small
            recv.add_(own)
            torch.split_with_sizes_copy(recv, sizes, out=dsts)
        if self.avg:
            self.output.div_(2)
        self.dsts, self.owns, self.small = [], [], None  # let the gradients go


def pair_exchange(world_size: int, op: Any) -> bool:
    """Whether a gloo reduce-scatter over ``world_size`` ranks with ``op`` goes by one send
    and one receive per rank (``reduce_scatter_grads`` or ``reduce_scatter_by_exchange``);
    otherwise an all-reduce stands for it ([Note: gloo reduce-scatter])."""
    return world_size == 2 and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


def _straight(grad: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``grad``'s rows go straight from it (``reduce_scatter_grads``), not packed."""
    if grad.dtype != dtype or grad.dim() == 0 or not grad.is_contiguous():
        return False
    half = -(-grad.size(0) // 2)
    return half * (grad.numel() // max(grad.size(0), 1)) * grad.element_size() >= DIRECT_MIN_BYTES


def sends_any_straight(grads: list[torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether ``reduce_scatter_grads`` would send any of ``grads`` straight (else it
    returns ``None``)."""
    return any(_straight(g, dtype) for g in grads)


def reduce_scatter_grads(
    grads: list[torch.Tensor], dtype: torch.dtype, op: Any, group: dist.ProcessGroup
) -> Pending | None:
    """Two ranks' reduce-scatter of unsharded gradients (each split on dim 0 into two
    slices of ``ceil(dim0 / 2)`` rows): each contiguous gradient of ``dtype`` with a slice
    of at least ``DIRECT_MIN_BYTES`` sends the peer's rows straight from itself, the rest
    are packed rank-major into one message (see [Note: gloo straight in and out]). The
    output is what ``pack_for_reduce_scatter`` + ``reduce_scatter`` give, bit for bit.
    ``None`` when no gradient is large enough (the caller packs them all)."""
    me = group.rank()
    peer = 1 - me
    # per gradient: its offset in the output, its slice's numel (rank r's rows start at
    # r * slice), the numel of this rank's rows and of the peer's (fewer when padded)
    plan = []
    numel = 0
    for g in grads:
        rows = g.size(0)
        inner = g.numel() // max(rows, 1)
        half = -(-rows // 2)
        mine = max(0, min(rows, (me + 1) * half) - me * half) * inner
        theirs = max(0, min(rows, (peer + 1) * half) - peer * half) * inner
        plan.append((g, numel, half * inner, mine, theirs, _straight(g, dtype)))
        numel += half * inner
    if not any(p[-1] for p in plan):
        return None
    out = torch.empty(numel, dtype=dtype, device=grads[0].device)
    works: list[Any] = []
    dsts, owns, small_grads, small_dsts, small_sizes = [], [], [], [], []
    for g, off, piece, mine, theirs, straight in plan:
        if not straight:
            if piece:
                small_grads.append(g)
                small_dsts.append(out.narrow(0, off, piece))
                small_sizes.append(piece)
            continue
        flat = g.view(-1)
        if theirs:
            send = flat.narrow(0, peer * piece, theirs)
            works.append(dist.isend(send, group=group, group_dst=peer, tag=_EXCHANGE_TAG))
        if mine:
            dst = out.narrow(0, off, mine)
            works.append(dist.irecv(dst, group=group, group_src=peer, tag=_EXCHANGE_TAG))
            dsts.append(dst)
            owns.append(flat.narrow(0, me * piece, mine))
        if mine < piece:  # padding rows: zeros, as the packed path's
            out.narrow(0, off + mine, piece - mine).zero_()
    small = None
    if small_grads:
        packed = pack_for_reduce_scatter(small_grads, 2, dtype)
        recv = torch.empty_like(packed[me])
        works.append(dist.isend(packed[peer], group=group, group_dst=peer, tag=_EXCHANGE_TAG))
        works.append(dist.irecv(recv, group=group, group_src=peer, tag=_EXCHANGE_TAG))
        small = (recv, packed[me], small_sizes, small_dsts)
    work = _ExchangeGrads(_Works(works), dsts, owns, small, op == dist.ReduceOp.AVG, out)
    return Pending(out, work)  # type: ignore[arg-type]


def reduce_scatter_by_exchange(input: torch.Tensor, op: Any, group: dist.ProcessGroup) -> Pending:
    me = group.rank()
    peer = 1 - me
    recv = torch.empty_like(input[me])
    works = [
        dist.isend(input[peer], group=group, group_dst=peer, tag=_EXCHANGE_TAG),
        dist.irecv(recv, group=group, group_src=peer, tag=_EXCHANGE_TAG),
    ]
    work = _Exchange(_Works(works), recv, input[me], op == dist.ReduceOp.AVG)
    return Pending(recv, work, input)  # type: ignore[arg-type]


def reduce_scatter_by_all_reduce(input: torch.Tensor, op: Any, group: dist.ProcessGroup) -> Any:
    """More than two gloo ranks: an in-place all-reduce stands for the reduce-scatter."""
    return dist.all_reduce(input, op=op, group=group, async_op=True)
