"""What the framework tests (``test_frameworks_*.py``) share: the tiny Llama they train, its
data, the per-rank environment variables frameworks read, and a run's record.

Each framework test trains the same model twice in one spawned 2-rank run, once with torch's
FSDP2 (the reference) and once under ``fsdp2.integrations.using_fsdp2()``, in the same
framework and setup, and compares the two bitwise (``helpers.check_same_run``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import mine
from models import full_params, hf_llama_config

VOCAB = 128
BATCH, SEQ = 4, 16  # the global batch of one micro-step, split over the ranks
ENGINES = ("torch", "fsdp2")


def llama_config() -> Any:
    return hf_llama_config(VOCAB)


def tiny_llama(seed: int = 0) -> nn.Module:
    """A fresh ``LlamaForCausalLM`` (2 decoder layers, hidden 32), initialised under ``seed``."""
    import transformers
    from transformers import LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config())


def tokens(step: int, *, local: bool = True) -> torch.Tensor:
    """Micro-step ``step``'s global token batch (the same on every rank), or this rank's slice."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return mine(ids) if local else ids


def mean_loss(loss: torch.Tensor) -> float:
    """The rank-averaged value of a local loss."""
    t = loss.detach().float().clone()
    dist.all_reduce(t)
    return (t / dist.get_world_size()).item()


def record(losses: list[float], model: nn.Module) -> dict[str, Any]:
    """A run as ``check_same_run`` compares it: per-step losses, full parameters (collective)."""
    return {"losses": losses, "params": full_params(model)}


@contextlib.contextmanager
def rank_env() -> Iterator[None]:
    """The torchrun variables frameworks read (RANK, WORLD_SIZE, ...) for the block (harness
    workers join the process group without them); every variable set in the block (accelerate
    and its plugin set some, e.g. ``FSDP_CPU_RAM_EFFICIENT_LOADING``) is undone at its end."""
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = dict(os.environ)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
