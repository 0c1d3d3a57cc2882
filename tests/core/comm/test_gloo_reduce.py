"""fsdp2 reduce-scatters on gloo by its own means ([Note: gloo reduce-scatter] in
fsdp2/_core/comm/collectives.py): on 2 ranks by exchanging rows (one send and one receive, then
adding the received row to its own), on more by an in-place all-reduce of the packed input,
keeping its own row. That is only right while the result is bitwise what gloo's
``reduce_scatter_tensor`` returns: checked here on 2 and 4 ranks for SUM and AVG in fp32 and
bf16, on values spanning many magnitudes (so a different summation order would show). The
engine-level consequence (fsdp2's gradients equal torch's FSDP2's bitwise at 2 and 4 ranks)
is every parity test's; that fsdp2 takes these paths on gloo and still counts one
reduce-scatter per group is ``tests/core/comm/test_comm_counts.py``'s (``comm_counter`` counts
them as RS).

All-gathers on gloo of at least ``EXCHANGE_MIN_BYTES`` per rank go by sends and receives
([Note: gloo all-gather]): bitwise gloo's own (copies only) at 2 and 4 ranks, in a subgroup,
for any dtype, with several in flight at once (prefetch), smaller ones among them (gloo's
all-gather), waited in or out of order."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from comm_counter import AG_API, CommCounter
from helpers import ENGINES, train_and_compare, world_mesh
from models import make_optimizer
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

from fsdp2 import MixedPrecisionPolicy
from fsdp2._core.comm import collectives, gloo


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
            got = collectives.reduce_scatter([packed], ws, dtype, group, "x", op=op).wait()
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
            sizes = (300_000, 3, 0, 70_001)  # above and below the exchange's threshold
            xs = [(torch.randn(n, generator=g) * 100).to(dtype) for n in sizes]
            wants = []
            for x in xs:
                want = torch.empty(size * x.numel(), dtype=dtype)
                dist.all_gather_into_tensor(want, x, group=group)
                wants.append(want.view(size, -1))
            with CommCounter() as counter:
                pending = [
                    collectives.all_gather([x], group, size, "x")[0] for x in xs
                ]  # all in flight at once
                got = [p.wait() for p in reversed(pending)][::-1]
            want_api = ["exchange" if x.nbytes >= gloo.EXCHANGE_MIN_BYTES else AG_API for x in xs]
            assert [(c.kind, c.api) for c in counter.calls] == [("AG", a) for a in want_api]
            assert "exchange" in want_api and AG_API in want_api
            for x, a, b in zip(xs, got, wants, strict=True):
                assert torch.equal(a, b), f"{dtype} numel {x.numel()} group of {size}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_gather_exchange_equals_gloo(world_size: int) -> None:
    run_on_ranks(world_size, _gathers_equal)


class _Wide(nn.Module):
    """Groups above the exchange's threshold: 512x512 weights (512 KiB per rank in fp32 at 2
    ranks, 256 KiB in bf16), and a root with an embedding and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(300, 512)
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(3))
        self.head = nn.Linear(512, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def _wide_parity(variant: str) -> None:
    def shard(engine: str) -> nn.Module:
        torch.manual_seed(0)
        model = _Wide()
        mp = {}
        if variant == "bf16":
            cls = MixedPrecisionPolicy if engine == "fsdp2" else TorchMP
            mp = {"mp_policy": cls(param_dtype=torch.bfloat16)}
        for layer in model.layers:
            ENGINES[engine](layer, mesh=world_mesh(), **mp)
        ENGINES[engine](model, mesh=world_mesh(), **mp)
        if variant == "bucketed" and engine == "fsdp2":
            model.set_bucket_bytes(4 << 20)
        return model

    torch.manual_seed(0)
    ref = _Wide()
    models = {engine: shard(engine) for engine in ENGINES}

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randint(0, 300, (4, 6), generator=g), torch.randn(4, 6, 512, generator=g)

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (model(x).float() - y).pow(2).mean()

    # against the replicated reference (fsdp2 and torch are held bitwise to each other)
    tol = {"atol": 2e-2, "rtol": 2e-2} if variant == "bf16" else {"atol": 1e-4, "rtol": 1e-4}
    with CommCounter() as counter:
        train_and_compare(
            ref,
            models,
            batch=batch,
            loss=loss,
            tol=tol,
            optimizer=lambda ps: make_optimizer("sgd", ps),
        )
    apis = {c.api for c in counter.calls if c.kind == "AG"}
    assert "exchange" in apis, apis


@pytest.mark.parametrize("variant", ["fp32", "bf16", "bucketed"])
def test_exchange_all_gather_parity(variant: str) -> None:
    """fsdp2 with its all-gathers by exchange (each rank's own row copied out straight from
    its shard) trains bitwise like torch's FSDP2, alone, in bf16 and in buckets."""
    run_on_ranks(2, _wide_parity, variant)
