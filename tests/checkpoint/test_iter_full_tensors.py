"""``fsdp2.checkpoint.iter_full_tensors``: a model's full tensors streamed in a few
bucketed all-gathers (weight sync to an inference engine; issue 39, first part).

* FSDP (uneven dims: vocabulary 251 over 2 and 3 ranks) and HSDP (2x2), a tied Hugging Face
  Llama: the yielded ``(name, tensor)`` pairs are exactly ``state_dict()``'s full tensors,
  bitwise (also against torch's FSDP2's ``state_dict()`` of the same model), first names in
  state-dict order, the tied name right after its first; with ``dtype=torch.bfloat16`` each
  is the full tensor cast (the cast happens before the gather: the all-gathers carry bf16).
* The all-gathers: one per bucket (``bucket_bytes`` large: one in all for FSDP), more with
  small buckets, every one on the shard group.
* Memory: with a consumer holding one tensor at a time, the storages the stream creates
  never exceed two buckets (the benchmark's meter, benchmarks/weight_sync.py).
* ``ranks=[0]``: rank 0 receives everything, the others run the same collectives and yield
  nothing. ``key_map`` renames and drops. After training steps the values are the trained
  ones.
* Errors before any collective: inside a forward, a bad ``dtype`` / ``bucket_bytes`` /
  ``ranks``, a model on the meta device.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks
from comm_counter import CommCounter
from helpers import hsdp_mesh, world_mesh
from models import hf_llama_config

from fsdp2 import fully_shard
from fsdp2.checkpoint import iter_full_tensors

pytest.importorskip("transformers", reason="transformers is a test extra")


def _llama(fully_shard_fn: Any, mesh: Any) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_llama_config(251, intermediate_size=66, tie_word_embeddings=True))
    for layer in model.model.layers:
        fully_shard_fn(layer, mesh=mesh)
    fully_shard_fn(model, mesh=mesh)
    return model


def _full_state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _check_exact(model: Any, what: str) -> dict[str, Any]:
    ref = _full_state(model)
    with CommCounter() as counter:
        got = list(iter_full_tensors(model, bucket_bytes=1 << 30))
    names = [n for n, _ in got]
    assert sorted(names) == sorted(ref), (what, set(names) ^ set(ref))
    firsts = [n for n in names if n != "lm_head.weight"]
    assert firsts == [n for n in ref if n != "lm_head.weight"], (what, firsts)
    assert names[names.index("model.embed_tokens.weight") + 1] == "lm_head.weight"
    for name, t in got:
        assert torch.equal(t, ref[name]) and t.dtype == ref[name].dtype, (what, name)
    gathers = [c for c in counter.calls if c.kind == "AG"]
    bf16 = dict(iter_full_tensors(model, dtype=torch.bfloat16))
    for name, t in bf16.items():
        assert torch.equal(t, ref[name].to(torch.bfloat16)), (what, "bf16", name)
    with CommCounter() as small:  # small buckets: gloo's own all-gather, then copied out
        for name, t in iter_full_tensors(model, bucket_bytes=4096):
            assert torch.equal(t, ref[name]), (what, "small buckets", name)
    return {
        "gathers": len(gathers),
        "small_gathers": len([c for c in small.calls if c.kind == "AG"]),
        "group_sizes": sorted({c.group_size for c in gathers}),
    }


def _layouts() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out: dict[str, Any] = {}
    world = dist.get_world_size()
    model = _llama(fully_shard, world_mesh())
    out["fsdp"] = _check_exact(model, "fsdp")
    theirs = _full_state(_llama(torch_fully_shard, world_mesh()))
    ours = dict(iter_full_tensors(model))
    assert all(torch.equal(ours[k], v) for k, v in theirs.items()) and len(ours) == len(theirs)
    if world == 4:
        out["hsdp"] = _check_exact(_llama(fully_shard, hsdp_mesh((2, 2))), "hsdp")
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_yields_state_dict_full_tensors(world_size: int) -> None:
    for out in run_on_ranks(world_size, _layouts):
        for layout, counts in out.items():
            # one bucket for everything, several with 4 KiB buckets
            assert counts["gathers"] == 1, (layout, counts)
            assert counts["small_gathers"] > 3, (layout, counts)
            shard = world_size if layout == "fsdp" else 2
            assert counts["group_sizes"] == [shard], (layout, counts)


def _ranks_key_map_training() -> dict[str, Any]:
    model = _llama(fully_shard, world_mesh())
    rank = dist.get_rank()
    ref = _full_state(model)
    with CommCounter() as counter:
        got = list(iter_full_tensors(model, ranks=[0]))
    out: dict[str, Any] = {
        "n_ranks0": len(got),
        "gathers": len([c for c in counter.calls if c.kind == "AG"]),
    }
    assert (len(got) == len(ref)) if rank == 0 else not got
    renamed = dict(
        iter_full_tensors(
            model,
            key_map=lambda n: None if "layers.1." in n else n.replace("model.", "base."),
        )
    )
    assert all("layers.1." not in n for n in renamed)
    assert torch.equal(renamed["base.norm.weight"], ref["model.norm.weight"])
    # trained values
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 251, (2, 8), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    trained = _full_state(model)
    assert not torch.equal(trained["model.norm.weight"], ref["model.norm.weight"])
    for name, t in iter_full_tensors(model):
        assert torch.equal(t, trained[name]), name
    return out


def test_ranks_key_map_and_trained_values() -> None:
    out = run_on_ranks(2, _ranks_key_map_training)
    assert out[0]["n_ranks0"] == 21 and out[1]["n_ranks0"] == 0
    assert out[0]["gathers"] == out[1]["gathers"] >= 1


def _memory() -> dict[str, int]:
    # The benchmark's meter: the bytes of storages created inside the block, still alive.
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "weight_sync.py")
    spec = importlib.util.spec_from_file_location("weight_sync_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = _llama(fully_shard, world_mesh())
    bucket = 64 << 10  # above the largest tensor's footprint (the embedding: 48 KiB)
    out = {"bucket": bucket}
    for dtype in (None, torch.bfloat16):
        with CommCounter() as counter, bench._Live() as live:
            for _ in iter_full_tensors(model, dtype=dtype, bucket_bytes=bucket):
                pass  # a consumer holding one tensor at a time
        out[f"peak {dtype}"] = live.peak
        out[f"gathers {dtype}"] = len([c for c in counter.calls if c.kind == "AG"])
    return out


def test_memory_under_two_buckets() -> None:
    for out in run_on_ranks(2, _memory):
        # About 280 KiB of fp32 tensors: several buckets, at most two alive. The meter sees
        # 1.6 buckets at the peak on an idle machine (one bucket's copy-out); with the CPUs
        # oversubscribed up to 2.2 (timing-dependent: the next bucket's buffers meet more of
        # the previous bucket's tensors). Holding a bucket past its last tensor (the bug the
        # bound is for) measured 2.5.
        assert out["gathers None"] >= 3 and out["gathers torch.bfloat16"] >= 2, out
        assert 0 < out["peak None"] < 2.5 * out["bucket"], out
        assert 0 < out["peak torch.bfloat16"] < 2.5 * out["bucket"], out


class _Between(torch.nn.Module):
    """A plain buffer between two sharded linears, and empty parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = torch.nn.Linear(4, 4)
        self.mid = torch.nn.Module()
        self.mid.register_buffer("count", torch.tensor([3.0, 4.0]))
        self.lin2 = torch.nn.Linear(4, 4)
        self.rows0 = torch.nn.Parameter(torch.empty(0, 3))
        self.cols0 = torch.nn.Parameter(torch.empty(4, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.lin1(x))


def _between() -> list[int]:
    torch.manual_seed(0)
    model = _Between()
    fully_shard(model, mesh=world_mesh())
    ref = {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v
        for k, v in model.state_dict().items()
    }
    counts = []
    for ranks in ([0], [1], None):
        got = dict(iter_full_tensors(model, ranks=ranks))
        counts.append(len(got))
        for name, t in got.items():
            assert torch.equal(t, ref[name]) and t.shape == ref[name].shape, name
    return counts


def test_local_tensors_between_buckets_and_empty_tensors() -> None:
    # Regressions: a rank outside ``ranks`` skipped the plain buffer between the two
    # linears and so merged their rows into one all-gather where receivers ran two (gloo:
    # "Received data size doesn't match expected size"); a (0, 3) parameter divided by zero.
    out = run_on_ranks(2, _between)
    assert out == [[7, 0, 7], [0, 7, 7]]


def _errors() -> None:
    model = _llama(fully_shard, world_mesh())
    seen = []

    def hook(module: Any, args: Any) -> None:
        with pytest.raises(RuntimeError, match="inside the model's forward"):
            next(iter_full_tensors(model))
        seen.append(True)

    handle = model.model.layers[0].register_forward_pre_hook(hook)
    ids = torch.zeros(1, 4, dtype=torch.long)
    model(input_ids=ids)
    handle.remove()
    assert seen
    with pytest.raises(TypeError, match="floating-point dtype"):
        next(iter_full_tensors(model, dtype=torch.int8))
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
        next(iter_full_tensors(model, bucket_bytes=0))
    with pytest.raises(ValueError, match="ranks must be in"):
        next(iter_full_tensors(model, ranks=[5]))
    with torch.device("meta"):
        meta = _llama(fully_shard, world_mesh())
    with pytest.raises(ValueError, match="on the meta device"):
        next(iter_full_tensors(meta))
    # the model still streams after the errors (no collective was issued by them)
    assert len(list(iter_full_tensors(model))) == 21


def test_errors_before_any_collective() -> None:
    run_on_ranks(2, _errors)
