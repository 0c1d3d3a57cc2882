"""Examples the property-based parity suite found failing, kept as named tests.

Each test runs one or a few ``Spec``s (pasted from the suite's failure message, then cut
down by hand to what still failed) through the same check as the property
(``_run.check_spec``: parity with the replicated reference, or the documented error on
every rank before any collective), on the world sizes where they failed and a neighbour.
The docstring says what was wrong and where it was fixed.
"""

from __future__ import annotations

import pytest
from _harness import run_on_ranks
from _run import run_specs
from _spec import Call, Node, Spec


def _check(world_size: int, *specs: Spec) -> None:
    assert run_on_ranks(world_size, run_specs, world_size, list(specs)) == [len(specs)] * world_size


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_bucketed_reduce_of_bf16_and_fp32_gradients(world_size: int) -> None:
    """A bf16 group (``reduce_dtype=fp32``) and an fp32 group bucketed into one
    reduce-scatter: both reduce in fp32, so ``bucket_key`` put them together, and packing
    their gradients (bf16 and fp32) raised "_chunk_cat expects all input tensors with the
    same dtype" in backward. Fixed in fsdp2/_core/runtime/reduce.py (``bucket_key`` includes
    ``param_dtype``)."""
    root = Node(
        bias=False,
        shard=Call(reshard=None, policy="fp32"),
        children=(Node(bias=False, shard=Call(reshard=True, policy="bf16-reduce32")),),
    )
    spec = Spec(world_size, None, 2, root, bucket_bytes=1 << 20, seed=1651)
    _check(world_size, spec)


# Found by the long profile (FSDP2_PROPERTY_SEED=12345, world size 3), as the loss of rank 1
# differing from the reference at step 1.
_SCALAR_REPLICAS = Spec(
    world_size=3,
    mesh=(1, 3),
    dim=5,
    root=Node(
        tie="self",
        shard=Call(reshard=3, policy="reduce-bf16"),
        shard_children=Call(reshard=1, policy="reduce-bf16"),
        children=(
            Node(bias=False, extras=((7,),), buffer=True, tie="self"),
            Node(extras=((9,), ()), buffer=True),
        ),
    ),
    accumulation="nosync",
    seed=7347,
)


def test_scalar_parameter_replicas_get_the_same_gradient() -> None:
    """0-dim parameters are replicated; their gradient is written into every rank's slot of
    the reduce-scatter, and each slot is summed in another order: rank 1's copy of
    ``kids.1.e1`` (0-dim, reduce_dtype=bf16) got 0.53125 where ranks 0 and 2 got 0.52734375
    after step 0, and rank 1's next loss differed from the reference. Fixed in
    fsdp2/_core/runtime/reduce.py (``_agree_on_scalars``: every rank takes shard rank 0's sum)."""
    _check(3, _SCALAR_REPLICAS)
