"""The switch that points torch's FSDP2 names at fsdp2 (see [Note: the switch])."""

from __future__ import annotations

import enum
import functools
import importlib
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
import torch.nn as nn

import fsdp2
from fsdp2.integrations import _frameworks, _modes, pipelining
from fsdp2.integrations._modes import Modes

__all__ = ["current_modes", "is_using_fsdp2", "restore_torch_fsdp", "use_fsdp2", "using_fsdp2"]

# [Note: the switch]
# Frameworks (accelerate, the HF Trainer, transformers, Lightning, torchtitan) import torch's
# FSDP2 names from its two public modules, either when they load or inside the function that
# shards. ``use_fsdp2`` replaces these names there by bridges and, in every module already
# imported (outside torch and fsdp2) that copied one of torch's objects under the same name,
# by the same bridge; modules imported later copy the bridges from torch's modules.
# * ``fully_shard``: fsdp2's, refusing a tree torch's ``fully_shard`` already sharded;
# * ``register_fsdp_forward_method``: torch's for torch's modules, fsdp2's otherwise (each
#   engine's silently does nothing for the other's modules);
# * ``replicate``: fsdp2's, refusing a tree torch's engine already sharded, like ``fully_shard``;
# * ``FSDPModule``, ``ReplicateModule`` and the three policies: classes whose ``isinstance``
#   / ``issubclass`` accept either engine's class (a framework checks a model it built before
#   the switch, or a plugin holding torch's policy objects) and whose call builds fsdp2's
#   object. The bridge
#   ``FSDPModule`` subclasses fsdp2's, so its methods (``unshard``, ``reshard``,
#   ``set_requires_gradient_sync``) are fsdp2's; torch's modules have the same names.
# * torch main's ``cpu_offload_by_budget`` (a function calling fsdp2's) and
#   ``GradientReductionHandle`` (a bridge class) in ``torch.distributed.fsdp``: names torch
#   2.11-2.14 lack (``_MAIN_NAMES``). Where torch lacks one, the switch adds it there and
#   ``restore_torch_fsdp`` removes it again, so code written for torch main (or checking
#   for the name) finds fsdp2's, as it finds torch main's fields on the switched policies;
#   where torch has one, it is switched as the names above.
# fsdp2's ``fully_shard`` also reads torch's policy objects by field, so a plugin built before
# the switch works. ``restore_torch_fsdp`` puts torch's objects back wherever a bridge is
# (only bridges: a module that imported fsdp2's names from fsdp2 keeps them). Torch's own
# modules are left alone: torch's engine keeps working on its modules meanwhile.

_NAMES = (
    "fully_shard",
    "FSDPModule",
    "register_fsdp_forward_method",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "replicate",
    "ReplicateModule",
)
# torch main's names fsdp2 has that torch 2.11-2.14 lack: put in torch's public module whether
# torch has them or not (see above)
_MAIN_NAMES = ("cpu_offload_by_budget", "GradientReductionHandle")
# torch's public FSDP2 modules, spelled in parts (fsdp2 names no torch FSDP module literally).
_TORCH = ".".join(("torch", "distributed"))
_TORCH_MODULES = (
    f"{_TORCH}.fsdp",
    f"{_TORCH}._{'composable'}.fsdp",
    f"{_TORCH}._{'composable'}.fsdp.fully_shard",
)
# torch's ``replicate`` on the FSDP2 engine, and its module class, live in a module of their own
# (not the older DDP-based ``replicate`` of ``torch.distributed._composable.replicate``)
_REPLICATE_MODULE = f"{_TORCH}._{'composable'}.replicate_with_fsdp"
_REPLICATE_NAMES = ("replicate", "ReplicateModule")


class _Either(type):
    """Metaclass of the bridge classes: instances and subclasses of any of ``engines``
    (fsdp2's class first) pass ``isinstance`` / ``issubclass``; calling the bridge builds
    fsdp2's object."""

    engines: tuple[type, ...]

    def __instancecheck__(cls, obj: object) -> bool:
        return any(isinstance(obj, c) for c in cls.engines)

    def __subclasscheck__(cls, sub: type) -> bool:
        return any(issubclass(sub, c) for c in cls.engines)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if "engines" in cls.__dict__:  # the bridge itself, not a user's subclass of it
            return cls.engines[0](*args, **kwargs)
        return super().__call__(*args, **kwargs)


def _bridge_class(ours: type, theirs: type | None) -> type:
    doc = (
        f"fsdp2's ``{ours.__name__}`` standing in for torch's (fsdp2.integrations.use_fsdp2): "
        f"``isinstance`` accepts either engine's; calling it builds fsdp2's.\n\n{ours.__doc__}"
    )
    engines = (ours,) if theirs is None else (ours, theirs)  # (a torch without the class)
    attrs = {"engines": engines, "__module__": __name__, "__doc__": doc}
    return _Either(ours.__name__, (ours,), attrs)


def _bridges(torch_objects: dict[str, Any]) -> dict[str, Any]:
    torch_module_cls = torch_objects["FSDPModule"]
    torch_register = torch_objects["register_fsdp_forward_method"]

    def _torch_sharded(module: object) -> Iterator[str]:
        roots = [module] if isinstance(module, nn.Module) else module
        for root in roots if isinstance(roots, (list, tuple)) else ():
            if not isinstance(root, nn.Module):
                continue  # fsdp2's fully_shard says what is wrong with it
            for name, m in root.named_modules():
                if isinstance(m, torch_module_cls):
                    yield f"{type(root).__name__}{'.' + name if name else ''}"

    def refusing_torch_models(ours: Any, torch_api: str, theirs: Any) -> Any:
        """``ours`` (fsdp2's ``fully_shard`` / ``replicate``), refusing a tree part of which
        torch's engine already manages; ``theirs.state`` (torch's ``fully_shard.state(m)``,
        which torch's own code calls on its modules) stays reachable through it."""

        @functools.wraps(ours)
        def bridge(module: Any, *args: Any, **kwargs: Any) -> Any:
            done = list(_torch_sharded(module))
            if done:
                raise RuntimeError(
                    f"{ours.__name__}: {done[0]} was sharded by torch's {torch_api}, before "
                    "fsdp2.integrations.use_fsdp2() was called; one model cannot mix the two "
                    "engines. Call use_fsdp2() before the model (or the framework) is sharded"
                )
            out = ours(module, *args, **kwargs)
            if _modes.current().on():  # [Note: modes in frameworks] in _modes.py
                _modes.apply_to_model(module)
                _frameworks.install()  # a framework imported since use_fsdp2 is here now
            return out

        if hasattr(theirs, "state"):  # a torch module that copied the bridge still finds it
            bridge.state = theirs.state  # type: ignore[attr-defined]
        return bridge

    @functools.wraps(fsdp2.register_fsdp_forward_method)
    def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
        if isinstance(module, torch_module_cls):
            torch_register(module, method_name)
        else:
            fsdp2.register_fsdp_forward_method(module, method_name)

    out: dict[str, Any] = {
        "fully_shard": refusing_torch_models(
            fsdp2.fully_shard, "fully_shard", torch_objects["fully_shard"]
        ),
        "register_fsdp_forward_method": register_fsdp_forward_method,
        "replicate": refusing_torch_models(
            fsdp2.replicate, "fully_shard or replicate", torch_objects["replicate"]
        ),
    }
    for name in (
        "FSDPModule",
        "MixedPrecisionPolicy",
        "OffloadPolicy",
        "CPUOffloadPolicy",
        "ReplicateModule",
    ):
        out[name] = _bridge_class(getattr(fsdp2, name), torch_objects[name])

    # torch main's names (_MAIN_NAMES): objects of their own, so that restoring leaves a
    # module that imported fsdp2's from fsdp2 alone
    @functools.wraps(fsdp2.cpu_offload_by_budget)
    def cpu_offload_by_budget(module: nn.Module, budget_bytes: int, **kwargs: Any) -> Any:
        return fsdp2.cpu_offload_by_budget(module, budget_bytes, **kwargs)

    out["cpu_offload_by_budget"] = cpu_offload_by_budget
    out["GradientReductionHandle"] = _bridge_class(
        fsdp2.GradientReductionHandle, torch_objects.get("GradientReductionHandle")
    )
    return out


class _Switch:
    """The process-wide switch: torch's objects, their bridges, and where bridges are."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.active = False
        self.torch_objects: dict[str, Any] = {}
        self.bridges: dict[str, Any] = {}
        self.enabled_pipelining = False  # turn_on enabled fsdp2.integrations.pipelining

    def torch_modules(self) -> list[ModuleType]:
        mods = []
        for name in (*_TORCH_MODULES, _REPLICATE_MODULE):
            try:
                mods.append(importlib.import_module(name))
            except ImportError:  # a torch without the private alias
                continue
        return mods

    def turn_on(self) -> None:
        mods = self.torch_modules()
        if not self.bridges:
            public = mods[0]
            home = {n: public for n in _NAMES}
            rep_mod = sys.modules.get(_REPLICATE_MODULE)
            for n in _REPLICATE_NAMES:
                home[n] = rep_mod  # type: ignore[assignment]
            missing = [n for n in _NAMES if not hasattr(home[n], n)]
            if missing:
                raise RuntimeError(
                    f"fsdp2.integrations.use_fsdp2: torch {public.__name__} lacks {missing}; "
                    "this torch is not one fsdp2 supports"
                )
            self.torch_objects = {n: getattr(home[n], n) for n in _NAMES}
            # torch main's names where this torch has them (else added while on)
            self.torch_objects |= {n: getattr(public, n) for n in _MAIN_NAMES if hasattr(public, n)}
            if any(self.torch_objects.get(n) is fsdp2_obj for n, fsdp2_obj in self._ours()):
                raise RuntimeError(
                    "fsdp2.integrations.use_fsdp2: torch's FSDP2 names already point at fsdp2's "
                    "objects (patched by hand?); undo that patch and call use_fsdp2() instead"
                )
            self.bridges = _bridges(self.torch_objects)
        for mod in mods:  # torch's public modules: every name they hold
            for name in _names_in(mod.__name__):
                if name in vars(mod):
                    setattr(mod, name, self.bridges[name])
        for name in _MAIN_NAMES:  # torch main's names, added where this torch lacks them
            setattr(mods[0], name, self.bridges[name])
        self._replace(self.torch_objects, self.bridges)
        if not pipelining.is_enabled():  # torch's pipeline schedules run fsdp2's stages
            pipelining.enable()
            self.enabled_pipelining = True
        self.active = True

    def turn_off(self) -> None:
        for mod in self.torch_modules():
            for name in _names_in(mod.__name__):
                if vars(mod).get(name) is not self.bridges.get(name):
                    continue
                if name in self.torch_objects:
                    setattr(mod, name, self.torch_objects[name])
                else:  # a torch main name this torch lacks: added by turn_on
                    delattr(mod, name)
        # torch's own modules too: one imported while the switch was on (torch's pipelining,
        # imported by a framework) copied a bridge from torch's public module
        self._replace(self.bridges, self.torch_objects, include_torch=True)
        if self.enabled_pipelining:
            pipelining.disable()
            self.enabled_pipelining = False
        self.active = False

    def _ours(self) -> Iterator[tuple[str, Any]]:
        for name in (*_NAMES, *_MAIN_NAMES):
            yield name, getattr(fsdp2, name)

    @staticmethod
    def _replace(old: dict[str, Any], new: dict[str, Any], include_torch: bool = False) -> None:
        """In every loaded module outside torch and fsdp2 (and torch's with
        ``include_torch``), a global ``name`` that is ``old[name]`` becomes ``new[name]``."""
        for mod_name, mod in list(sys.modules.items()):
            ours = mod_name in _TORCH_MODULES or mod_name == _REPLICATE_MODULE
            top = mod_name.split(".")[0]
            if (top == "fsdp2" or (top == "torch" and not include_torch)) and not ours:
                continue
            d = getattr(mod, "__dict__", None)
            if not isinstance(d, dict):
                continue
            for name in _names_in(mod_name):
                # (a torch main name this torch lacks has nothing to replace or put back)
                if name in old and name in new and d.get(name) is old[name]:
                    d[name] = new[name]


def _names_in(mod_name: str) -> tuple[str, ...]:
    """The names the switch replaces in module ``mod_name``: in torch's replicate module only
    its own two (its other globals are torch's engine at work), everywhere else all."""
    if mod_name == _REPLICATE_MODULE:
        return _REPLICATE_NAMES
    if mod_name in _TORCH_MODULES:
        return tuple(n for n in (*_NAMES, *_MAIN_NAMES) if n not in _REPLICATE_NAMES)
    return (*_NAMES, *_MAIN_NAMES)


_SWITCH = _Switch()


class _Keep(enum.Enum):
    """A mode ``use_fsdp2`` was not asked to change."""

    KEEP = "keep"


_KEEP = _Keep.KEEP


def use_fsdp2(
    *,
    deterministic: bool | _Keep = _KEEP,
    exchange_reduce: torch.dtype | None | _Keep = _KEEP,
    shard_over_replicas: bool | _Keep = _KEEP,
    elementwise: bool | _Keep = _KEEP,
) -> None:
    """Make code written for torch's FSDP2 use fsdp2: point ``fully_shard``, ``FSDPModule``,
    ``register_fsdp_forward_method``, ``MixedPrecisionPolicy``, ``OffloadPolicy`` and
    ``CPUOffloadPolicy`` in torch's FSDP modules, ``replicate`` and ``ReplicateModule`` in
    ``torch.distributed._composable.replicate_with_fsdp``, and the same names in
    already-imported modules that copied them (accelerate's, transformers', Lightning's, a
    training script's), at fsdp2; put torch main's ``cpu_offload_by_budget`` and
    ``GradientReductionHandle`` in ``torch.distributed.fsdp`` (added while the switch is on
    where torch lacks them, as 2.11-2.14 do); and make ``torch.distributed.pipelining``'s
    schedules run fsdp2's stages (:func:`fsdp2.integrations.pipelining.enable`).

    Call it once, early: before a framework shards a model (before ``Accelerator.prepare``,
    ``Trainer.train``, ``from_pretrained(..., distributed_config=...)``, ``Fabric.setup``).
    Policy objects a framework built from torch's classes before the call are read by field;
    ``isinstance(m, FSDPModule)`` holds for modules of either engine afterwards. Not a
    wrapper around torch's engine: models sharded by the switched names are fsdp2's
    (``fsdp2.set_debug``, ``fsdp2.timeline``, bucketing and ``fsdp2.checkpoint`` apply).

    The keywords turn on fsdp2's modes for the models the framework shards, through its own
    loop (its optimizer, accumulation, clipping and checkpoints; docs/frameworks.md):

    Args:
        deterministic: ``fsdp2.reduction.set_deterministic`` on every module sharded; the
            framework's clipping takes ``fsdp2.reduction.clip_grad_norm_`` (the same bits at
            every world size), its accumulating micro-batches skip the reduction, and an
            accumulation count or world size that is not a power of two raises
            ``ValueError`` naming the setting, before any collective.
        exchange_reduce: a wire dtype (``torch.bfloat16``, ``torch.float8_e4m3fn``, ...):
            ``fsdp2.reduction.set_exchange_reduce`` on every module sharded; ``None`` turns
            it off.
        shard_over_replicas: the framework's optimizer wrapped by
            ``fsdp2.replica_optim.shard_over_replicas`` once built (HSDP modules only).
        elementwise: ``shard_over_replicas``'s argument of that name.

    A keyword left out keeps its mode as it is (all off at first; :func:`current_modes`).
    Idempotent: a second call only catches modules imported since the first. Thread-safe
    (one lock); undone by :func:`restore_torch_fsdp` (modes included). Importing fsdp2
    changes nothing: only this call does.

    Raises:
        RuntimeError: torch's FSDP modules lack one of the names, or already hold fsdp2's
            objects put there by hand. Sharding (with the switched ``fully_shard``) a model
            part of which torch's ``fully_shard`` sharded before the call raises too.
        ValueError: modes fsdp2 cannot combine (``deterministic`` with ``exchange_reduce``
            or ``shard_over_replicas``), or an unknown wire dtype; nothing changes then.
    """
    changes = {
        k: v
        for k, v in (
            ("deterministic", deterministic),
            ("exchange_reduce", exchange_reduce),
            ("shard_over_replicas", shard_over_replicas),
            ("elementwise", elementwise),
        )
        if v is not _KEEP
    }
    with _SWITCH.lock:
        _modes.set_modes(**changes)
        _SWITCH.turn_on()
        _frameworks.install()


def current_modes() -> Modes:
    """The modes :func:`use_fsdp2` turned on (a frozen ``Modes``: ``deterministic``,
    ``exchange_reduce``, ``shard_over_replicas``, ``elementwise``)."""
    return _modes.current()


def restore_torch_fsdp() -> None:
    """Undo :func:`use_fsdp2`: torch's objects go back wherever the switch put fsdp2's
    (torch's modules, modules that copied them, modules imported since), and the pipeline
    schedules' integration if the switch enabled it. Modules already
    sharded by fsdp2 stay fsdp2's. A no-op when the switch is off."""
    with _SWITCH.lock:
        if _SWITCH.active:
            _SWITCH.turn_off()
        _modes.reset()
        _frameworks.uninstall()


def is_using_fsdp2() -> bool:
    """Whether :func:`use_fsdp2` is in effect."""
    return _SWITCH.active


@contextmanager
def using_fsdp2(**modes: Any) -> Iterator[None]:
    """``with using_fsdp2(): ...``: :func:`use_fsdp2` (with the same keywords) for the
    block, undone at its end unless the switch was already on when the block began (the
    modes are put back as they were then; nesting is safe)."""
    with _SWITCH.lock:
        was_on, before = _SWITCH.active, _modes.current()
        use_fsdp2(**modes)
    try:
        yield
    finally:
        if not was_on:
            restore_torch_fsdp()
        else:
            with _SWITCH.lock:
                _modes.set_modes(**vars(before))
                if not before.on():
                    _frameworks.uninstall()
