"""On gloo, fsdp2's all-gathers receive straight into the unsharded parameters and its
2-rank reduce-scatters send straight from the gradients ([Note: gloo straight in and out]
in fsdp2/_core/comm/gloo.py): no rank-major output to copy out of, no packed input to
copy into.

That is only right while the results are bitwise what the packed path gives, which is gloo's
own (tests/core/comm/test_gloo_reduce.py): checked here for the collectives alone, on gradient and
parameter shapes that exercise every branch (pieces sent alone and small ones together,
rows that do not split evenly, a single row, empty and non-contiguous gradients, gradients
to cast, SUM and AVG, fp32 and bf16, 2 and 4 ranks, a subgroup, several in flight), and
for the engine: bitwise parity with torch's FSDP2 (and a replicated reference) with uneven
parameters, a prefetched group that does not run (its buffers must be freed, not leaked,
after the receives finish) and HSDP."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from comm_counter import CommCounter
from helpers import ENGINES, hsdp_mesh, train_and_compare, world_mesh
from models import make_optimizer

from fsdp2._core.comm import collectives, gloo, transport
from fsdp2._core.comm.collectives import Into
from fsdp2._core.params.group import ParamGroup, Sharded
from fsdp2._core.runtime.state import state_of


def _grads(dtype: torch.dtype) -> list[torch.Tensor]:
    """Gradients of every shape the straight path tells apart (values spanning magnitudes,
    different on each rank)."""
    g = torch.Generator().manual_seed(dist.get_rank())

    def rand(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=g) * torch.rand(*shape, generator=g).pow(8) * 1e3
        return x.to(dtype)

    return [
        rand(512, 300),  # even rows, sent straight
        rand(7, 3),  # small: packed
        rand(513, 300),  # odd rows: this rank's slice is padded on rank 1
        rand(0, 5),  # empty
        rand(1, 70_000),  # one row: all of it is rank 0's
        rand(300, 512).t(),  # non-contiguous: packed
        rand(80_000),  # 1-D, straight
        rand(1).expand(2),  # a replicated scalar's gradient (stride 0): packed
    ]


def _reduce_equal(dtype: torch.dtype) -> None:
    group = dist.group.WORLD
    grads = _grads(dtype)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        packed = transport.pack_for_reduce_scatter(grads, 2, dtype)
        want = torch.empty(packed.size(1), dtype=dtype)
        dist.reduce_scatter_tensor(want, packed.view(-1).clone(), op=op)
        before = [x.clone() for x in grads]
        assert gloo.is_gloo(group, grads[0].device) and gloo.pair_exchange(2, op)
        assert gloo.sends_any_straight(grads, dtype)  # so fsdp2's reduce-scatter goes straight
        with CommCounter() as counter:
            pending = collectives.reduce_scatter(list(grads), 2, dtype, group, "x", op=op)
            assert pending is not None
            got = pending.wait()
        assert [(c.kind, c.api, c.numel) for c in counter.calls] == [
            ("RS", "exchange", packed.numel())
        ]
        assert torch.equal(got, want), f"{op} {dtype}: differs from gloo's reduce-scatter"
        assert all(torch.equal(a, b) for a, b in zip(grads, before, strict=True)), "grads changed"
    # nothing to send straight: small gradients, or gradients to cast (reduce_dtype)
    small = [x for x in grads if x.numel() * x.element_size() < 2 * gloo.DIRECT_MIN_BYTES]
    assert gloo.reduce_scatter_grads(small, dtype, dist.ReduceOp.SUM, group) is None
    assert gloo.reduce_scatter_grads(grads, torch.float64, dist.ReduceOp.SUM, group) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reduce_scatter_grads_equals_gloo(dtype: torch.dtype) -> None:
    run_on_ranks(2, _reduce_equal, dtype)


def _nothing() -> None:
    pass


def _gather_rows_equal() -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([r, r + 1]) for r in range(0, ws, 2)]
    for group in (dist.group.WORLD, pairs[rank // 2]):
        size = group.size()
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(rank)
            # alone, small ones together (two runs), empty, alone again (>= 256 KiB in all:
            # fsdp2 all-gathers by exchange, gloo.EXCHANGE_MIN_BYTES)
            sizes = [140_000, 3, 5, 0, 7, 40_000, 11]
            flats = [(torch.randn(sum(sizes), generator=g) * 100).to(dtype) for _ in range(2)]
            wants = []
            for flat in flats:
                out = torch.empty(size * flat.numel(), dtype=dtype)
                dist.all_gather_into_tensor(out, flat, group=group)
                wants.append(out.view(size, -1).split(sizes, dim=1))
            rows = [
                [[torch.empty(n, dtype=dtype) for n in sizes] for _ in range(size)] for _ in flats
            ]
            with CommCounter() as counter:  # two in flight, waited out of order
                pending = [
                    collectives.all_gather([f], group, size, "x", into=Into(sizes, r, _nothing))[0]
                    for f, r in zip(flats, rows, strict=True)
                ]
                assert all(isinstance(p, gloo.Received) for p in pending)
                for p in reversed(pending):
                    p.wait()
            assert [(c.kind, c.api) for c in counter.calls] == [("AG", "exchange")] * 2
            for got, want in zip(rows, wants, strict=True):
                for r in range(size):
                    for i in range(len(sizes)):
                        assert torch.equal(got[r][i], want[i][r]), f"{dtype} rank {r} piece {i}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_gather_into_equals_gloo(world_size: int) -> None:
    run_on_ranks(world_size, _gather_rows_equal)


def test_segments() -> None:
    """Pieces of 64 KiB and more are sent alone, smaller neighbours together, empty in none."""
    big = gloo.DIRECT_MIN_BYTES // 4  # fp32 elements
    segs = gloo._segments((big, 3, 0, 5, big, 7), 4)
    assert segs == ((0, big, (0,)), (big, 8, (1, 3)), (big + 8, big, (4,)), (2 * big + 8, 7, (5,)))


class _Uneven(nn.Module):
    """Groups above the exchange's threshold whose rows do not split evenly over 2 ranks,
    small parameters (biases, a norm) among large ones, and a layer that ``skip`` leaves
    out of the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(301, 512)
        self.layers = nn.ModuleList(
            [nn.Linear(512, 511), nn.Linear(511, 512), nn.Linear(512, 512), nn.LayerNorm(512)]
        )
        self.head = nn.Linear(512, 257)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for i, layer in enumerate(self.layers):
            if not (self.skip and i == 2):
                h = torch.tanh(layer(h))
        return self.head(h)


def _buffers_freed(key: str, model: nn.Module, params: list[nn.Parameter]) -> None:
    """After backward and after the optimizer step every group is resharded: none of its
    unsharded buffers may hold memory (a prefetched, never used all-gather included)."""
    if key != "fsdp2":
        return
    for m in model.modules():
        st = state_of(m)
        for g in st.groups if st is not None else []:
            assert g.sharded_state is Sharded.SHARDED and not g.has_pending_unshard(), g.path
            held = [b.untyped_storage().nbytes() for b in g.unsharded_bufs]
            assert not any(held), f"{g.path}: unsharded buffers still hold {held} bytes"


def _uneven_parity(variant: str) -> None:
    mesh = hsdp_mesh((2, 2)) if variant == "hsdp" else world_mesh()

    def shard(engine: str) -> nn.Module:
        torch.manual_seed(0)
        model = _Uneven()
        for layer in model.layers:
            ENGINES[engine](layer, mesh=mesh)
        ENGINES[engine](model, mesh=mesh)
        return model

    torch.manual_seed(0)
    ref = _Uneven()
    models = {engine: shard(engine) for engine in ENGINES}

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randint(0, 301, (4, 6), generator=g), torch.randn(4, 6, 257, generator=g)

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (model(x) - y).pow(2).mean()

    def before_step(step: int, x: torch.Tensor, y: torch.Tensor) -> None:
        # step 1 leaves layers.2 out: layers.1 still prefetches it (last step's order)
        for m in (ref, *models.values()):
            m.skip = variant == "skip" and step == 1

    cancelled: list[str] = []  # groups whose all-gather was received but never used
    reshard = ParamGroup._reshard

    def spy_reshard(group: ParamGroup, to_small: bool) -> None:
        if isinstance(group._pending_ag, gloo.Received):
            cancelled.append(group.path)
        reshard(group, to_small)

    with CommCounter() as counter, mock.patch.object(ParamGroup, "_reshard", spy_reshard):
        train_and_compare(
            ref,
            models,
            batch=batch,
            loss=loss,
            tol={"atol": 1e-4, "rtol": 1e-4},
            optimizer=lambda ps: make_optimizer("sgd", ps),
            before_step=before_step,
            invariant=_buffers_freed,
        )
    apis = {(c.kind, c.api) for c in counter.calls if c.group_size == 2}
    assert {("AG", "exchange"), ("RS", "exchange")} <= apis, apis
    assert cancelled == (["layers.2"] if variant == "skip" else []), cancelled


@pytest.mark.parametrize("variant", ["uneven", "skip"])
def test_straight_parity(variant: str) -> None:
    """Uneven rows, small parameters among large ones, and (``skip``) a prefetched group that
    does not run: bitwise torch's FSDP2, and the buffers its receives wrote are freed."""
    run_on_ranks(2, _uneven_parity, variant)


def test_straight_parity_hsdp() -> None:
    """HSDP 2x2: the shard groups (2 ranks) take the straight paths, the replicate
    all-reduce follows."""
    run_on_ranks(4, _uneven_parity, "hsdp")
