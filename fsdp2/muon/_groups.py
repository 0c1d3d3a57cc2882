"""``muon_param_groups``: a model's parameters split between Muon and AdamW."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

import torch.nn as nn

# ---------------------------------------------------------------------------------------------
# Splitting a model's parameters between Muon and AdamW


def muon_param_groups(
    model: nn.Module,
    *,
    muon: Mapping[str, Any] | None = None,
    adamw: Mapping[str, Any] | None = None,
    head_names: Iterable[str] = ("output", "lm_head", "head"),
    muon_names: Iterable[str] = (),
    adamw_names: Iterable[str] = (),
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split ``model``'s parameters between Muon and AdamW, as Moonlight and Keller Jordan's
    Muon do: Muon for the hidden layers' matrices, AdamW for everything else::

        muon_groups, adamw_groups = fsdp2.optim.muon_param_groups(
            model, muon={"lr": 0.02}, adamw={"lr": 3e-4, "weight_decay": 0.01}
        )
        optimizers = [fsdp2.optim.Muon(muon_groups), torch.optim.AdamW(adamw_groups)]

    A parameter goes to AdamW when it is not 2-D (biases, norm weights, convolutions'
    kernels), belongs to an ``nn.Embedding`` or ``nn.EmbeddingBag``, or belongs to the output
    head; every other parameter goes to Muon. The head is every module whose qualified name,
    or its last component, is one of ``head_names``; when no module has such a name, the
    last ``nn.Linear`` of ``model.modules()`` is taken for the head. A parameter registered
    on several modules (tied weights) goes to AdamW if any of them says so.

    Args:
        model: the model (sharded or not: ``fully_shard`` keeps the names).
        muon: hyperparameters for the Muon group (``lr``, ``weight_decay``, ...); the
            optimizer's defaults where not given.
        adamw: the same for the AdamW group.
        head_names: module names taken for the output head.
        muon_names: ``fnmatch`` patterns of parameter names (as ``named_parameters()``
            gives them, e.g. ``"layers.*.attn.qkv.weight"``) forced to Muon; such a
            parameter must be 2-D (``ValueError``).
        adamw_names: patterns of parameter names forced to AdamW (checked after
            ``muon_names``).

    Returns:
        ``(muon_groups, adamw_groups)``: one parameter group each, ``{"params": [...],
        **muon}`` and ``{"params": [...], **adamw}``, in ``model.parameters()`` order, every
        parameter (frozen ones included) in exactly one. Either ``params`` list may be
        empty.
    """
    muon_kw, adamw_kw = dict(muon or {}), dict(adamw or {})
    if "params" in muon_kw or "params" in adamw_kw:
        raise ValueError("muon_param_groups: muon= and adamw= hold hyperparameters, not params")
    heads = set(head_names)
    force_muon, force_adamw = list(muon_names), list(adamw_names)
    modules = list(model.named_modules(remove_duplicate=False))
    head_modules = {
        id(m) for name, m in modules if name in heads or name.rpartition(".")[2] in heads
    }
    if not head_modules:
        linears = [m for _, m in modules if isinstance(m, nn.Linear)]
        head_modules = {id(linears[-1])} if linears else set()
    names: dict[int, list[str]] = {}
    adamw_by_owner: set[int] = set()
    for mod_name, m in modules:
        for p_name, p in m.named_parameters(recurse=False):
            names.setdefault(id(p), []).append(f"{mod_name}.{p_name}" if mod_name else p_name)
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) or id(m) in head_modules:
                adamw_by_owner.add(id(p))
    muon_params: list[nn.Parameter] = []
    adamw_params: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        aliases = names.get(id(p), [name])

        def matches(patterns: list[str], aliases: list[str] = aliases) -> bool:
            return any(fnmatch.fnmatchcase(a, pat) for a in aliases for pat in patterns)

        if matches(force_muon):
            if p.ndim != 2:
                raise ValueError(
                    f"muon_param_groups: {name} matches muon_names but has shape "
                    f"{tuple(p.shape)}; Muon takes 2-D parameters only"
                )
            muon_params.append(p)
        elif matches(force_adamw) or p.ndim != 2 or id(p) in adamw_by_owner:
            adamw_params.append(p)
        else:
            muon_params.append(p)
    return [{"params": muon_params, **muon_kw}], [{"params": adamw_params, **adamw_kw}]
