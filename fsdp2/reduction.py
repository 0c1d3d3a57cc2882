"""Reductions fsdp2 does itself: a reduce-scatter as an exchange, summed locally.

A reduce-scatter can be done as an exchange: every rank sends each peer that peer's slice
of its packed gradients (one ``all_to_all_single``: the same bytes as a ring
reduce-scatter) and sums the pieces it receives itself, in an order and a precision it
chooses. :class:`ExchangeReduceScatter` is such a reduce-scatter, set like any custom one
(``FSDPModule.set_custom_reduce_scatter``, or :func:`set_exchange_reduce` on a whole
model). It gives

* **a low-precision wire with full-precision sums**: each rank's slices travel in
  ``wire_dtype`` (``torch.bfloat16``: half the bytes of fp32; ``torch.float8_e4m3fn`` /
  ``torch.float8_e5m2``: a quarter, plus one fp32 scale per ``block_size`` elements) and are
  summed in fp32 on the receiving rank. The result is exactly the fp32 sum of the
  ``wire_dtype``-rounded pieces: only each piece is rounded, once, where
  ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` rounds every partial sum inside the
  collective (an error that grows with the world size);
* **a fixed summation order**: the pieces are summed in the canonical tree over the ranks
  ([Note: canonical sum] in fsdp2/_core/comm/exact.py), whatever the collective's algorithm, so
  a reduction is reproducible bit for bit from run to run; :func:`set_deterministic` goes
  further: the same bits at every world size.

    from fsdp2.reduction import set_exchange_reduce

    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    fully_shard(model, mesh=mesh)
    set_exchange_reduce(model, wire_dtype=torch.bfloat16)  # half the bytes, fp32 sums

The gradients arrive packed in the group's reduce dtype (``reduce_dtype``, else
``param_dtype``) and leave in it: with ``reduce_dtype=torch.float32`` the wire halves fp32's
bytes; with bf16 parameters and no ``reduce_dtype`` it sends what the default sends, but sums
in fp32 and rounds once. On gloo and NCCL alike (``all_to_all_single``). docs/mixed_precision.md
has the measured errors and bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2._core.comm import exact
from fsdp2.api import ReduceScatter

__all__ = [
    "ExchangeReduceScatter",
    "canonical_sum",
    "clip_grad_norm_",
    "set_deterministic",
    "set_exchange_reduce",
]

_WIRES = (
    None,
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)


def canonical_sum(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """The canonical tree sum of ``pieces`` (same shape and dtype): ``S(x_0..x_{p-1}) +
    S(x_p..x_{n-1})`` with ``p`` the largest power of two below ``n``. A sum over ``m * k``
    pieces equals the sum over the ``m`` sums of aligned blocks of ``k`` (``k`` a power of
    two), bit for bit: [Note: canonical sum] in fsdp2/_core/comm/exact.py. Adds in place into
    the first piece of each split (pass copies to keep the pieces).

    Raises:
        ValueError: no pieces.
    """
    return exact.canonical_sum(pieces)


class ExchangeReduceScatter(ReduceScatter):
    """A reduce-scatter done as an ``all_to_all_single`` and a local fp32 sum in the
    canonical order ([Note: canonical sum]); each rank's pieces sent in ``wire_dtype``.

    Args:
        wire_dtype: the dtype on the wire: ``None`` (the reduce dtype as it comes),
            ``torch.float32``, ``torch.bfloat16``, ``torch.float16``,
            ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (fp8: scaled per block).
        block_size: fp8 only: elements per fp32 scale (each block's largest magnitude maps
            to the format's largest finite value).

    ``bytes_sent`` counts this rank's whole wire-encoded input, its own piece included (which
    it keeps, not sends; as the other collectives' byte counts do): a benchmark's measure of
    the wire rather than of the network.

    Raises:
        ValueError: an unsupported ``wire_dtype`` or a ``block_size`` below 1; at the
            reduce, an op other than ``SUM`` / ``AVG``.
    """

    def __init__(self, wire_dtype: torch.dtype | None = None, *, block_size: int = 128) -> None:
        if wire_dtype not in _WIRES:
            raise ValueError(
                f"ExchangeReduceScatter: wire_dtype must be one of "
                f"{', '.join(str(d) for d in _WIRES)}, got {wire_dtype}"
            )
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(
                f"ExchangeReduceScatter: block_size must be an int >= 1, got {block_size!r}"
            )
        self.wire_dtype = wire_dtype
        self.block_size = block_size
        self.bytes_sent = 0

    def __repr__(self) -> str:
        block = f", block_size={self.block_size}" if self.wire_dtype in exact.FP8 else ""
        return f"ExchangeReduceScatter(wire_dtype={self.wire_dtype}{block})"

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        average = _average(op)
        rows = input_tensor.view(group.size(), output_tensor.numel())
        work, sent = exact.exchange_reduce_scatter(
            output_tensor,
            rows,
            group,
            wire=self.wire_dtype or rows.dtype,
            block=self.block_size,
            average=average,
        )
        self.bytes_sent += sent
        if not async_op:
            work.wait()
            return None
        return work

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup, op: Any) -> Any:
        """HSDP's all-reduce across replicas by exchange, in the same wire: each rank sums
        one chunk of every replica's gradients in fp32 in the canonical order, and the summed
        chunks travel back in ``wire_dtype`` (every replica ends with the same values). The
        engine calls it for groups reduced by this comm (``collectives.all_reduce``)."""
        work, sent = exact.exchange_all_reduce(
            tensor, group, wire=self.wire_dtype, block=self.block_size, average=_average(op)
        )
        self.bytes_sent += sent
        return work


def _average(op: Any) -> bool:
    if op in (dist.ReduceOp.SUM, "sum"):
        return False
    if op in (dist.ReduceOp.AVG, "avg"):
        return True
    raise ValueError(f"ExchangeReduceScatter: reduce op must be SUM or AVG, got {op}")


def set_exchange_reduce(
    model: nn.Module, wire_dtype: torch.dtype | None = None, *, block_size: int = 128
) -> ExchangeReduceScatter:
    """Reduce every ``fully_shard`` module in ``model`` (itself included) by exchange,
    with one :class:`ExchangeReduceScatter` (returned: its ``bytes_sent`` counts them all).

    Call after ``fully_shard`` and before the first backward, on every rank alike.

    Raises:
        ValueError: ``model`` holds no ``fully_shard`` module, or bad arguments.
    """
    comm = ExchangeReduceScatter(wire_dtype, block_size=block_size)
    for m in _fsdp_modules(model, "set_exchange_reduce"):
        m.set_custom_reduce_scatter(comm)
    return comm


def _fsdp_modules(model: nn.Module, who: str) -> list[Any]:
    """Every ``fully_shard`` module of ``model``, itself included; ``ValueError`` if none."""
    from fsdp2._core.front.sharding import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(
            f"{who}: {type(model).__name__} holds no fully_shard module: call fully_shard first"
        )
    return modules


def set_deterministic(model: nn.Module, enabled: bool = True) -> None:
    """Make every ``fully_shard`` module of ``model`` (itself included) reduce gradients in
    one canonical order, so that training gives the same bits at every world size.

    A fixed global batch of ``M`` micro-batches, each rank taking ``k = M / W`` consecutive
    ones (rank ``r`` the micro-batches ``r*k`` to ``r*k + k - 1``; ``k`` and ``W`` powers of
    two), each one's backward with ``set_requires_gradient_sync(False)`` but the last: each
    parameter's gradient is then the canonical tree sum ([Note: canonical sum] in
    fsdp2/_core/comm/exact.py) of the micro-batch gradients, in fp32, divided once by the
    data-parallel ranks ``W`` as the default reduction averages (or by
    ``set_gradient_divide_factor``'s factor). So the usual loop keeps its loss: each
    micro-batch's mean loss divided by ``k`` gives the gradient of the global batch's mean,
    the same bits on 1, 2, 4 ranks or an HSDP mesh (dividing by a power of two is exact),
    given the same kernels per micro-batch; so does a loss over the global token count with
    the divide factor 1 (torchtitan's). The micro-batch gradients are kept as a tree of
    partial sums (at most ``log2(k) + 1`` unsharded fp32 gradients per parameter), reduced
    by exchange (:class:`ExchangeReduceScatter`, fp32 on the wire) and, on HSDP, summed
    across replicas by exchange too. A low-precision wire (:func:`set_exchange_reduce`, a
    custom reduce-scatter) would round each rank's partial sum: refused, in either order.

    Call after ``fully_shard`` and before the first backward, on every rank alike.
    ``enabled=False`` returns to torch's reduce-scatter. See docs/reproducibility.md.

    Raises:
        ValueError: ``model`` holds no ``fully_shard`` module, one whose gradients
            ``fsdp2.replica_optim`` shards over the replicas, or one with a custom
            reduce-scatter (a low-precision wire).
        RuntimeError: at a reduction, before any collective: a rank summed a number of
            micro-batches that is not a power of two on more than one data-parallel rank,
            or the data-parallel ranks are not a power of two (without a divide factor).
    """
    modules = _fsdp_modules(model, "set_deterministic")
    if enabled:
        pieced = [m for m in modules if any(g.reduce.replica_shard for g in m._groups())]
        if pieced:
            raise ValueError(
                f"set_deterministic: {type(pieced[0]).__name__} shards its gradients over the "
                "replicas (fsdp2.replica_optim), which the deterministic reduction does not do "
                "yet: call set_deterministic on a model without a ReplicaShardedOptimizer"
            )
        custom = [
            (m, g.reduce.comm)
            for m in modules
            for g in m._groups()
            if g.reduce.comm is not None and not g.reduce.exact
        ]
        if custom:
            m, comm = custom[0]
            raise ValueError(
                f"set_deterministic: {type(m).__name__} reduces with {comm!r} "
                "(set_exchange_reduce or set_custom_reduce_scatter); the deterministic mode "
                "sums in fp32 in one fixed order, and a low-precision wire would round each "
                "rank's partial sum, so the bits would change with the world size. Drop the "
                "custom reduce-scatter (build the model without it) to train deterministically"
            )
    comm = ExchangeReduceScatter() if enabled else None
    for m in modules:
        m._update(False, reduce={"exact": bool(enabled), "comm": comm})


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``fsdp2.clip_grad_norm_`` with a total norm that is the same bits at every world size.

    The squares are taken in fp64 (an fp32 square is exact there) and summed per row of each
    gradient (dim 0: a row is never split between ranks) in a fixed pairwise tree; the rows'
    sums are gathered over the shard group (one all-gather per process group, one fp64 per
    row) and summed in a fixed tree over the global row index, then over the parameters in
    the order given. So the norm does not depend on how the rows are spread over ranks. The
    clipping itself is elementwise. For the deterministic mode (docs/reproducibility.md).

    Same arguments and return as ``torch.nn.utils.clip_grad_norm_``; every rank calls it.
    ``norm_type`` 2 or ``inf`` (a maximum is exact anyway).

    Raises:
        ValueError: another ``norm_type``, or a gradient sharded on another dim than 0 or
            with a ``Partial`` placement (tensor parallelism: use ``fsdp2.clip_grad_norm_``).
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite.
    """
    from fsdp2.clip import by_grad_mesh, clip_with_norm, sharded_params
    from fsdp2.clip import clip_grad_norm_ as clip_any

    params = sharded_params(parameters)
    if norm_type == float("inf"):
        return clip_any(params, max_norm, norm_type, error_if_nonfinite, foreach)
    if float(norm_type) != 2.0:
        raise ValueError(f"reduction.clip_grad_norm_: norm_type 2 or inf, got {norm_type}")
    by_mesh = by_grad_mesh(params)
    if not by_mesh:
        return torch.tensor(0.0)
    total = _invariant_norm([p.grad for p in params if p.grad is not None])
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"reduction.clip_grad_norm_: the total norm of the gradients is {total.item()}; "
            "pass error_if_nonfinite=False to clip anyway"
        )
    clip_with_norm(by_mesh, max_norm, total, foreach)
    return total


def _halve(x: torch.Tensor) -> torch.Tensor:
    """Sum the last dim of ``x`` in a fixed pairwise tree (zero-padded to a power of two):
    elementwise adds only, so the result does not depend on the other dims' sizes."""
    n = x.size(-1)
    if n == 0:
        return x.new_zeros(x.shape[:-1])
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], width - n)], dim=-1)
    while x.size(-1) > 1:
        half = x.size(-1) // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def _row_squares(local: torch.Tensor) -> torch.Tensor:
    # the columns named, not -1: a rank's shard may have no rows (reshape(0, -1) raises)
    cols = math.prod(local.shape[1:])
    rows = local.reshape(local.size(0), cols) if local.dim() else local.reshape(1, 1)
    return _halve(rows.double().square())


def _invariant_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    from fsdp2._core.comm.collectives import all_gather

    per_param: list[torch.Tensor | None] = [None] * len(grads)
    gathers: dict[Any, list[tuple[int, torch.Tensor, int, int]]] = {}  # pg -> (i, rows, R, c)
    for i, g in enumerate(grads):
        if not isinstance(g, DTensor):
            per_param[i] = _halve(_row_squares(g))
            continue
        shard_dims = [d for d, pl in enumerate(g.placements) if not pl.is_replicate()]
        for d in shard_dims:
            pl = g.placements[d]
            if not (pl.is_shard() and pl.dim == 0) or len(shard_dims) > 1:  # type: ignore[attr-defined]
                raise ValueError(
                    f"reduction.clip_grad_norm_: a gradient placed {g.placements}: only "
                    "dim-0 sharded (FSDP, HSDP) and replicated gradients; use "
                    "fsdp2.clip_grad_norm_ for tensor parallelism"
                )
        rows = _row_squares(g.to_local())
        if not shard_dims:
            per_param[i] = _halve(rows)
            continue
        pg = g.device_mesh.get_group(shard_dims[0])
        n = pg.size()
        chunk = -(-g.shape[0] // n) if g.dim() else 1
        padded = rows.new_zeros(chunk)
        padded[: rows.numel()] = rows
        gathers.setdefault(pg, []).append((i, padded, g.shape[0] if g.dim() else 1, chunk))
    for pg, items in gathers.items():
        flat = torch.cat([rows for _, rows, _, _ in items])
        n = pg.size()
        (pending,) = all_gather([flat], pg, n, "exact gradient norm")
        gathered = pending.wait()
        assert gathered is not None  # a Pending (no ``into``): its output
        out = gathered.view(n, -1)
        offset = 0
        for i, _, total_rows, chunk in items:
            cols = out[:, offset : offset + chunk].reshape(-1)  # rank-major: global row order
            per_param[i] = _halve(_real_rows(cols, total_rows, chunk, n))
            offset += chunk
    stacked = torch.stack([t for t in per_param if t is not None])
    return _halve(stacked).sqrt().to(grads[0].dtype)


def _real_rows(cols: torch.Tensor, total: int, chunk: int, n: int) -> torch.Tensor:
    """The gathered rows without each rank's padding (rank ``r`` holds rows ``r*chunk`` to
    ``min((r+1)*chunk, total)``)."""
    keep = [cols[r * chunk : r * chunk + max(0, min(chunk, total - r * chunk))] for r in range(n)]
    return torch.cat(keep)
