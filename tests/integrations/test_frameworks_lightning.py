"""Lightning's ``ModelParallelStrategy`` on fsdp2 (``fsdp2.integrations.using_fsdp2``):
bitwise torch's FSDP2.

Each case is one spawned 2-rank run (the workers look like a torchrun launch to Lightning,
``frameworks_common.rank_env`` plus ``TORCHELASTIC_RUN_ID``, so Lightning uses the existing
gloo group and launches nothing) that trains a tiny ``LlamaForCausalLM`` with torch's FSDP2
and then with fsdp2 under the switch, sharding each decoder layer and the root through
torch's names, and compares the rank-averaged losses of every micro-step and the final full
parameters bitwise.

* Fabric: 4 micro-steps, the even ones inside ``fabric.no_backward_sync(model)``: those issue
  no reduction at all with either engine (counted with ``comm_counter.CommCounter``; Fabric's
  check is ``isinstance(module, FSDPModule)`` on torch's name), the odd ones reduce and step.
  Then ``fabric.save`` sharded (DCP) and full (one file); a fresh model ``fabric.load`` s each
  and trains 2 more micro-steps: fsdp2 from torch's checkpoints equals torch from its own;
* the PL ``Trainer``: a ``LightningModule`` whose ``configure_model`` shards; 2 epochs of 2
  batches per rank with ``accumulate_grad_batches=2``, ``trainer.save_checkpoint``
  (sharded), then a new ``Trainer`` resumes (``ckpt_path``) for a third epoch, exactly its 2
  batches: fsdp2 from torch's checkpoint equals torch from its own.

[Note: PL resume counts] The runs are bounded by ``max_epochs``, not ``max_steps``. With
``max_steps``, Lightning treats every resume as a mid-epoch restart
(``_FitLoop.restarting`` is forced on for iteration-based training), so a checkpoint saved
when ``fit`` stopped at the end of an epoch starts the next epoch at ``batch_idx`` = the
batches the saved epoch had completed (2): the resumed run trained ``len(loader) - 2``
batches of that epoch, and stepped on its last one even with one micro-batch accumulated.
That count followed the resumed loader's length, not the checkpoint (1 with the 3-batch
loader the test used, 2 with a 4-batch one), so it was right only by accident; it was 1 alone
and after the other framework files in one worker pool alike (no state leaked between tests;
measured with the (epoch, batch_idx) record below). An epoch-bound
resume of an end-of-epoch checkpoint starts a fresh epoch at ``batch_idx`` 0: the test
asserts the exact (epoch, batch_idx) of every resumed batch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _harness import run_on_ranks
from comm_counter import CommCounter
from frameworks_common import ENGINES, mean_loss, rank_env, record, tiny_llama, tokens
from helpers import check_same_run

from fsdp2.integrations import using_fsdp2

if importlib.util.find_spec("lightning") is None:  # (importing it here costs the collection ~1 s)
    pytest.skip("lightning is a test extra: pip install -e '.[test]'", allow_module_level=True)
pytest.importorskip("transformers", reason="transformers is a test extra")

STEPS = 4


@contextlib.contextmanager
def _engine(engine: str) -> Iterator[None]:
    """Lightning's view of a torchrun launch, and fsdp2 under the switch or torch's FSDP2."""
    with rank_env(), using_fsdp2() if engine == "fsdp2" else contextlib.nullcontext():
        os.environ["TORCHELASTIC_RUN_ID"] = "fsdp2-tests"
        yield


def _parallelize(model: Any, device_mesh: Any) -> Any:
    """Written for torch's FSDP2, as a Lightning user would."""
    import torch.distributed.fsdp as torch_fsdp

    mesh = device_mesh["data_parallel"]
    for layer in model.model.layers:
        torch_fsdp.fully_shard(layer, mesh=mesh)
    torch_fsdp.fully_shard(model, mesh=mesh)
    return model


def _fabric(full: bool = False) -> Any:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        parallelize_fn=_parallelize,
        data_parallel_size=2,
        tensor_parallel_size=1,
        save_distributed_checkpoint=not full,
    )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    return fabric


def _fabric_train(fabric: Any, model: Any, opt: Any, steps: range) -> tuple[list[float], list]:
    losses, reductions = [], []
    for step in steps:
        ids = tokens(step)
        with CommCounter() as counter:
            with fabric.no_backward_sync(model, enabled=step % 2 == 0):
                loss = model(input_ids=ids, labels=ids).loss
                fabric.backward(loss)
        reductions.append(sum(1 for c in counter.calls if c.kind in ("RS", "AR")))
        if step % 2:
            opt.step()
            opt.zero_grad()
        losses.append(mean_loss(loss))
    return losses, reductions


def _fabric_setup(fabric: Any) -> tuple[Any, Any]:
    model = fabric.setup(tiny_llama())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, opt


def _fabric_case(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for engine in ENGINES:
        with _engine(engine):
            fabric = _fabric()
            model, opt = _fabric_setup(fabric)
            losses, out[f"{engine}-reductions"] = _fabric_train(fabric, model, opt, range(STEPS))
            out[engine] = record(losses, model)
            out[f"{engine}-engine"] = type(model.module).__module__.split(".")[0]
            state = {"model": model, "optimizer": opt}
            fabric.save(os.path.join(tmp, f"{engine}-sharded"), state)
            _fabric(full=True).save(os.path.join(tmp, f"{engine}-full.ckpt"), state)
    for kind, name in (("sharded", "sharded"), ("full", "full.ckpt")):
        for engine in ENGINES:
            with _engine(engine):
                fabric = _fabric(full=kind == "full")
                model, opt = _fabric_setup(fabric)
                fabric.load(os.path.join(tmp, f"torch-{name}"), {"model": model, "optimizer": opt})
                losses, _ = _fabric_train(fabric, model, opt, range(STEPS, STEPS + 2))
                out[f"{kind}-{engine}"] = record(losses, model)
    return out


def test_fabric_no_backward_sync_and_checkpoints(tmp_path) -> None:
    out = run_on_ranks(2, _fabric_case, str(tmp_path))[0]
    assert out["torch-engine"] == "torch" and out["fsdp2-engine"] == "fsdp2", out
    for engine in ENGINES:  # no reduction in the skipped micro-steps, some in the others
        reductions = out[f"{engine}-reductions"]
        assert reductions[0::2] == [0, 0] and min(reductions[1::2]) > 0, (engine, reductions)
    check_same_run(out["fsdp2"], out["torch"])
    for kind in ("sharded", "full"):
        check_same_run(out[f"{kind}-fsdp2"], out[f"{kind}-torch"], f"{kind} resume")


def _lightning_module() -> Any:
    import lightning as L

    class TinyLlama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.llama = tiny_llama()
            self.losses: list[float] = []
            self.seen: list[tuple[int, int]] = []  # (epoch, batch_idx) of each batch

        def configure_model(self) -> None:
            _parallelize(self.llama, self.device_mesh)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.llama(input_ids=batch, labels=batch).loss
            self.losses.append(mean_loss(loss))
            self.seen.append((self.current_epoch, batch_idx))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return TinyLlama()


def _trainer(max_epochs: int) -> Any:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_epochs=max_epochs,  # see [Note: PL resume counts]
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _data() -> Any:
    """This rank's 4 sequences; Lightning's ``DistributedSampler`` gives each rank 2 per epoch."""
    return torch.utils.data.DataLoader([tokens(s)[0] for s in range(4)], batch_size=1)


EPOCHS = 2  # 2 batches per rank each: 2 optimizer steps, then one more epoch on resume


def _trainer_case(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for engine in ENGINES:
        with _engine(engine):
            module, trainer = _lightning_module(), _trainer(EPOCHS)
            trainer.fit(module, _data())
            out[engine] = record(module.losses, module.llama)
            out[f"{engine}-seen"] = module.seen
            out[f"{engine}-engine"] = type(module.llama).__module__.split(".")[0]
            trainer.save_checkpoint(os.path.join(tmp, f"{engine}.ckpt"))
    for engine in ENGINES:
        with _engine(engine):
            module, trainer = _lightning_module(), _trainer(EPOCHS + 1)
            trainer.fit(module, _data(), ckpt_path=os.path.join(tmp, "torch.ckpt"))
            out[f"resume-{engine}"] = record(module.losses, module.llama)
            out[f"resume-{engine}-seen"] = module.seen
            out[f"resume-{engine}-step"] = trainer.global_step
    return out


def test_pl_trainer_configure_model(tmp_path) -> None:
    out = run_on_ranks(2, _trainer_case, str(tmp_path))[0]
    assert out["torch-engine"] == "torch" and out["fsdp2-engine"] == "fsdp2", out
    for engine in ENGINES:
        assert out[f"{engine}-seen"] == [(0, 0), (0, 1), (1, 0), (1, 1)], out
        # resumed: a fresh epoch 2 from its first batch, one optimizer step (see the Note)
        assert out[f"resume-{engine}-seen"] == [(2, 0), (2, 1)], out
        assert out[f"resume-{engine}-step"] == 3, out
    check_same_run(out["fsdp2"], out["torch"])
    check_same_run(out["resume-fsdp2"], out["resume-torch"], "resume")
