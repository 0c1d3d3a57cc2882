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
  ([Note: canonical sum] in fsdp2/_core/exact.py), whatever the collective's algorithm, so
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

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp2._core import exact
from fsdp2.api import ReduceScatter

__all__ = [
    "ExchangeReduceScatter",
    "canonical_sum",
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
    two), bit for bit: [Note: canonical sum] in fsdp2/_core/exact.py. Adds in place into
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

    ``bytes_sent`` counts the bytes this rank sent (its own piece included, as the other
    collectives count them): a benchmark's measure of the wire.

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
    from fsdp2._core.sharding import FSDPModule

    comm = ExchangeReduceScatter(wire_dtype, block_size=block_size)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(
            f"set_exchange_reduce: {type(model).__name__} holds no fully_shard module: "
            "call fully_shard first"
        )
    for m in modules:
        m.set_custom_reduce_scatter(comm)
    return comm


def set_deterministic(model: nn.Module, enabled: bool = True) -> None:
    """Make every ``fully_shard`` module of ``model`` (itself included) reduce gradients in
    one canonical order, so that training gives the same bits at every world size.

    A fixed global batch of ``M`` micro-batches, each rank taking ``k = M / W`` consecutive
    ones (``k`` a power of two when ``W > 1``: rank ``r`` the micro-batches ``r*k`` to
    ``r*k + k - 1``), each one's backward with ``set_requires_gradient_sync(False)`` but the
    last: each parameter's gradient is then the canonical tree sum ([Note: canonical sum]
    in fsdp2/_core/exact.py) of the ``M`` micro-batch gradients, in fp32, divided once by
    ``M`` (or by ``set_gradient_divide_factor``'s factor) - the same bits on 1, 2, 4 ranks
    or an HSDP mesh, given the same kernels per micro-batch. Each micro-batch's loss is
    its own mean loss (do not divide it by the accumulation steps). The micro-batch
    gradients are kept as a tree of partial sums (at most ``log2(k) + 1`` unsharded fp32
    gradients per parameter), reduced by exchange (:class:`ExchangeReduceScatter`, fp32
    on the wire) and, on HSDP, summed across replicas by exchange too.

    Call after ``fully_shard`` and before the first backward, on every rank alike.
    ``enabled=False`` returns to torch's reduce-scatter. See docs/reproducibility.md.

    Raises:
        ValueError: ``model`` holds no ``fully_shard`` module.
        RuntimeError: at a reduction, when a rank summed a number of micro-batches that is
            not a power of two on more than one data-parallel rank (before any collective).
    """
    from fsdp2._core.sharding import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(
            f"set_deterministic: {type(model).__name__} holds no fully_shard module: "
            "call fully_shard first"
        )
    comm = ExchangeReduceScatter() if enabled else None
    for m in modules:
        m._update(False, reduce={"exact": bool(enabled), "comm": comm})
