"""fsdp2 reduce-scatters on gloo by its own means ([Note: gloo reduce-scatter] in
fsdp2/_collectives.py): on 2 ranks by exchanging rows (one send and one receive, then
adding the received row to its own), on more by an in-place all-reduce of the packed input,
keeping its own row. That is only right while the result is bitwise what gloo's
``reduce_scatter_tensor`` returns: checked here on 2 and 4 ranks for SUM and AVG in fp32 and
bf16, on values spanning many magnitudes (so a different summation order would show). The
engine-level consequence (fsdp2's gradients equal torch's FSDP2's bitwise at 2 and 4 ranks)
is every parity test's; that fsdp2 takes these paths on gloo and still counts one
reduce-scatter per group is ``tests/test_comm_counts.py``'s (``comm_counter`` counts them as
RS).

All-gathers on gloo go by sends and receives ([Note: gloo all-gather]): bitwise gloo's own
(copies only) at 2 and 4 ranks, in a subgroup, for any dtype, with several in flight at
once (prefetch) and waited in or out of order."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks
from comm_counter import CommCounter

from fsdp2 import _collectives as C


def _rows_equal(dtype: torch.dtype) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    n = ws * 10_007
    x = (torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(8) * 1e3).to(dtype)
    group = dist.group.WORLD
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        want = torch.empty(n // ws, dtype=dtype)
        dist.reduce_scatter_tensor(want, x.clone(), op=op)
        packed = x.clone().view(ws, -1)
        with CommCounter() as counter:
            got = C.reduce_scatter(packed, group, op).wait()
        assert [c.kind for c in counter.calls] == ["RS"], counter.calls
        api = "exchange" if ws == 2 else "all_reduce"
        assert counter.calls[0].api == api, f"fsdp2 should use {api} on gloo at {ws} ranks"
        assert got.data_ptr() != packed.data_ptr(), "the row must be a copy of the packed input"
        assert torch.equal(got, want), f"{op} {dtype}: all-reduce row differs from reduce-scatter"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_all_reduce_row_equals_reduce_scatter(world_size: int, dtype: torch.dtype) -> None:
    run_on_ranks(world_size, _rows_equal, dtype)


def _gathers_equal() -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    # the ranks of this rank's pair (a subgroup: HSDP's shard groups) and the world
    pairs = [dist.new_group([r, r + 1]) for r in range(0, ws, 2)]
    pair = pairs[rank // 2]
    for group in (dist.group.WORLD, pair):
        size = group.size()
        for dtype in (torch.float32, torch.bfloat16, torch.uint8):
            g = torch.Generator().manual_seed(rank)
            xs = [(torch.randn(n, generator=g) * 100).to(dtype) for n in (10_007, 3, 0, 50_000)]
            wants = []
            for x in xs:
                want = torch.empty(size * x.numel(), dtype=dtype)
                dist.all_gather_into_tensor(want, x, group=group)
                wants.append(want.view(size, -1))
            with CommCounter() as counter:
                pending = [C.all_gather(x, group, size) for x in xs]  # all in flight at once
                got = [p.wait() for p in reversed(pending)][::-1]
            assert [(c.kind, c.api) for c in counter.calls] == [("AG", "exchange")] * 4
            for x, a, b in zip(xs, got, wants, strict=True):
                assert torch.equal(a, b), f"{dtype} numel {x.numel()} group of {size}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_gather_exchange_equals_gloo(world_size: int) -> None:
    run_on_ranks(world_size, _gathers_equal)
