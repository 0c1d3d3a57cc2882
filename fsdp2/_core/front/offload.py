"""The offload policy of each parameter of a ``fully_shard`` call: one policy for all of
them, or a mapping from parameter names (torch main, pytorch PR 188120). Raises before any
collective.

# [Note: offload by name]
# ``offload_policy`` may be a ``Mapping[str, OffloadPolicy]`` keyed by parameter names
# relative to the module passed to ``fully_shard`` (its ``named_parameters()`` names, a
# tied parameter under its first name); a parameter whose name is absent gets
# ``OffloadPolicy()`` (it stays on the device). With a list of modules, a name is relative
# to each module of the list: it names the parameter at that path in every module of the
# list that has one (``{"weight": p}`` for ``fully_shard([norm, output])`` covers both
# weights). A name that names no parameter this call manages raises ``ValueError``, naming
# it and why: a parameter of a submodule already sharded by its own ``fully_shard`` call,
# one in ``ignored_params``, a tied parameter's second name, or no parameter at all. Values
# are fsdp2's or torch's ``OffloadPolicy`` / ``CPUOffloadPolicy`` (read by field), anything
# else ``TypeError``. ``fsdp2.cpu_offload_by_budget`` builds such a mapping.
#
# The call's parameters are then grouped by policy, as by mesh ([Note: per-parameter
# meshes] in placement.py): each distinct policy makes a ``ParamGroup`` of its own (one
# flat sharded buffer lives in one place), with its own all-gather and reduce-scatter, in
# the call's one ``Slot``. A call mixing offloaded and on-device parameters so issues one
# collective of each kind per policy and step where torch's engine issues one (it copies
# each offloaded parameter into the one all-gather input); the values are the same.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch.nn as nn

from fsdp2.api import CPUOffloadPolicy, OffloadPolicy, as_offload_policy

__all__ = ["by_offload", "mapping_key", "offload_policies"]

_Found = list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]]
_INDEX = re.compile(r"^\[\d+\]\.?")  # the "[i]." that prefixes a list's parameter names


def mapping_key(fqn: str, listed: bool) -> str:
    """The name a mapping keys parameter ``fqn`` by (``fqn`` as ``fully_shard`` found it;
    ``listed``: the call took a list of modules, whose names drop the list's ``[i].``)."""
    return _INDEX.sub("", fqn) if listed else fqn


def offload_policies(
    policy: object,
    modules: list[nn.Module],
    found: _Found,
    ignored: set[int],
    name: str,
    owner_attr: str,
) -> tuple[OffloadPolicy, dict[int, OffloadPolicy]]:
    """``(default, by parameter id)``: the policy of every managed parameter (those in
    ``found``) is ``by_param.get(id(p), default)``. See [Note: offload by name].

    Raises:
        TypeError: a policy, key or value of the wrong type.
        ValueError: a name that names no parameter this call manages.
    """
    if not isinstance(policy, Mapping):
        return as_offload_policy(policy), {}
    by_name: dict[str, list[nn.Parameter]] = {}
    for fqn, p, _ in found:
        rel = mapping_key(fqn, len(modules) > 1)
        by_name.setdefault(rel, []).append(p)
    out: dict[int, OffloadPolicy] = {}
    for key, value in policy.items():
        if not isinstance(key, str):
            raise TypeError(
                f"fully_shard({name}): offload_policy mapping keys must be parameter names "
                f"(str), got {key!r}"
            )
        try:
            value = as_offload_policy(value)
        except TypeError as e:
            raise TypeError(f"fully_shard({name}): offload_policy[{key!r}]: {e}") from None
        params = by_name.get(key)
        if params is None:
            why = _why_unmanaged(key, modules, found, ignored, owner_attr)
            known = ", ".join(sorted(by_name)[:5]) + (" ..." if len(by_name) > 5 else "")
            raise ValueError(
                f"fully_shard({name}): offload_policy names {key!r}, which is no parameter "
                f"this call manages: {why}. Key the mapping by parameter names relative to the "
                f"module passed to fully_shard, without the submodules already sharded by "
                f"their own fully_shard call (here: {known or 'none'})"
            )
        for p in params:
            out[id(p)] = value
    return OffloadPolicy(), out


def _why_unmanaged(
    key: str, modules: list[nn.Module], found: _Found, ignored: set[int], owner_attr: str
) -> str:
    canonical = {id(p): fqn for fqn, p, _ in found}
    for m in modules:
        try:
            p = m.get_parameter(key)
        except AttributeError:
            continue
        if id(p) in canonical:
            return f"it is the parameter named {canonical[id(p)]!r} (tied): use that name"
        if id(p) in ignored:
            return "it is in ignored_params"
        owner = p.__dict__.get(owner_attr)
        if owner is not None:
            return f"it is managed by fully_shard({owner}); give that call its policy"
        return "it is not among the parameters this call shards"
    return "there is no parameter by that name"


def by_offload(
    entries: list[Any], default: OffloadPolicy, by_param: dict[int, OffloadPolicy]
) -> list[tuple[OffloadPolicy, list[Any], str]]:
    """``entries`` (``(fqn, param, ...)``, one group's) split by offload policy, in the
    order their first parameters come: ``(policy, entries, tag)``, ``tag`` naming the
    policy in messages when there is more than one."""
    parts: dict[OffloadPolicy, list[Any]] = {}
    for entry in entries:
        parts.setdefault(by_param.get(id(entry[1]), default), []).append(entry)
    if len(parts) == 1:
        return [(policy, part, "") for policy, part in parts.items()]
    return [(policy, part, f" ({_describe(policy)})") for policy, part in parts.items()]


def _describe(policy: OffloadPolicy) -> str:
    if not isinstance(policy, CPUOffloadPolicy):
        return "on device"
    fields = ("pin_memory", "offload_after_forward", "offload_after_backward")
    changed = [f"{f}=False" for f in fields if not getattr(policy, f)]
    return "CPU offload" + (": " + ", ".join(changed) if changed else "")
