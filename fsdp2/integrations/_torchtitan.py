"""torchtitan's seams for fsdp2's modes ([Note: modes in frameworks] in _modes.py), in the
format of ``_frameworks.SEAMS``: a framework module mapped to ``(class name or "", attribute,
make)``, ``make(original)`` returning the patched function. Each acts only while a mode is on.

[Note: torchtitan's seams]
torchtitan's ``Trainer`` (0.3.0) builds the model parts, then an ``OptimizersContainer``
over them, accumulates ``training.global_batch_size / (local_batch_size * data-parallel
degree)`` micro-batches per step with a ``forward_backward_step`` each (the model's forward,
``self.loss_fn``, ``loss.backward()``), clips with ``torchtitan.distributed.utils.
clip_grad_norm_`` and checkpoints the container through its flat, FQN-keyed ``state_dict``
(``get_flat_optim_state_dict`` / ``load_flat_optim_state_dict`` over each optimizer's own
``state_dict``). fsdp2 steps in at:

* ``OptimizersContainer.__init__``: the model modes on the parts (sharded by hand too), and
  each optimizer wrapped for ``shard_over_replicas``. A ``ReplicaShardedOptimizer`` shares
  the wrapped optimizer's ``param_groups`` (with torchtitan's ``param_names``) and gives and
  takes the usual state layout, so the container's state dict, torchtitan's
  ``init_optim_state`` (a zero-gradient step: the wrapper cuts a gradient set in the
  parameter's layout into its piece) and DCP checkpoints work unchanged; the LR scheduler is
  built on the container afterwards, so it drives the wrapper. The container, an
  ``Optimizer`` over every parameter that steps through its optimizers, is marked as
  stepping replica-sharded parameters (fsdp2's step check would refuse it otherwise);
* ``Trainer.__init__``, under the deterministic mode: the checks of what torchtitan chose,
  ``ValueError`` naming the setting before any training collective (``_check_trainer``);
* ``Trainer.train_step``, under the deterministic mode, which needs one reduction per
  optimizer step: torchtitan never turns gradient sync off, so each micro-batch would be
  reduced. Its default loss for llama3, ``ChunkedLossWrapper``, runs the lm_head and a
  backward per sequence chunk inside ``loss_fn``, turning sync off on the lm_head's group but
  on for the last chunk and afterwards; each of those backwards ends in fsdp2's final
  callback, which reduces every group whose sync is on. So for the step, the seam holds the
  deterministic modules' sync: off during each micro-batch's ``loss_fn`` (the loss's own
  sync calls ignored), then on for its ``loss.backward()`` on the step's last micro-batch
  only. Each group reduces once, in the last decoder backward. Every chunk's backward is a
  micro-batch to the mode (a leaf of [Note: canonical sum] in fsdp2/_core/comm/exact.py), the
  final norm's one more: ``fully_shard([norm, lm_head])`` sums ``loss.num_chunks + 1`` of
  them per micro-batch, which must be a power of two (1, 3, 7 chunks; checked at init);
* ``clip_grad_norm_``, under the deterministic mode: ``fsdp2.reduction.clip_grad_norm_``,
  whose norm is the same bits at every world size. Under ``shard_over_replicas`` torchtitan's
  own clipping is exact as it is (the gradient pieces are the ``.grad``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fsdp2._core.comm.exact import is_power_of_two
from fsdp2._core.support.unsharded import REPLICA_MARK
from fsdp2.integrations import _modes

__all__ = ["ACCUMULATION", "SEAMS"]

# how torchtitan's Trainer derives its accumulation count (named in the mode's errors)
ACCUMULATION = (
    "gradient_accumulation_steps (training.global_batch_size / "
    "(training.local_batch_size * data-parallel degree))"
)


def _optimizers_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not _modes.current().on():
            return
        _modes.apply_to_model(list(self.model_parts))
        wrapped = [_modes.wrap_optimizer(o) for o in self.optimizers]
        if any(a is not b for a, b in zip(wrapped, self.optimizers, strict=True)):
            self.optimizers = wrapped
            setattr(self, REPLICA_MARK, True)  # steps only through the wrappers

    return __init__


def _trainer_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not _modes.current().deterministic:
            return
        try:
            _check_trainer(self)
        except ValueError:
            self.close()  # built (checkpointer, metrics) but never trained: let go of it
            raise

    return __init__


def _check_trainer(trainer: Any) -> None:
    """Under the deterministic mode: no pipeline or expert parallelism (their gradients are
    not the mode's: docs/reproducibility.md), a power-of-two accumulation count, and a
    chunked loss with a power of two of backwards per micro-batch (see the module's note)."""
    parts = list(trainer.model_parts)
    _modes.apply_to_model(parts)
    dims = trainer.parallel_dims
    for name, on in (("pipeline", dims.pp_enabled), ("expert", dims.ep_enabled)):
        if on:
            raise ValueError(
                f"use_fsdp2(deterministic=True): torchtitan's {name} parallelism is enabled "
                f"(parallelism.{name}_parallel_degree > 1); the deterministic mode does not "
                "cover it (docs/reproducibility.md): turn one of them off"
            )
    _modes.check_setup(parts, trainer.gradient_accumulation_steps, ACCUMULATION)
    loss = trainer.loss_fn
    chunks, lm_head = getattr(loss, "num_chunks", None), getattr(loss, "lm_head", None)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if (
        isinstance(chunks, int)
        and world > 1
        and _modes.deterministic_modules(lm_head)
        and not is_power_of_two(chunks + 1)
    ):
        raise ValueError(
            f"use_fsdp2(deterministic=True): loss.num_chunks={chunks}; torchtitan's chunked "
            "loss runs a backward of the lm_head's fully_shard group per chunk and one more "
            "for the final norm, each a micro-batch to the deterministic reduction, which "
            "sums a power of two of them per rank: set loss.num_chunks to 1, 3, 7, 15, ... "
            "(dividing training.seq_len)"
        )


def _train_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def train_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        modules = [m for part in self.model_parts for m in _modes.deterministic_modules(part)]
        if not modules:
            return original(self, *args, **kwargs)
        steps = self.gradient_accumulation_steps
        calls = 0

        def set_sync(on: bool) -> None:
            for m in modules:
                m.set_requires_gradient_sync(on, recurse=False)

        def forward_backward_step(*a: Any, **kw: Any) -> Any:
            nonlocal calls
            calls += 1
            set_sync(calls >= steps)  # the step's one reduction: its last micro-batch
            return inner_step(*a, **kw)

        def loss_fn(*a: Any, **kw: Any) -> Any:
            set_sync(False)  # backwards inside the loss (a chunked loss's) only accumulate
            for m in modules:
                m.set_requires_gradient_sync = _ignore_sync
            try:
                return inner_loss(*a, **kw)
            finally:
                for m in modules:
                    del m.set_requires_gradient_sync
                set_sync(calls >= steps)

        # bound: a subclass's own, or one set on the trainer (restored afterwards)
        inner_step, inner_loss = self.forward_backward_step, self.loss_fn
        own = {n: vars(self)[n] for n in ("forward_backward_step", "loss_fn") if n in vars(self)}
        self.forward_backward_step, self.loss_fn = forward_backward_step, loss_fn
        try:
            out = original(self, *args, **kwargs)
        finally:
            for name in ("forward_backward_step", "loss_fn"):
                if name in own:
                    setattr(self, name, own[name])
                else:
                    delattr(self, name)
            set_sync(True)
        if calls != steps:
            raise RuntimeError(
                f"use_fsdp2(deterministic=True): torchtitan's train_step ran {calls} "
                f"forward_backward_step calls for gradient_accumulation_steps={steps}; fsdp2 "
                "reduces on the last of one call per micro-batch, so this step's gradients "
                "were not reduced as the mode needs"
            )
        return out

    return train_step


def _ignore_sync(requires_gradient_sync: bool, *, recurse: bool = True) -> None:
    """``set_requires_gradient_sync`` while the deterministic mode holds the sync."""


def _clip_grad_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    def clip_grad_norm_(
        parameters: torch.Tensor | Any,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
        pp_mesh: Any = None,
        ep_enabled: bool = False,
    ) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if not _modes.deterministic_covers(params):
            return original(  # type: ignore[no-any-return]
                params, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_enabled
            )
        if pp_mesh is not None or ep_enabled:
            raise ValueError(
                "use_fsdp2(deterministic=True): torchtitan's clip_grad_norm_ with pipeline "
                "(pp_mesh) or expert (ep_enabled) parallelism; the deterministic mode does "
                "not cover them (docs/reproducibility.md)"
            )
        return _modes.exact_clip(params, max_norm, norm_type, error_if_nonfinite)

    return clip_grad_norm_


SEAMS: dict[str, list[tuple[str, str, Callable[[Any], Any]]]] = {
    "torchtitan.components.optimizer.optimizer": [
        ("OptimizersContainer", "__init__", _optimizers_init),
    ],
    "torchtitan.trainer": [
        ("Trainer", "__init__", _trainer_init),
        ("Trainer", "train_step", _train_step),
    ],
    "torchtitan.distributed.utils": [
        ("", "clip_grad_norm_", _clip_grad_norm),
    ],
}
