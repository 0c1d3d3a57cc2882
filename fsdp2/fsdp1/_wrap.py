"""FSDP1's auto-wrap policies for ``shard_model``: which modules become units and in which
order they are sharded (children first). See the ``auto_wrap_policy`` item of
[Note: FSDP1 mapping] in ``fsdp2/fsdp1/__init__.py``. The core never imports it."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from fsdp2 import FSDPModule


@dataclass(frozen=True)
class _SizeBasedPolicy:
    min_num_params: int

    def __call__(
        self, module: nn.Module, recurse: bool = False, nonwrapped_numel: int | None = None
    ) -> bool:
        if nonwrapped_numel is None:
            nonwrapped_numel = _nonwrapped_numel(module)
        large = nonwrapped_numel >= self.min_num_params
        if recurse:
            return large and not isinstance(module, nn.MultiheadAttention)
        # no forward: fully_shard rejects containers
        return large and not isinstance(module, (nn.ModuleList, nn.ModuleDict))


def size_based_policy(min_num_params: int = int(1e8)) -> Callable[..., bool]:
    """An auto-wrap policy with the selection of FSDP1's ``size_based_auto_wrap_policy``
    (default ``force_leaf_modules`` / ``exclude_wrap_modules``): wrap a module if its subtree
    holds at least ``min_num_params`` parameter elements not in a unit wrapped below it
    (``shard_model`` visits children first); descend only into subtrees of at least that size
    and never into ``nn.MultiheadAttention``. ``nn.ModuleList``/``nn.ModuleDict`` are never
    selected; their parameters count toward the enclosing module. Shared parameters count
    once per subtree. Also callable as ``policy(module)`` (counting what is not wrapped yet)."""
    if not isinstance(min_num_params, int) or min_num_params < 0:
        raise ValueError(
            f"size_based_policy: min_num_params must be an int >= 0, got {min_num_params!r}"
        )
    return _SizeBasedPolicy(min_num_params)


AutoWrapPolicy = set[type[nn.Module]] | frozenset[type[nn.Module]] | Callable[..., object]
_RecursivePolicy = Callable[[nn.Module, bool, int], bool]


def resolve_policy(
    policy: object, model: nn.Module, ignored: set[nn.Module], root_kwargs: dict[str, object]
) -> tuple[dict[nn.Module, dict[str, object]] | None, _RecursivePolicy | None]:
    """Either the units to wrap (module -> overrides of the root's arguments; FSDP1's
    ``_Policy`` objects and sets of classes) or a recursive policy (FSDP1's policy
    functions, called as ``(module, recurse, nonwrapped_numel)``)."""
    if policy is None:
        return {}, None
    if isinstance(policy, (set, frozenset)):
        classes = tuple(policy)
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise ValueError(
                    f"shard_model: auto_wrap_policy set must hold nn.Module classes, got {cls!r}"
                )
        return {m: {} for m in model.modules() if m not in ignored and isinstance(m, classes)}, None
    run_policy = getattr(policy, "_run_policy", None)
    if callable(run_policy):  # FSDP1's policy objects (ModuleWrapPolicy, CustomPolicy, ...)
        chosen = run_policy(model, ignored, dict(root_kwargs))
        targets: dict[nn.Module, dict[str, object]] = {}
        for module, kwargs in chosen.items():
            targets[module] = {
                k: v
                for k, v in kwargs.items()
                if k not in root_kwargs or not (v is root_kwargs[k] or v == root_kwargs[k])
            }
        return targets, None
    if callable(policy):
        three = _as_recursive(policy)
        if three is not None:
            return None, three
        one = policy

        def recursive(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
            return recurse or bool(one(module))

        return None, recursive
    raise ValueError(
        "shard_model: auto_wrap_policy must be None, a set of module classes, an FSDP1 policy "
        "(ModuleWrapPolicy, CustomPolicy, or a function (module, recurse, nonwrapped_numel)), "
        f"size_based_policy(n) or a callable module -> bool, got {policy!r}"
    )


def _as_recursive(fn: Callable[..., object]) -> _RecursivePolicy | None:
    """``fn`` as ``(module, recurse, nonwrapped_numel) -> bool`` if its signature takes those
    three arguments (by FSDP1's keyword names, or else positionally), else ``None``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(module=None, recurse=True, nonwrapped_numel=0)
    except TypeError:
        pass
    else:
        return lambda m, r, n: bool(fn(module=m, recurse=r, nonwrapped_numel=n))
    try:
        sig.bind(None, True, 0)
    except TypeError:
        return None
    return lambda m, r, n: bool(fn(m, r, n))


def recursive_wrap(
    model: nn.Module,
    policy: _RecursivePolicy,
    has_mp: bool,
    full_precision_classes: tuple[type[nn.Module], ...],
    ignored: set[nn.Module],
    shard: Callable[[nn.Module, bool, dict[str, object]], None],
) -> None:
    """FSDP1's selection for policy functions: ask ``policy(module, True, numel)`` whether to
    descend, wrap the children's subtrees, then ask ``policy(module, False, remainder)``
    (``remainder``: the subtree's parameter numel minus what the children wrapped) whether to
    wrap the module. The root is only descended into. With mixed precision FSDP1 ORs the
    policy with "is a ``_module_classes_to_ignore`` module", which also makes it descend
    everywhere."""
    ignored_params = {p for m in ignored for p in m.parameters()}

    def wants(module: nn.Module, recurse: bool, numel: int) -> bool:
        if policy(module, recurse, numel):
            return True
        return has_mp and (recurse or isinstance(module, full_precision_classes))

    def visit(module: nn.Module, is_root: bool) -> int:
        numel = sum(p.numel() for p in module.parameters() if p not in ignored_params)
        if isinstance(module, FSDPModule) and not is_root:
            return numel  # already sharded (a module shared by two parents)
        if not wants(module, True, numel):
            return 0
        wrapped = sum(visit(c, False) for c in module.children() if c not in ignored)
        if not is_root and wants(module, False, numel - wrapped):
            shard(module, False, {})
            return numel
        return wrapped

    visit(model, True)


def post_order_wrap(
    model: nn.Module,
    targets: dict[nn.Module, dict[str, object]],
    ignored: set[nn.Module],
    shard: Callable[[nn.Module, bool, dict[str, object]], None],
) -> None:
    """Shard the ``targets`` (but the root) children first, each module once."""
    seen = {model}

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if child not in seen and child not in ignored:
                seen.add(child)
                visit(child)
        if module is not model and module in targets and not isinstance(module, FSDPModule):
            shard(module, False, targets[module])

    visit(model)


def _nonwrapped_numel(module: nn.Module) -> int:
    seen: set[int] = set()
    total = 0

    def walk(m: nn.Module) -> None:
        nonlocal total
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        for child in m.children():
            if not isinstance(child, FSDPModule):
                walk(child)

    walk(module)
    return total
