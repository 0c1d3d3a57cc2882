"""Checks the dim-0 sharding math and what users see of it.

``fsdp2._core.params.param.chunk_rows`` is compared with ``torch.chunk`` for every (size,
world, rank) hypothesis draws. Then, on 2 and 4 gloo ranks, a derandomized hypothesis loop
runs inside one rank function (every rank draws the same examples) over parameter shapes of 0-3 dims
with dim sizes 0..9, including dim 0 smaller than the world size: after ``fully_shard`` on a
1D CPU mesh each parameter is an ``nn.Parameter`` wrapping a DTensor placed ``(Shard(0),)``
(``(Replicate(),)`` for 0-dim parameters, an fsdp2 extension), ``full_tensor()`` is the
original, ``to_local()`` is this rank's ``torch.chunk`` piece (no rows where the chunk does
not exist), and one forward/backward with rank-dependent data gives the rank-averaged
reference gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from helpers import WORLD_SIZES
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp2 import fully_shard
from fsdp2._core.params.param import chunk_rows

# ---------------------------------------------------------------------------------------------
# chunk_rows: pure


def _torch_chunk_rows(dim_size: int, world_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows under ``torch.chunk``; empty when that chunk does not exist."""
    chunks = torch.arange(dim_size).chunk(world_size)
    return chunks[rank] if rank < len(chunks) else torch.arange(0)


@settings(max_examples=300, deadline=None)
@given(
    dim_size=st.integers(min_value=0, max_value=200),
    world_size=st.integers(min_value=1, max_value=64),
    data=st.data(),
)
def test_chunk_rows_matches_torch_chunk(dim_size: int, world_size: int, data) -> None:
    rank = data.draw(st.integers(min_value=0, max_value=world_size - 1), label="rank")
    padded, start, rows = chunk_rows(dim_size, world_size, rank)
    expected = _torch_chunk_rows(dim_size, world_size, rank)
    assert padded == -(-dim_size // world_size)
    assert rows == len(expected)
    assert 0 <= rows <= padded
    assert 0 <= start <= dim_size and start + rows <= dim_size
    torch.testing.assert_close(torch.arange(dim_size).narrow(0, start, rows), expected)


@settings(max_examples=200, deadline=None)
@given(
    dim_size=st.integers(min_value=0, max_value=200),
    world_size=st.integers(min_value=1, max_value=64),
)
def test_chunk_rows_tile_the_dim(dim_size: int, world_size: int) -> None:
    splits = [chunk_rows(dim_size, world_size, r) for r in range(world_size)]
    assert sum(rows for _, _, rows in splits) == dim_size
    assert {padded for padded, _, _ in splits} == {-(-dim_size // world_size)}
    # Consecutive ranks hold consecutive rows: the chunks tile [0, dim_size) in rank order.
    covered = torch.cat([torch.arange(start, start + rows) for _, start, rows in splits])
    torch.testing.assert_close(covered, torch.arange(dim_size))


@pytest.mark.parametrize(
    ("dim_size", "world_size", "expected"),
    [
        (5, 4, [(2, 0, 2), (2, 2, 2), (2, 4, 1), (2, 5, 0)]),  # rank 3's chunk does not exist
        (1, 4, [(1, 0, 1), (1, 1, 0), (1, 1, 0), (1, 1, 0)]),
        (0, 2, [(0, 0, 0), (0, 0, 0)]),
        (8, 4, [(2, 0, 2), (2, 2, 2), (2, 4, 2), (2, 6, 2)]),
        (3, 1, [(3, 0, 3)]),
    ],
)
def test_chunk_rows_examples(dim_size: int, world_size: int, expected: list) -> None:
    assert [chunk_rows(dim_size, world_size, r) for r in range(world_size)] == expected


# ---------------------------------------------------------------------------------------------
# fully_shard on random shapes: distributed property test

_dims = st.integers(min_value=0, max_value=9)
_shape = st.one_of(
    st.just(()),  # 0-dim: replicated by fsdp2
    st.lists(_dims, min_size=1, max_size=3).map(tuple),
    st.tuples(st.integers(min_value=0, max_value=3), _dims),  # dim 0 often < world size
)


class _Params(nn.Module):
    """Holds one parameter per shape; ``forward(s)`` is ``sum_i ((p_i * s) ** 2).sum()``."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(shape)) for shape in shapes])
        self.net = _Inner(self.ps)

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return self.net(s)


class _Inner(nn.Module):
    def __init__(self, ps: nn.ParameterList) -> None:
        super().__init__()
        self.ps = ps

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        total = s.new_zeros(())
        for p in self.ps:
            total = total + ((p * s) ** 2).sum()
        return total


def _scale(rank: int) -> torch.Tensor:
    return torch.tensor(0.5 + rank)


def _reference_grads(originals: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
    """d/dp of the rank-averaged loss: mean over ranks of 2 * p * s_r**2."""
    mean_sq = sum(_scale(r) ** 2 for r in range(world_size)) / world_size
    return [2 * p * mean_sq for p in originals]


def _check_one(shapes: list[tuple[int, ...]], mesh, rank: int, world_size: int) -> list[str]:
    """fully_shard a fresh module holding ``shapes``; return what is wrong (empty: all good)."""
    torch.manual_seed(1234)  # same parameters on every rank
    model = _Params(shapes)
    originals = [p.detach().clone() for p in model.ps]
    fully_shard(model, mesh=mesh)
    errors: list[str] = []
    params = list(model.ps)
    fulls = [p.full_tensor() for p in params]  # collective: every rank, same order
    for i, (p, orig, full) in enumerate(zip(params, originals, fulls, strict=True)):
        where = f"param {i} of shape {tuple(orig.shape)}"
        if not isinstance(p, nn.Parameter) or not isinstance(p, DTensor):
            errors.append(f"{where}: registered {type(p).__name__}, want nn.Parameter(DTensor)")
            continue
        want_placements = (Replicate(),) if orig.dim() == 0 else (Shard(0),)
        if tuple(p.placements) != want_placements:
            errors.append(f"{where}: placements {p.placements}, want {want_placements}")
        if p.shape != orig.shape:
            errors.append(f"{where}: DTensor shape {tuple(p.shape)}")
        if not torch.equal(full, orig):
            errors.append(f"{where}: full_tensor() differs from the original")
        local = p.to_local()
        if orig.dim() == 0:
            want_local = orig
        else:
            chunks = torch.chunk(orig, world_size, dim=0)
            want_local = (
                chunks[rank] if rank < len(chunks) else orig.new_empty((0, *orig.shape[1:]))
            )
        if local.shape != want_local.shape or not torch.equal(local, want_local):
            errors.append(
                f"{where}: to_local() has shape {tuple(local.shape)}, want this rank's "
                f"torch.chunk piece of shape {tuple(want_local.shape)}"
            )
    if any(orig.numel() == 0 for orig in originals):
        # Empty parameters: layout only; their backward is test_empty_parameter_backward's.
        return errors
    errors += _check_grads(model, params, originals, rank, world_size)
    return errors


def _check_grads(
    model: nn.Module, params: list, originals: list[torch.Tensor], rank: int, world_size: int
) -> list[str]:
    """One forward/backward with rank-dependent data; compare with the averaged reference."""
    errors: list[str] = []
    loss = model(_scale(rank))
    loss.backward()
    grads = []
    for p in params:
        grads.append(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
    for i, (p, grad, want) in enumerate(
        zip(params, grads, _reference_grads(originals, world_size), strict=True)
    ):
        where = f"param {i} of shape {tuple(want.shape)}"
        if grad is None:
            errors.append(f"{where}: no gradient after backward")
            continue
        if not isinstance(p.grad, DTensor) or p.grad.placements != p.placements:
            errors.append(f"{where}: grad is {type(p.grad).__name__}, want a DTensor like p")
        try:
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)
        except AssertionError as e:
            errors.append(f"{where}: grad differs from the reference: {e}")
    return errors


def _shapes_property(world_size: int) -> int:
    """Runs on every rank; all ranks draw the same shapes and fail together (see below)."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (world_size,))
    checked = []

    # No shrinking or example database: ranks must run identical sequences of collectives.
    @settings(
        derandomize=True,
        max_examples=30,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
    )
    @given(shapes=st.lists(_shape, min_size=1, max_size=3))
    # Shapes always covered, whatever hypothesis draws: scalar, dim 0 < world, empty
    # dims, a mixed group (flat-buffer offsets), a 3-dim parameter.
    @example(shapes=[()])
    @example(shapes=[(1,)])
    @example(shapes=[(3, 2)])
    @example(shapes=[(0, 4)])
    @example(shapes=[(4, 0)])
    @example(shapes=[(5, 3), (), (2,)])
    @example(shapes=[(9, 1, 2)])
    def check(shapes: list[tuple[int, ...]]) -> None:
        checked.append(shapes)
        errors = _check_one(shapes, mesh, rank, world_size)
        # Agree on failure so every rank raises (and hypothesis replays) in lockstep.
        all_errors: list[list[str] | None] = [None] * world_size
        dist.all_gather_object(all_errors, errors)
        bad = {r: errs for r, errs in enumerate(all_errors) if errs}
        assert not bad, f"shapes {shapes}: " + "; ".join(
            f"rank {r}: {', '.join(errs)}" for r, errs in bad.items()
        )

    check()
    return len(checked)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fully_shard_any_shape(world_size: int) -> None:
    counts = run_on_ranks(world_size, _shapes_property, world_size, timeout=300.0)
    assert len(set(counts)) == 1 and counts[0] >= 20, counts


def _empty_params_backward(world_size: int, shapes: list[tuple[int, ...]]) -> list[str]:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(1234)
    model = _Params(shapes)
    originals = [p.detach().clone() for p in model.ps]
    fully_shard(model, mesh=mesh)
    return _check_grads(model, list(model.ps), originals, rank, world_size)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_empty_parameter_backward(world_size: int) -> None:
    """A parameter with a zero-size dim (next to ordinary ones) gets an empty gradient and
    the others their reference gradients. (torch 2.13's fully_shard fails here too.)"""
    shapes = [(0, 3), (5,), (2, 0)]
    errors = run_on_ranks(world_size, _empty_params_backward, world_size, shapes)
    assert errors == [[]] * world_size, errors
