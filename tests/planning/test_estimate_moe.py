"""``fsdp2.estimate_memory`` on the mixture-of-experts model (``fsdp2.models.moe``) against
the peak measured on 4 gloo ranks, within 10% (as ``test_estimate_memory.py`` checks the
dense models, with its measuring helper: ``benchmarks/_memory.py``'s sampler, AdamW, two
warm-up steps).

* EP + FSDP (torchtitan's layout, as in ``tests/integrations/test_moe.py``): experts split
  over ``ep`` (2) by ``apply_expert_parallel`` and sharded over ``efsdp`` (2), the dense
  weights over all 4 ranks, ``reshard_after_forward`` True and False (False in the long
  suite); and plain FSDP over 4 ranks with every expert local (no all-to-all).
* The estimate simulates rank 0 and is compared with rank 0's measured peak.
* Routing: the simulated step runs on fake tensors, whose token counts cannot be read, so
  the MoE layers assume balanced routing there (see the docstring of fsdp2/models/moe.py);
  the measured step routes for real, with the uneven loads of an untrained router
  (asserted: the test would mean little with balanced real routing).
* Meshes: ``build(mesh)`` makes its own (``init_device_mesh((2, 2))`` over the fake world of
  4; the 1D mesh ``estimate_memory`` hands it is not used). Building a mesh reads its rank
  tensor (``.tolist()``) and sharding a DTensor parameter composes meshes
  (``DeviceMesh._concatenate``, a ``nonzero``), which fake tensors cannot do, so the build
  runs outside the fake mode (``unset_fake_temporarily``) on the meta device: nothing is
  allocated, and ``estimate_memory`` materializes the sharded meta model as fake tensors
  (``to_empty``), as for any model built on meta.

The loss is each rank's mean over the data-parallel size (divide factor 1: [Note: MoE loss
scaling] in fsdp2/models/moe.py), the same in both steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from test_estimate_memory import _measured_peak
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fsdp2
from fsdp2.models import MoEConfig, MoETransformer, apply_expert_parallel, parallelize_moe

MiB = 2**20
WORLD_SIZE = 4
CFG = MoEConfig(
    vocab_size=256, dim=128, n_layers=2, n_heads=4, num_experts=8, top_k=2, hidden=256,
    max_seq_len=64,
)  # fmt: skip
BATCH, SEQ = 4, 64  # per rank


def _sharded(layout: str, reshard: bool) -> MoETransformer:
    """``CFG`` sharded with fsdp2: ``"ep"`` (efsdp 2 x ep 2, dense over all 4) or ``"fsdp"``
    (everything over all 4 ranks, no expert parallelism)."""
    efsdp: DeviceMesh | None = None
    ep: DeviceMesh | None = None
    if layout == "ep":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
        dp, efsdp, ep = mesh._flatten("dp"), mesh["efsdp"], mesh["ep"]
    else:
        dp = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("dp",))
    model = MoETransformer(CFG)
    if ep is not None:
        apply_expert_parallel(model, ep)
    return parallelize_moe(
        model,
        fully_shard=fsdp2.fully_shard,
        dp_mesh=dp,
        efsdp_mesh=efsdp,
        ep_degree=ep.size() if ep is not None else 1,
        reshard_after_forward=reshard,
    )


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    loss: torch.Tensor = model(*batch)
    return loss / dist.get_world_size()


def _estimate(layout: str, reshard: bool) -> fsdp2.MemoryEstimate:
    def build(mesh: DeviceMesh) -> nn.Module:
        with unset_fake_temporarily(), torch.device("meta"):
            return _sharded(layout, reshard)

    tokens = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    return fsdp2.estimate_memory(
        build,
        (tokens, tokens),
        mesh_shape=WORLD_SIZE,
        device="cpu",
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        step_fn=_loss,
        compare=False,
    )


def _measure(layout: str, reshard: bool) -> tuple[int, list[list[int]]]:
    """This rank's peak and, per block, the tokens it routed to each expert (last step)."""
    torch.manual_seed(0)
    model = _sharded(layout, reshard)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())

    def loss() -> torch.Tensor:
        tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=gen)
        return _loss(model, (tokens[:, :-1], tokens[:, 1:]))

    peak = _measured_peak(model, loss)
    sent = [block.moe.tokens_per_expert for block in model.blocks()]
    return peak, [t.tolist() for t in sent if t is not None]


@pytest.mark.parametrize(
    "layout,reshard",
    [
        pytest.param("ep", True, id="ep"),
        # long (docs/testing.md): the EP + FSDP layout checked by [ep], and
        # reshard_after_forward=False by test_estimate_memory's MLP case with it
        pytest.param("ep", False, id="ep-keep", marks=pytest.mark.long),
        pytest.param("fsdp", True, id="fsdp"),
    ],
)
def test_moe_estimate_within_10_percent_of_measured_peak(layout: str, reshard: bool) -> None:
    est = _estimate(layout, reshard)
    assert est.world_size == WORLD_SIZE and sum(est.parts.values()) == est.peak_bytes
    results: list[Any] = run_on_ranks(WORLD_SIZE, _measure, layout, reshard, timeout=300)
    measured = results[0][0]  # rank 0, the rank the estimate simulates
    sent = torch.tensor([r[1] for r in results])  # (rank, block, expert)
    # Real routing is uneven (balanced would be BATCH * SEQ * top_k / num_experts each).
    assert sent.max() > 1.1 * sent.float().mean(), f"routing came out balanced: {sent}"
    error = (est.peak_bytes - measured) / measured
    assert abs(error) < 0.10, (
        f"{layout} reshard={reshard}: estimate {est.peak_bytes / MiB:.2f} MiB vs measured "
        f"{measured / MiB:.2f} MiB on rank 0 ({error:+.1%}); every rank: "
        f"{[round(r[0] / MiB, 2) for r in results]}\n{est}"
    )
