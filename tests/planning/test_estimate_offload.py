"""``fsdp2.estimate_memory`` with CPU offload by name, by budget and by phase: what a rank
holds between steps on the host (``MemoryEstimate.held_on_host``), read from the engine's
groups ([Note: offload by phase] in fsdp2/_core/params/residence.py), also on a CPU plan.

* A mapping keyed by names relative to the model (``fsdp2.cpu_offload_by_budget(model,
  budget)``'s) is split into each ``fully_shard`` call's own: the host holds exactly the
  selected parameters' rank-0 shards, their gradients and their AdamW state; a name under a
  block and one of the root's both land; ``offload_after_backward=False`` rests on the
  device (nothing on the host), ``CPUOffloadPolicy()`` everything; the settings name it.
* A name that is no parameter of the model raises ``ValueError`` from the simulation, and
  the fake process group is gone afterwards.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsdp2
from fsdp2.models import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=128, dim=128, n_layers=2, n_heads=4, max_seq_len=64)
W = 384 * 128 * 4  # bytes of one feed-forward weight (the largest parameters)


def _llama() -> Llama:
    with torch.device("meta"):
        return Llama(CFG)


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.empty(2, 64, dtype=torch.long, device="meta")
    return tok, tok


def _estimate(offload: object) -> fsdp2.MemoryEstimate:
    return fsdp2.estimate_memory(
        _llama(), _tokens(), mesh_shape=2, device="cpu", compare=False, offload_policy=offload
    )


def _rank0_bytes(names: set[str]) -> int:
    """Rank 0's shard bytes (fp32, dim 0 over 2 ranks) of the named parameters."""
    shapes = dict((n, p.shape) for n, p in _llama().named_parameters())
    return sum(-(-shapes[n][0] // 2) * shapes[n][1:].numel() * 4 for n in names)


def _check_host(est: fsdp2.MemoryEstimate, names: set[str]) -> None:
    shards = _rank0_bytes(names)
    host = est.held_on_host
    assert host["parameters"] == shards and host["gradients"] == shards, host
    # AdamW: exp_avg and exp_avg_sq, and a 0-dim step per parameter
    assert 2 * shards <= host["optimizer state"] <= 2 * shards + 8 * len(names), host


def test_offload_by_budget_and_by_name() -> None:
    # a prefix of the largest-first order: three of the six feed-forward weights fit 3 W
    # (ties broken by name: layers.0's); 3 W - 1 holds two, not a smaller third parameter
    offload = fsdp2.cpu_offload_by_budget(_llama(), 3 * W)
    ffn0 = {f"layers.0.feed_forward.w{i}.weight" for i in (1, 2, 3)}
    assert set(offload) == ffn0
    assert len(fsdp2.cpu_offload_by_budget(_llama(), 3 * W - 1)) == 2
    est = _estimate(offload)
    assert est.settings == "reshard_after_forward=True, CPU offload of 3 parameters"
    _check_host(est, ffn0)
    assert est.held["parameters"] > est.held_on_host["parameters"] > 0
    # a block's name and the root's; a parameter resting on the device counts nowhere there
    fwd_only = fsdp2.CPUOffloadPolicy(offload_after_backward=False)
    est = _estimate(
        {
            "layers.1.attention.wq.weight": fsdp2.CPUOffloadPolicy(),
            "tok_embeddings.weight": fsdp2.CPUOffloadPolicy(pin_memory=False),
            "output.weight": fwd_only,
        }
    )
    _check_host(est, {"layers.1.attention.wq.weight", "tok_embeddings.weight"})


def test_phase_flags_and_unknown_names() -> None:
    plain = _estimate(None)
    assert plain.held_on_host == {"parameters": 0, "gradients": 0, "optimizer state": 0}
    every = _estimate(fsdp2.CPUOffloadPolicy())
    assert every.settings == "reshard_after_forward=True, CPU offload"
    assert every.held_on_host == every.held == plain.held
    rest_on_device = _estimate(fsdp2.CPUOffloadPolicy(offload_after_backward=False))
    assert rest_on_device.settings.endswith("CPU offload (offload_after_backward=False)")
    assert rest_on_device.held_on_host == plain.held_on_host
    assert rest_on_device.held == plain.held
    with pytest.raises(ValueError, match="'feed_forward.w4.weight'"):
        _estimate({"layers.0.feed_forward.w4.weight": fsdp2.CPUOffloadPolicy()})
    assert not dist.is_initialized()
