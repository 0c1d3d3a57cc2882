"""The framework seams where fsdp2's modes apply ([Note: modes in frameworks] in _modes.py).

``SEAMS`` maps a framework module to ``(class name or "", attribute, make)``: ``make(original)``
returns the patched function, which does what ``original`` does plus the modes. Each one acts
only while a mode is on; a framework this table does not know is untouched.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn as nn

from fsdp2.integrations import _modes, _torchtitan

__all__ = ["SEAMS", "install", "uninstall"]


# ---- accelerate (and the HF Trainer, which prepares through it) -------------------------


def _accelerate_prepare_fsdp2(original: Callable[..., Any]) -> Callable[..., Any]:
    def _prepare_fsdp2(self: Any, *args: Any) -> Any:
        result = original(self, *args)
        for obj in result:
            if isinstance(obj, nn.Module):
                _modes.apply_to_model(obj)
                steps = self.gradient_accumulation_steps
                _modes.check_setup(obj, steps, "gradient_accumulation_steps")
        from accelerate.optimizer import (  # type: ignore[import-untyped]
            AcceleratedOptimizer,
            patch_optimizer_step,
        )

        for obj in result:
            if not isinstance(obj, AcceleratedOptimizer):
                continue
            wrapped = _modes.wrap_optimizer(obj.optimizer)
            if wrapped is obj.optimizer:
                continue
            obj.optimizer = wrapped
            if obj.scaler is not None:  # accelerate steps through these with a GradScaler
                obj._optimizer_original_step_method = wrapped.step
                obj._optimizer_patched_step_method = patch_optimizer_step(obj, wrapped.step)
        return result

    return _prepare_fsdp2


def _accelerate_clip(original: Callable[..., Any]) -> Callable[..., Any]:
    def clip_grad_norm_(self: Any, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        params = list(parameters)
        if not _modes.deterministic_covers(params):
            return original(self, params, max_norm, norm_type)
        self.unscale_gradients()
        return _modes.exact_clip(params, max_norm, norm_type)

    return clip_grad_norm_


def _trainer_prepare(original: Callable[..., Any]) -> Callable[..., Any]:
    def _prepare_for_training(self: Any, *args: Any, **kwargs: Any) -> Any:
        # the Trainer accumulates itself and gives its Accelerator a count of 1, the one
        # _prepare_fsdp2 checks: check the Trainer's own, before anything is prepared
        steps = self.args.gradient_accumulation_steps
        _modes.check_setup(self.model, steps, "gradient_accumulation_steps")
        return original(self, *args, **kwargs)

    return _prepare_for_training


# ---- Lightning: the Trainer's strategies and precision plugin, and Fabric ------------------


def _lightning_setup_optimizers(original: Callable[..., Any]) -> Callable[..., Any]:
    def setup_optimizers(self: Any, trainer: Any) -> None:
        original(self, trainer)
        model = self.lightning_module
        _modes.apply_to_model(model)
        _modes.check_setup(model, trainer.accumulate_grad_batches, "accumulate_grad_batches")
        optimizers = [_modes.wrap_optimizer(o) for o in self.optimizers]
        if any(a is not b for a, b in zip(optimizers, self.optimizers, strict=True)):
            self.optimizers = optimizers

    return setup_optimizers


def _lightning_block_sync(original: Callable[..., Any]) -> Callable[..., Any]:
    @contextmanager
    def block_backward_sync(self: Any) -> Iterator[None]:
        """Under the deterministic mode the accumulating micro-batches skip the gradient
        reduction (one reduction per optimizer step, as the mode needs); else Lightning's."""
        modules = _modes.deterministic_modules(self.model)
        if not modules:
            with original(self):
                yield
            return
        for m in modules:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for m in modules:
                m.set_requires_gradient_sync(True, recurse=False)

    return block_backward_sync


def _lightning_clip_by_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    def clip_grad_by_norm(self: Any, optimizer: Any, clip_val: float) -> None:
        params = list(self.main_params(optimizer))
        if not _modes.deterministic_covers(params):
            return original(self, optimizer, clip_val)  # type: ignore[no-any-return]
        _modes.exact_clip(params, clip_val)
        return None

    return clip_grad_by_norm


def _fabric_setup_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
    def setup_optimizer(self: Any, optimizer: Any) -> Any:
        return original(self, _modes.wrap_optimizer(optimizer))

    return setup_optimizer


def _fabric_clip(original: Callable[..., Any]) -> Callable[..., Any]:
    def clip_gradients_norm(
        self: Any,
        module: Any,
        optimizer: Any,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Any:
        params = list(self.precision.main_params(optimizer))
        if not _modes.deterministic_covers(params):
            return original(self, module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self.precision.unscale_gradients(optimizer)
        return _modes.exact_clip(params, max_norm, norm_type, error_if_nonfinite)

    return clip_gradients_norm


SEAMS: dict[str, list[tuple[str, str, Callable[[Any], Any]]]] = {
    "accelerate.accelerator": [
        ("Accelerator", "_prepare_fsdp2", _accelerate_prepare_fsdp2),
        ("Accelerator", "clip_grad_norm_", _accelerate_clip),
    ],
    "transformers.trainer": [
        ("Trainer", "_prepare_for_training", _trainer_prepare),
    ],
    "lightning.pytorch.strategies.strategy": [
        ("Strategy", "setup_optimizers", _lightning_setup_optimizers),
    ],
    "lightning.pytorch.strategies.parallel": [
        ("ParallelStrategy", "block_backward_sync", _lightning_block_sync),
    ],
    "lightning.pytorch.plugins.precision.precision": [
        ("Precision", "clip_grad_by_norm", _lightning_clip_by_norm),
    ],
    "lightning.fabric.strategies.strategy": [
        ("Strategy", "setup_optimizer", _fabric_setup_optimizer),
        ("Strategy", "clip_gradients_norm", _fabric_clip),
    ],
}


SEAMS.update(_torchtitan.SEAMS)  # torchtitan's own (its container, Trainer and clipping)

_PATCHED: list[tuple[Any, str, Any]] = []  # (class or module, attribute, original)


def _patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    original = getattr(owner, name, None)
    if original is None or getattr(original, "_fsdp2_modes", False):
        return
    patched = make(original)
    functools.update_wrapper(patched, original)
    patched._fsdp2_modes = True
    setattr(owner, name, patched)
    _PATCHED.append((owner, name, original))


def _install_module(module: str) -> None:
    mod = sys.modules.get(module)
    if mod is None:
        return
    for cls_name, name, make in SEAMS.get(module, ()):
        owner = getattr(mod, cls_name) if cls_name else mod
        _patch(owner, name, make)


class _SeamLoader(importlib.abc.Loader):
    """A framework module's own loader, then its seams patched (see ``_SeamFinder``)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        if _modes.current().on():
            _install_module(module.__name__)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... (inspect, pkgutil)
        return getattr(self.loader, name)


class _SeamFinder(importlib.abc.MetaPathFinder):
    """Patches a seam's module as it is imported: ``use_fsdp2(mode=...)`` comes first in a
    script, before the framework is imported, and the framework's first ``prepare`` /
    ``fit`` must already pass through the seams."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in SEAMS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _SeamLoader):
                    spec.loader = _SeamLoader(spec.loader)
                return spec
        return None


_FINDER = _SeamFinder()


def install() -> None:
    """Patch the seams of the frameworks already imported, and of those imported later
    (an import hook), while a mode is on (idempotent; called by ``use_fsdp2`` and at each
    switched ``fully_shard``)."""
    if not _modes.current().on():
        return
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    for module in SEAMS:
        _install_module(module)


def uninstall() -> None:
    """Put every patched seam back, and stop patching imports."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    while _PATCHED:
        owner, name, original = _PATCHED.pop()
        setattr(owner, name, original)
