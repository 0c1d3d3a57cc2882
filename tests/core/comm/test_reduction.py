"""``fsdp2.reduction``: a reduce-scatter done as an exchange and summed locally.

* ``canonical_sum``: the sum over ``m * k`` pieces equals the sum over the ``m`` sums of
  aligned blocks of ``k`` (k a power of two), bitwise: what makes the order independent of
  how pieces are spread over ranks;
* ``ExchangeReduceScatter`` on 2 and 4 gloo ranks, each wire: the result equals, bitwise, the
  canonical fp32 sum of the wire-rounded pieces (computed here from every rank's inputs,
  which each rank can rebuild), averaged for ``AVG``; it sends half (bf16) or about a
  quarter (fp8) of fp32's bytes; bad arguments raise before any collective;
* training with ``set_exchange_reduce`` matches the replica (and the fp32 wire repeats
  itself bitwise), on FSDP and on HSDP 2x2, where the all-reduce across replicas goes by
  exchange in the wire too and every replica ends with the same shards, bit for bit;
* on 8 ranks, the bf16 wire's error against the exact sum is below a bf16 reduce's
  (gloo's all-reduce in bf16, what ``reduce_dtype=torch.bfloat16`` runs on gloo), median
  and max over the elements.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks
from helpers import hsdp_mesh, train_and_compare, world_mesh
from models import build, local_loss, make_batch, make_optimizer, shard_model

from fsdp2 import fully_shard
from fsdp2.api import MixedPrecisionPolicy
from fsdp2.reduction import ExchangeReduceScatter, canonical_sum, set_exchange_reduce


def test_canonical_sum_of_aligned_blocks() -> None:
    gen = torch.Generator().manual_seed(0)
    for m in range(1, 13):
        for k in (1, 2, 4, 8):
            pieces = [torch.randn(64, generator=gen) * 10.0 ** (i % 5) for i in range(m * k)]
            whole = canonical_sum([p.clone() for p in pieces])
            blocks = [
                canonical_sum([p.clone() for p in pieces[i : i + k]]) for i in range(0, m * k, k)
            ]
            assert torch.equal(whole, canonical_sum(blocks)), f"m={m} k={k}"
    with pytest.raises(ValueError, match="no pieces"):
        canonical_sum([])


def _inputs(rank: int, world: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s packed reduce-scatter input: ``(world, numel)``, magnitudes spread."""
    gen = torch.Generator().manual_seed(1000 + rank)
    scale = torch.logspace(-3, 3, numel)
    return torch.randn(world, numel, generator=gen) * scale


def _fp8_roundtrip(row: torch.Tensor, dtype: torch.dtype, block: int) -> torch.Tensor:
    n = row.numel()
    pad = torch.zeros(-(-n // block) * block)
    pad[:n] = row
    grid = pad.view(-1, block)
    scale = grid.abs().amax(dim=1, keepdim=True) / torch.finfo(dtype).max
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((grid / scale).to(dtype).float() * scale).view(-1)[:n]


def _wire_round(row: torch.Tensor, wire: torch.dtype | None, block: int) -> torch.Tensor:
    if wire in (torch.float8_e4m3fn, torch.float8_e5m2):
        return _fp8_roundtrip(row, wire, block)
    return row.clone() if wire is None else row.to(wire).float()


def _exchanges() -> None:
    for wire in (None, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        for op in ("sum", "avg"):
            _exchange(wire, op)


def _exchange(wire: torch.dtype | None, op: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    numel, block = 301, 16  # not a multiple of the block: padding
    comm = ExchangeReduceScatter(wire, block_size=block)
    out = torch.full((numel,), float("nan"))
    reduce_op = dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM
    work = comm(out, _inputs(rank, world, numel).view(-1), dist.group.WORLD, reduce_op, True)
    work.wait()
    want = canonical_sum(
        [_wire_round(_inputs(r, world, numel)[rank], wire, block) for r in range(world)]
    )
    if op == "avg":
        want = want / world
    assert torch.equal(out, want), f"{wire} {op}: max diff {(out - want).abs().max()}"
    fp32_bytes = world * numel * 4
    sent = {None: fp32_bytes, torch.bfloat16: fp32_bytes // 2}
    if wire in sent:
        assert comm.bytes_sent == sent[wire], (comm.bytes_sent, sent[wire])
    else:  # fp8: a byte per element (whole blocks) and an fp32 scale per block
        blocks = -(-numel // block)
        assert comm.bytes_sent == world * (blocks * block + 4 * blocks)


@pytest.mark.parametrize("world_size", [2, 4])
def test_exchange_reduce_scatter_is_the_sum_of_wire_rounded_pieces(world_size: int) -> None:
    run_on_ranks(world_size, _exchanges)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="wire_dtype"):
        ExchangeReduceScatter(torch.int8)
    with pytest.raises(ValueError, match="block_size"):
        ExchangeReduceScatter(torch.float8_e4m3fn, block_size=0)
    with pytest.raises(ValueError, match="holds no fully_shard module"):
        set_exchange_reduce(torch.nn.Linear(2, 2))
    comm = ExchangeReduceScatter()
    with pytest.raises(ValueError, match="SUM or AVG"):
        comm(torch.empty(2), torch.empty(2), None, dist.ReduceOp.MAX)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Training


def _train(wire: str, mp: str) -> list[float]:
    name = "mlp_head"
    kw = {}
    if mp == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    model = shard_model(build(name), fully_shard, world_mesh(), **kw)
    comm = set_exchange_reduce(model, None if wire == "fp32" else torch.bfloat16)
    ref = build(name)
    tol = (
        {"atol": 1e-5, "rtol": 1e-5}
        if wire == "fp32" and mp == "fp32"
        else {"atol": 2e-2, "rtol": 2e-2}
    )
    losses: list[float] = []

    def loss(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = local_loss(m, name, x, y)
        if m is model:
            losses.append(out.item())
        return out

    train_and_compare(
        ref,
        {"fsdp2": model},
        batch=lambda step: make_batch(name, step),
        loss=loss,
        optimizer=lambda p: make_optimizer("adamw", p),
        tol=tol,
    )
    assert comm.bytes_sent > 0
    return losses


@pytest.mark.parametrize("wire,mp", [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")])
def test_training_matches_the_replica(wire: str, mp: str) -> None:
    first = run_on_ranks(2, _train, wire, mp)
    if wire == "fp32":  # a fixed order: the run repeats itself bitwise
        assert run_on_ranks(2, _train, wire, mp) == first


# ---------------------------------------------------------------------------------------------
# The bf16 wire's error at world size 8


def _errors(numel: int) -> dict[str, tuple[float, float]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    pieces = [_inputs(r, world, numel)[rank].double() for r in range(world)]
    exact = sum(pieces)
    magnitude = sum(p.abs() for p in pieces)  # the error's natural scale (no cancellation blow-up)
    mine = _inputs(rank, world, numel)
    out: dict[str, torch.Tensor] = {}
    for wire in (None, torch.bfloat16):
        got = torch.empty(numel)
        ExchangeReduceScatter(wire)(
            got, mine.view(-1), dist.group.WORLD, dist.ReduceOp.SUM, True
        ).wait()
        out["fp32 exchange" if wire is None else "bf16 wire, fp32 sum"] = got
    bf16 = mine.to(torch.bfloat16)
    dist.all_reduce(bf16)  # the sum in bf16, as a bf16 reduce_dtype runs it here
    out["bf16 reduce"] = bf16[rank]
    result = {}
    for key, got in out.items():
        err = (got.double() - exact).abs() / magnitude
        result[key] = (err.median().item(), err.max().item())
    return result


def test_bf16_wire_error_below_bf16_reduce_at_world_size_8() -> None:
    res = run_on_ranks(8, _errors, 4096)
    for rank, errs in enumerate(res):
        wire, bf16 = errs["bf16 wire, fp32 sum"], errs["bf16 reduce"]
        assert wire[0] < bf16[0] and wire[1] <= bf16[1], f"rank {rank}: {errs}"
        assert errs["fp32 exchange"][0] < wire[0], f"rank {rank}: {errs}"


# ---------------------------------------------------------------------------------------------
# HSDP: the all-reduce across replicas by exchange, in the wire


def _hsdp_wire(wire: str) -> None:
    name = "mlp_head"
    mesh = hsdp_mesh((2, 2))
    model = shard_model(build(name), fully_shard, mesh)
    comm = set_exchange_reduce(model, None if wire == "fp32" else torch.bfloat16)
    tol = {"atol": 1e-5, "rtol": 1e-5} if wire == "fp32" else {"atol": 2e-2, "rtol": 2e-2}
    train_and_compare(
        build(name),
        {"fsdp2": model},
        batch=lambda step: make_batch(name, step),
        loss=lambda m, x, y: local_loss(m, name, x, y),
        optimizer=lambda p: make_optimizer("adamw", p),
        tol=tol,
    )
    # every replica holds the same shards, bit for bit (each read the summed chunks back
    # from the same bytes)
    replicate = mesh.get_group("replicate")
    for n, p in model.named_parameters():
        local = p.to_local().detach().contiguous()
        both = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(both, local, group=replicate)
        assert torch.equal(both[0], both[1]), f"{n}: the replicas differ"
    assert comm.bytes_sent > 0


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_hsdp_all_reduce_by_exchange(wire: str) -> None:
    run_on_ranks(4, _hsdp_wire, wire)
