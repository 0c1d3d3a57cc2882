"""torchtitan's own ``Trainer`` (PyPI 0.3.0) on a CPU-only torch with gloo, for the tests.

Nothing of torchtitan is edited: ``load()`` imports it with the patches of [Note: torchtitan
on CPU], ``trainer_config`` makes a small config (the llama3 debug model cut to 2 layers,
short sequences, a synthetic tokenizer and dataloader), and ``train`` runs a ``Trainer`` built
from it and records what it logs. These run inside a rank function (``run_on_ranks``): the
``Trainer`` takes the default process group the harness made (its ``init_distributed`` skips
an initialized one).

[Note: torchtitan on CPU]
torchtitan targets CUDA; on a CPU-only torch 2.13.0 it needs, each applied from outside:

1. a stand-in for ``triton`` while torchtitan is imported: it imports triton at module level
   (MoE and async expert-parallel kernels), and torch's CPU wheels ship without it. torch's
   own modules that probe for triton (dynamo, inductor) are imported first, so they see none;
   the stand-in leaves ``sys.modules`` with the import.
2. device ``"cpu"``: torchtitan fixes its device type at import
   (``torchtitan.tools.utils.device_type``, from ``torch._utils._get_available_device_type()
   or "cuda"``). During the import the type is ``"cpu"`` and its device module is
   ``torch.cpu`` plus the ``torch.cuda``-style calls torchtitan makes on it (memory stats,
   properties, ``set_device``), with ``current_device()`` returning 0 (torch.cpu returns
   ``"cpu"``, and torchtitan passes it to ``barrier(device_ids=[...])``). With device type
   ``"cpu"`` torchtitan chooses gloo by itself.
3. a dense attention in place of FlexAttention: torchtitan ``torch.compile``s
   ``flex_attention`` and ``create_block_mask`` (inductor), and FlexAttention has no CPU
   backward, eager or compiled. ``dense_flex_attention`` materializes the block mask's
   ``mask_mod`` and runs softmax attention; ``create_block_mask`` runs eagerly.
4. torch's engine only: gloo has no ``ReduceOp.PREMUL_SUM``, which torch's FSDP2 uses for
   torchtitan's ``set_gradient_divide_factor(1.0)`` ("Cannot use ReduceOp.PREMUL_SUM with
   Gloo"); ``set_force_sum_reduction_for_comms(True)`` on torch's modules is the same sum
   (factor 1). fsdp2's modules are left as they are.
5. ``torch.distributed.set_timeout``, which torchtitan 0.3.0 calls after the first step
   (``set_pg_timeouts``) and torch 2.13.0 has as ``_set_pg_timeout`` (same signature); set
   while a ``Trainer`` trains (``train``), removed afterwards. Not CPU-specific.
6. no 2 s sleep at the end of ``Trainer.train()``: rank 0 sleeps there "for other ranks to
   complete"; the collectives ``train`` runs next wait for every rank anyway. While a
   ``Trainer`` trains, ``torchtitan.trainer``'s ``time`` is ``time`` with a ``sleep`` that
   returns at once (the sleeps were 18 s of test_torchtitan_trainer.py's 29). Not
   CPU-specific.

What a ``Trainer`` changes in the process is put back by ``train``: Python's garbage
collector (torchtitan's ``GarbageCollection`` disables it) and the default group's timeout
(``set_pg_timeouts``: set to torch's default).

And two stand-ins only for a lean install: torchtitan imports ``datasets`` (pyarrow and
pandas, ~300 MB) and ``torch.utils.tensorboard`` (tensorboard, grpc, protobuf) at module
level, which a run with a synthetic dataloader and tensorboard off never calls. Where they
are not installed, stand-ins that raise if called serve the import and leave ``sys.modules``
with it.

Settings (``trainer_config``): ``parallelism.spmd_backend="partial_dtensor"`` (with the
default, ``spmd_types``, both engines refuse torchtitan's ``fully_shard(...,
dp_mesh_dims=...)`` over the plain parameters it leaves on CPU),
``training.disable_cuda_graphs=True``, validation off, no compile.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = [
    "REQUIRED",
    "available",
    "load",
    "train",
    "trainer_config",
]

# What torchtitan 0.3.0 imports when loaded (pyproject's `torchtitan` extra, torchtitan
# itself installed with --no-deps: the Makefile)
REQUIRED = ("torchtitan", "spmd_types", "torch_checkpointing", "tyro", "torchdata", "tokenizers")

VOCAB = 2048  # the debug model's
MICRO_BATCH = 2  # sequences per micro-batch (training.local_batch_size)

_LOADED: list[bool] = []


def available() -> str | None:
    """``None`` if torchtitan and what it imports are installed, else why not."""
    missing = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
    if missing:
        return (
            f"torchtitan's test needs {', '.join(missing)}: pip install -e '.[torchtitan]' "
            "and pip install --no-deps torchtitan==0.3.0 (make venv does both)"
        )
    return None


# ---- loading ----------------------------------------------------------------------------


class _Anything:
    """A triton attribute of any depth: callable (a decorator returns what it decorates)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # @triton.jit, @triton.autotune(...)(f)
        return _Anything(self._name + "()")

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Anything(f"{self._name}.{item}")

    def __getitem__(self, item: Any) -> Any:
        return _Anything(self._name + "[]")


def _stand_in(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package
    mod.__dict__.update(attrs)
    return mod


def _unused(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{name} is a stand-in of tests/integrations/torchtitan_cpu.py")

    return call


def _triton_stand_ins() -> dict[str, types.ModuleType]:
    def getattr_(mod: str) -> Callable[[str], Any]:
        def get(attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Anything(f"{mod}.{attr}")

        return get

    names = ("triton", "triton.language", "triton.runtime", "triton.compiler")
    mods = {n: _stand_in(n, __getattr__=getattr_(n), __version__="0.0.0") for n in names}
    mods["triton"].language = mods["triton.language"]
    return mods


def _lean_stand_ins() -> dict[str, types.ModuleType]:
    """``datasets`` and ``torch.utils.tensorboard`` where they are not installed."""
    out: dict[str, types.ModuleType] = {}
    if importlib.util.find_spec("datasets") is None:
        dd = _stand_in(
            "datasets.distributed",
            split_dataset_by_node=_unused("datasets.distributed.split_dataset_by_node"),
        )
        out["datasets"] = _stand_in(
            "datasets",
            Dataset=type("Dataset", (), {}),
            IterableDataset=type("IterableDataset", (), {}),
            load_dataset=_unused("datasets.load_dataset"),
            concatenate_datasets=_unused("datasets.concatenate_datasets"),
            interleave_datasets=_unused("datasets.interleave_datasets"),
            distributed=dd,
        )
        out["datasets.distributed"] = dd
    if importlib.util.find_spec("tensorboard") is None:
        writer = type("SummaryWriter", (), {"__init__": _unused("SummaryWriter")})
        out["torch.utils.tensorboard"] = _stand_in("torch.utils.tensorboard", SummaryWriter=writer)
    return out


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the ``torch.cuda``-style calls torchtitan makes on its device
    module (patch 2)."""

    def __init__(self) -> None:
        super().__init__("torchtitan_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(*args: Any, **kwargs: Any) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(*args: Any, **kwargs: Any) -> Any:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(name="cpu", total_memory=memory)

    @staticmethod
    def memory_stats(*args: Any, **kwargs: Any) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(*args: Any, **kwargs: Any) -> None:
        pass

    @staticmethod
    def empty_cache(*args: Any, **kwargs: Any) -> None:
        pass

    @staticmethod
    def set_device(*args: Any, **kwargs: Any) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0


_CPU_DEVICE = _CpuDeviceModule()


class _NoSleep(types.ModuleType):
    """``time`` whose ``sleep`` returns at once: ``torchtitan.trainer``'s while a ``Trainer``
    trains (patch 6)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


_NO_SLEEP = _NoSleep("time")


def dense_flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    score_mod: Any = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_aux: Any = None,
    kernel_options: Any = None,
) -> tuple[torch.Tensor, Any]:
    """``flex_attention`` computed densely (patch 3): the block mask's ``mask_mod``
    materialized, then softmax attention in fp32; returns ``(out, AuxOutput)``."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    assert score_mod is None, "the dense stand-in takes no score_mod"
    b, hq, lq, e = q.shape
    if enable_gqa and k.shape[1] != hq:
        k = k.repeat_interleave(hq // k.shape[1], dim=1)
        v = v.repeat_interleave(hq // v.shape[1], dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * (e**-0.5 if scale is None else scale)
    if block_mask is not None:
        mask = create_mask(block_mask.mask_mod, b, 1, lq, k.shape[2], device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)
    want_lse = return_aux is not None and getattr(return_aux, "lse", False)
    return out, AuxOutput(lse=lse if want_lse else None)


_TORCH_PROBES = (  # torch modules that look for triton when imported: before the stand-in
    "torch._dynamo",
    "torch._inductor",
    "torch._inductor.runtime.hints",
    "torch._inductor.runtime.triton_compat",
    "torch._inductor.codecache",
    "torch._functorch.aot_autograd",
    "torch.distributed.pipelining",
    "functorch.compile",
)


def load() -> None:
    """Import torchtitan (trainer, llama3) for the CPU, once per process (patches 1-4)."""
    if _LOADED:
        return
    for name in _TORCH_PROBES:
        importlib.import_module(name)
    import torch._utils as tu

    triton = _triton_stand_ins() if importlib.util.find_spec("triton") is None else {}
    stand_ins = {**triton, **_lean_stand_ins()}
    device_type, device_module = tu._get_available_device_type, tu._get_device_module
    tu._get_available_device_type = lambda: "cpu"
    tu._get_device_module = lambda t: _CPU_DEVICE if t == "cpu" else device_module(t)
    sys.modules.update(stand_ins)
    try:
        for name in (
            "torchtitan.tools.utils",
            "torchtitan.trainer",
            "torchtitan.models.llama3",
            "torchtitan.models.llama3.config_registry",
        ):
            importlib.import_module(name)
    finally:
        tu._get_available_device_type, tu._get_device_module = device_type, device_module
        for name, mod in stand_ins.items():
            if sys.modules.get(name) is mod:
                del sys.modules[name]
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention
    from torchtitan.tools import utils

    assert utils.device_type == "cpu", utils.device_type
    attention.FlexAttention._compiled_flex_attn = dense_flex_attention
    attention._compiled_create_block_mask = create_block_mask
    _sum_reduction_for_torch()
    _LOADED.append(True)


def _sum_reduction_for_torch() -> None:
    """Patch 4: torch's FSDP2 modules reduce with SUM where torchtitan asks for a divide
    factor of 1 (gloo has no PREMUL_SUM)."""
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule as TorchFSDPModule

    disable = tt_fsdp.disable_fsdp_gradient_division

    def disable_fsdp_gradient_division(model: nn.Module) -> None:
        disable(model)
        for m in model.modules():
            if isinstance(m, TorchFSDPModule) and type(m).__module__ != "fsdp2._core.front.module":
                m.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division


# ---- synthetic components --------------------------------------------------------------

_COMPONENTS: dict[str, Any] = {}


def _components() -> tuple[Any, Any]:
    """The synthetic tokenizer and dataloader classes (torchtitan Configurables, so defined
    once torchtitan is loaded)."""
    if _COMPONENTS:
        return _COMPONENTS["tokenizer"], _COMPONENTS["dataloader"]
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.components.tokenizer import BaseTokenizer

    class SyntheticTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = VOCAB

        def __init__(self, config: Any = None, *, tokenizer_path: str = "") -> None:
            super().__init__()
            self.n = VOCAB if config is None else config.vocab_size
            self.eos_id = 1

        def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
            return [ord(c) % self.n for c in text]

        def decode(self, ids: list[int], *args: Any, **kwargs: Any) -> str:
            return "".join(chr(i) for i in ids)

        def get_vocab_size(self) -> int:
            return self.n

    class SyntheticDataset(IterableDataset, Stateful):
        """Each step's global batch is ``micro_batches`` micro-batches of ``MICRO_BATCH``
        sequences; data-parallel rank ``r`` of ``W`` yields micro-batches ``r*k`` to
        ``r*k + k - 1`` (``k = micro_batches / W``), so runs at different ``W`` see the same
        global batch, as the deterministic mode needs. A sequence is documents of random
        length (positions restart per document: block-causal masks) of the learnable stream
        ``x[t+1] = (a*x[t] + 3) % V``; a micro-batch-dependent share of labels is
        ``IGNORE_INDEX``, so ranks hold different valid-token counts (the global valid-token
        loss normalization matters)."""

        def __init__(self, seq_len: int, dp_rank: int, dp_world: int, micro_batches: int) -> None:
            assert micro_batches % dp_world == 0, (micro_batches, dp_world)
            self.seq_len, self.rank = seq_len, dp_rank
            self.k = micro_batches // dp_world
            self.idx = 0

        def _sample(self, n: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
            per_step = self.k * MICRO_BATCH
            step, within = divmod(n, per_step)
            micro = self.rank * self.k + within // MICRO_BATCH  # its index in the global batch
            g = torch.Generator().manual_seed((1000 * step + micro) * 100 + within % MICRO_BATCH)
            ids: list[int] = []
            pos: list[int] = []
            while len(ids) < self.seq_len + 1:
                length = int(torch.randint(4, self.seq_len // 2, (1,), generator=g))
                a = int(torch.randint(1, 7, (1,), generator=g))
                x = int(torch.randint(0, VOCAB, (1,), generator=g))
                for p in range(length):
                    ids.append(x)
                    pos.append(p)
                    x = (a * x + 3) % VOCAB
            tokens = torch.tensor(ids[: self.seq_len + 1])
            labels = tokens[1:].clone()
            labels[torch.rand(self.seq_len, generator=g) < 0.1 * (1 + micro % 3)] = IGNORE_INDEX
            return {"input": tokens[:-1].clone(), "positions": torch.tensor(pos[: self.seq_len])}, (
                labels
            )

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            while True:
                sample = self._sample(self.idx)
                self.idx += 1
                yield sample

        def state_dict(self) -> dict[str, int]:
            return {"idx": self.idx}

        def load_state_dict(self, state_dict: dict[str, int]) -> None:
            self.idx = state_dict["idx"]

    class SyntheticDataLoader(ParallelAwareDataloader):
        @dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):
            dataset: str = "synthetic"
            micro_batches: int = 4
            """micro-batches of ``MICRO_BATCH`` sequences in a step's global batch"""

        def __init__(
            self,
            config: Any,
            *,
            dp_world_size: int,
            dp_rank: int,
            tokenizer: Any,
            seq_len: int,
            local_batch_size: int,
            snapshot_every_n_steps: int | None = 1,
            **kwargs: Any,
        ) -> None:
            assert local_batch_size == MICRO_BATCH, local_batch_size
            dataset = SyntheticDataset(seq_len, dp_rank, dp_world_size, config.micro_batches)
            super().__init__(
                dataset,
                dp_rank=dp_rank,
                dp_world_size=dp_world_size,
                num_workers=0,
                batch_size=local_batch_size,
                snapshot_every_n_steps=snapshot_every_n_steps,
            )

    _COMPONENTS.update(tokenizer=SyntheticTokenizer, dataloader=SyntheticDataLoader)
    return SyntheticTokenizer, SyntheticDataLoader


# ---- a run --------------------------------------------------------------------------------


def trainer_config(
    dump_folder: str,
    *,
    steps: int,
    micro_batches: int,
    seq_len: int = 32,
    replicate: int = 1,
    checkpoint_at: int | None = None,
    load_step: int = -1,
    loss_chunks: int | None = None,
    max_norm: float = 0.5,
) -> Any:
    """torchtitan's ``llama3_debugmodel`` (dim 256, vocab 2048) cut to 2 layers, on the
    synthetic data: a global batch of ``micro_batches`` micro-batches of ``MICRO_BATCH``
    sequences (``training.global_batch_size``; the accumulation count is that over the
    data-parallel degree), AdamW (torchtitan's fused default), clipping at ``max_norm``
    (0.5 is below the gradient norms here: it acts). ``replicate`` > 1: HSDP
    (``parallelism.data_parallel_replicate_degree``). ``checkpoint_at``: DCP checkpoints
    (full state) every that many steps; ``load_step``: the step a new ``Trainer`` resumes
    from; ``loss_chunks``: the chunks of torchtitan's chunked loss (``loss.num_chunks``, 8 by
    default)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    tokenizer, dataloader = _components()
    cfg = llama3_debugmodel()
    model = cfg.model_spec.model
    model.layers = model.layers[:2]
    assert model.vocab_size == VOCAB, model.vocab_size
    cfg.dump_folder = dump_folder
    cfg.tokenizer = tokenizer.Config(vocab_size=VOCAB)
    cfg.dataloader = dataloader.Config(micro_batches=micro_batches)
    t = cfg.training
    t.local_batch_size = MICRO_BATCH
    t.global_batch_size = MICRO_BATCH * micro_batches
    t.seq_len = seq_len
    t.steps = steps
    t.max_norm = max_norm
    t.disable_cuda_graphs = True
    cfg.parallelism.spmd_backend = "partial_dtensor"
    cfg.parallelism.data_parallel_replicate_degree = replicate
    if loss_chunks is not None:
        cfg.loss.num_chunks = loss_chunks
    cfg.validator.enable = False
    cfg.metrics.log_freq = 1
    cfg.checkpoint.enable = checkpoint_at is not None or load_step > 0
    cfg.checkpoint.interval = checkpoint_at or steps
    cfg.checkpoint.last_save_model_only = False
    cfg.checkpoint.load_step = load_step
    cfg.debug.seed = 0
    cfg.comm.trace_buf_size = 0
    cfg.comm.init_timeout_seconds = 600
    # set on the default group after step 1: torch's default, as the harness made it
    cfg.comm.train_timeout_seconds = int(dist.default_pg_timeout.total_seconds())
    return cfg


def _global_init(model: nn.Module) -> None:
    """Parameters drawn whole, by name, from one seed (norm weights one): the same values at
    every world size. torchtitan's ``init_weights`` on a CPU mesh draws each rank's shard
    from the same RNG state (DTensor's RNG tracker is off there), so its values depend on the
    sharding."""
    with torch.no_grad():
        for i, (_, p) in enumerate(sorted(model.named_parameters())):
            assert isinstance(p, DTensor)
            g = torch.Generator().manual_seed(i)
            full = (
                torch.ones(p.shape)
                if p.dim() == 1
                else torch.randn(p.shape, generator=g).mul_(0.02).to(p.dtype)
            )
            p.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None))


def train(
    cfg: Any,
    *,
    stop_at: int | None = None,
    global_init: bool = False,
    check: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Build a ``Trainer`` from ``cfg`` and train it (resuming from its checkpoint if
    ``cfg.checkpoint.load_step`` is set), stopping after step ``stop_at`` if given (the same
    LR schedule as the full run). ``global_init``: ``_global_init`` before training (runs
    compared across world sizes); ``check(trainer)``: called once it is built.

    Returns ``steps`` (``(step, loss, grad_norm)`` as torchtitan logs them), ``micro_losses``
    (every micro-batch's loss by its index in the global batch, gathered from the ranks) and
    ``params`` (full parameters after training, by name)."""
    logged: list[tuple[int, float, float]] = []
    micro: list[float] = []
    collecting = gc.isenabled()  # torchtitan's Trainer turns Python's gc off
    trainer = cfg.build()
    try:
        if check is not None:
            check(trainer)
        if global_init:
            _global_init(trainer.model_parts[0])
        if stop_at is not None:
            trainer.should_continue_training = lambda: trainer.step < stop_at
        log = trainer.metrics_processor.log

        def record_log(step: int, loss: float, max_loss: float, grad_norm: float, **kw: Any) -> Any:
            logged.append((step, float(loss), float(grad_norm)))
            return log(step, loss, max_loss, grad_norm, **kw)

        loss_fn = trainer.loss_fn

        def record_loss(*args: Any, **kwargs: Any) -> Any:
            out = loss_fn(*args, **kwargs)
            micro.append(float(out[0].detach()))
            return out

        trainer.metrics_processor.log = record_log
        trainer.loss_fn = record_loss
        had_timeout = hasattr(dist, "set_timeout")
        if not had_timeout:  # patch 5
            dist.set_timeout = dist.distributed_c10d._set_pg_timeout
        tt_trainer = sys.modules["torchtitan.trainer"]
        tt_trainer.time = _NO_SLEEP  # patch 6
        try:
            trainer.train()
        finally:
            tt_trainer.time = time
            if not had_timeout:
                del dist.set_timeout
        model = trainer.model_parts[0]
        params = {n: p.full_tensor() for n, p in model.named_parameters()}
    finally:
        trainer.close()
        if collecting:
            gc.enable()
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, micro)
    return {
        "steps": logged,
        "micro_losses": _in_global_order(per_rank, trainer),
        "params": params,
        "accumulation": trainer.gradient_accumulation_steps,
        "optimizers": [type(o).__name__ for o in trainer.optimizers],
    }


def _in_global_order(per_rank: list[list[float]], trainer: Any) -> list[float]:
    """Every micro-batch's loss by (step, index in the global batch): the ranks of the
    ``batch`` mesh hold consecutive micro-batches (others, e.g. a replica's copy, repeat)."""
    dims = trainer.parallel_dims
    if not dims.dp_enabled:
        return per_rank[0]
    mesh = dims.get_mesh("batch")
    ranks = mesh.mesh.flatten().tolist()  # global ranks in batch-rank order
    k = trainer.gradient_accumulation_steps
    steps = len(per_rank[ranks[0]]) // k
    return [per_rank[r][s * k + j] for s in range(steps) for r in ranks for j in range(k)]
