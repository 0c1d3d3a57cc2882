"""fsdp2's debug mode (``fsdp2.set_debug``, ``FSDP2_DEBUG``): ranks that disagree on the next
collective get a ``RuntimeError`` naming what each was about to do, within seconds, instead
of a hang. 2 and 4 gloo ranks, the Llama of ``fsdp2.models`` sharded per block + root.

* Agreeing ranks: 2 training steps with debug mode on give bitwise the losses and
  parameters of the same run with it off (FSDP on 2 ranks; HSDP 2x2 with its all-reduces;
  bucketed collectives; ``reshard_after_forward=2`` on 4 ranks).
* Different micro-batch counts with ``set_requires_gradient_sync(False)`` on all but the last:
  in the first backward rank 1 (syncing) reduce-scatters a block's gradients while rank 0
  (not syncing) all-gathers the next block: both raise at once, naming both ranks'
  collectives and the micro-batch hint.
* Different micro-batch counts with gradients reduced every micro-batch: the collectives
  agree until rank 1 stops; rank 0 raises after the (short) debug timeout, naming rank 1 and
  the last collective it announced.
* A module skipped on one rank (``layers.1``, in the second step: the forward's prefetch
  gathers it on every rank, the backwards differ) and a model of another width on one rank
  (the root's first all-gather): every rank raises, naming the modules / element counts.
* ``set_debug`` validates its timeout; ``FSDP2_DEBUG=1`` / ``FSDP2_DEBUG_TIMEOUT`` turn it on.

The two micro-batch scenarios are docs/debugging.md's: the errors the page shows are these
tests' messages, word for word (the page wraps the lines; the second ends in ``...``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _harness import run_on_ranks
from helpers import hsdp_mesh, world_mesh

import fsdp2
from fsdp2 import fully_shard
from fsdp2._core.support.debug import _from_env
from fsdp2.models.llama import Llama, LlamaConfig

TIMEOUT = 3.0  # seconds the debug check waits for other ranks
PAGE = Path(__file__).resolve().parents[3] / "docs" / "debugging.md"


def _as_the_page_shows(index: int, message: str) -> None:
    """docs/debugging.md's ``index``-th debug-mode error is ``message`` (whitespace collapsed:
    the page wraps its lines; a page ending in ``...`` shows the message's beginning)."""
    pattern = r"^```\n(RuntimeError: fsdp2 debug: .*?)^```"
    blocks = re.findall(pattern, PAGE.read_text(), re.M | re.S)
    shown, got = " ".join(blocks[index].split()), " ".join(f"RuntimeError: {message}".split())
    if shown.endswith(" ..."):
        assert got.startswith(shown[: -len("...")]), f"docs/debugging.md shows\n{shown}\nnot\n{got}"
    else:
        assert got == shown, f"docs/debugging.md shows\n{shown}\nnot\n{got}"


def _model(dim: int = 32, mesh=None, **kw) -> Llama:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=dim, n_layers=3, n_heads=4, max_seq_len=16))
    mesh = mesh if mesh is not None else world_mesh()
    for block in model.layers:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh)
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + dist.get_rank())
    tokens = torch.randint(0, 64, (2, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model: Llama, steps: int = 2) -> list[float]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = model(x, y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _agreeing(layout: str) -> tuple[list[float], list[float]]:
    def build() -> Llama:
        if layout == "hsdp":
            return _model(mesh=hsdp_mesh((2, 2)))
        if layout == "buckets":
            model = _model()
            model.set_bucket_bytes(1 << 20)
            return model
        if layout == "reshard2":
            return _model(reshard_after_forward=2)
        return _model()

    plain = _train(build())
    fsdp2.set_debug(True, timeout=TIMEOUT)
    try:
        checked = build()
        losses = _train(checked)
    finally:
        fsdp2.set_debug(False)
    reference = build()
    _train(reference)
    for (name, a), (_, b) in zip(
        checked.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
    return plain, losses


@pytest.mark.parametrize(
    "world, layout", [(2, "fsdp"), (4, "hsdp"), (2, "buckets"), (4, "reshard2")]
)
def test_agreeing_ranks_train_as_without_debug(world, layout):
    for plain, checked in run_on_ranks(world, _agreeing, layout):
        assert plain == checked, (plain, checked)


def _run_expecting_error(fn_name: str) -> str:
    """Run scenario ``fn_name`` in debug mode; the error message on this rank ("" if none)
    and how long it took."""
    fsdp2.set_debug(True, timeout=TIMEOUT)
    start = time.monotonic()
    try:
        SCENARIOS[fn_name]()
    except RuntimeError as e:
        return f"{time.monotonic() - start:.1f}s|{e}"
    finally:
        fsdp2.set_debug(False)
    return f"{time.monotonic() - start:.1f}s|"


def _microbatches_no_sync() -> None:
    model = _model()
    n = 2 if dist.get_rank() == 0 else 1
    for i in range(n):
        model.set_requires_gradient_sync(i == n - 1)
        x, y = _batch(i)
        model(x, y).backward()


def _microbatches_synced() -> None:
    model = _model()
    n = 2 if dist.get_rank() == 0 else 1
    for i in range(n):
        x, y = _batch(i)
        model(x, y).backward()


class _Skipping(Llama):
    """Llama whose forward can skip one block (a data-dependent path, e.g. early exit)."""

    def forward(self, tokens: torch.Tensor, skip: int | None = None) -> torch.Tensor:  # type: ignore[override]
        h = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            if i != skip:
                h = layer(h, self.rope)
        return self.output(self.norm(h))


def _skip_a_module() -> None:
    torch.manual_seed(0)
    model = _Skipping(LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, max_seq_len=16))
    for block in model.layers:
        fully_shard(block, mesh=world_mesh())
    fully_shard(model, mesh=world_mesh())
    x, _ = _batch(0)
    model(x).sum().backward()  # both ranks agree
    # With the forward order known, every rank prefetches layers.1 in the forward (rank 1
    # then drops it unused); the backwards differ: rank 1 has no gradients of layers.1.
    model(x, skip=1 if dist.get_rank() == 1 else None).sum().backward()


def _another_width() -> None:
    model = _model(dim=32 if dist.get_rank() == 0 else 48)
    x, y = _batch(0)
    model(x, y)


SCENARIOS = {
    "microbatches_no_sync": _microbatches_no_sync,
    "microbatches_synced": _microbatches_synced,
    "skip_a_module": _skip_a_module,
    "another_width": _another_width,
}


def _outcomes(name: str) -> list[tuple[float, str]]:
    start = time.monotonic()
    results = run_on_ranks(2, _run_expecting_error, name, timeout=60)
    assert time.monotonic() - start < 30, "debug mode took too long to report"
    out = []
    for r in results:
        seconds, message = r.split("|", 1)
        out.append((float(seconds[:-1]), message))
    return out


def test_microbatch_counts_with_no_sync():
    (t0, m0), (t1, m1) = _outcomes("microbatches_no_sync")
    for m in (m0, m1):
        assert "ranks disagree on collective" in m, m
        # rank 0 (no gradient sync) gathers the next block for its backward while rank 1
        # (sync) reduce-scatters its gradients
        assert "rank 0: all-gather of layers." in m and "in the backward of step 1" in m, m
        assert "rank 1: reduce-scatter of layers." in m, m
        assert "different numbers of micro-batches" in m, m
        _as_the_page_shows(0, m)
    assert max(t0, t1) < TIMEOUT, "a mismatch is reported at once, not after the timeout"


def test_microbatch_counts_with_synced_gradients():
    (t0, m0), (t1, m1) = _outcomes("microbatches_synced")
    assert m1 == "", f"rank 1 ran its collectives in agreement: {m1}"
    assert "rank 0 is about to run collective" in m0 and "forward of step 2" in m0, m0
    assert f"rank(s) 1 did not reach it within {TIMEOUT:g} s" in m0, m0
    assert "rank 1: collective #" in m0 and "step 1" in m0, m0
    _as_the_page_shows(1, m0)
    assert TIMEOUT <= t0 < TIMEOUT + 10, t0


def test_module_skipped_on_one_rank():
    for _, m in _outcomes("skip_a_module"):
        assert "ranks disagree" in m and "in the backward of step 2" in m, m
        assert "layers.1 " in m.split("rank 1:")[0], f"rank 0 names layers.1: {m}"


def test_another_model_on_one_rank():
    for _, m in _outcomes("another_width"):
        assert "ranks disagree" in m, m
        counts = re.findall(r"\(([\d,]+) elements", m)
        assert counts == ["4,128", "6,192"], m  # the root's shard of each width


def test_set_debug_arguments(monkeypatch):
    with pytest.raises(ValueError, match="timeout must be a positive"):
        fsdp2.set_debug(True, timeout=0)
    assert not fsdp2.is_debug()
    monkeypatch.setenv("FSDP2_DEBUG", "1")
    monkeypatch.setenv("FSDP2_DEBUG_TIMEOUT", "7.5")
    state = _from_env()
    assert state.enabled and state.timeout == 7.5
    monkeypatch.setenv("FSDP2_DEBUG", "0")
    assert not _from_env().enabled
