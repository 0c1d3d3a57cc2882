"""FSDP1-style optimizer state dicts for fsdp2 models: ``optim_state_dict``,
``optim_state_dict_to_load`` and ``init_optim_state``; re-exported by ``fsdp2.fsdp1``. The
core never imports it.

[Note: FSDP1 optimizer state dicts]
Optimizer state dicts have FSDP1's format: ``{"state": {fqn: {"step": t, "exp_avg": ...}},
"param_groups": [{hyperparameters..., "params": [fqn, ...]}]}``, keyed by each parameter's
first name in ``model.named_parameters()`` (a tied parameter has one entry). Optimizer state
of an fsdp2 parameter is a DTensor with the parameter's layout; FULL gathers it
(``full_tensor()``), SHARDED keeps the DTensors (the optimizer's own: DCP loads into them),
LOCAL takes ``to_local()``; other values (AdamW's scalar ``step``) stay as they are.
``optim_state_dict_to_load`` turns such a dict back into ``optim.load_state_dict``'s format
(integer ids in the optimizer's own group order, so the checkpoint's order does not matter)
and every parameter-shaped tensor into a DTensor of the parameter's layout, without
communication: a full tensor is cut locally (``distribute_tensor(src_data_rank=None)``), a
LOCAL shard is wrapped (``DTensor.from_local``), a DTensor of another layout redistributed.
A DCP load target needs optimizer state to exist: ``init_optim_state(optim)`` creates it.
The state dict types and ``state_dict_type`` settings are the model's, and so is the DCP
interplay with torch's FSDP1; see [Note: FSDP1 state dicts] in _state_dict.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp2._core.front.seam import managed_params
from fsdp2.fsdp1._collectives import broadcast_tree, gather_full
from fsdp2.fsdp1._state_dict import (
    OptimStateDictConfig,
    StateDictType,
    as_enum,
    config_settings,
    strip_fsdp1_prefixes,
)
from fsdp2.fsdp1._state_dict_type import OPTIM_CONFIGS, check_config, get_state_dict_type


def _optim_settings(
    model: nn.Module, state_dict_type: object, config: object, api: str
) -> tuple[StateDictType, bool, bool]:
    """The type and (offload_to_cpu, rank0_only): from the arguments, else ``model``'s
    settings."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{api}: model must be an nn.Module, got {type(model).__name__}")
    settings = get_state_dict_type(model)
    if state_dict_type is None:
        kind = settings.state_dict_type
        if config is None:
            config = settings.optim_state_dict_config
    else:
        kind = as_enum(StateDictType, state_dict_type, "state_dict_type", api)
    config = check_config(config, kind, OptimStateDictConfig, OPTIM_CONFIGS, f"{api}: config")
    return config_settings(kind, config, api)


def _check_optim(optim: object, api: str) -> torch.optim.Optimizer:
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError(
            f"{api}: optim must be a torch.optim.Optimizer over the model's parameters, got "
            f"{type(optim).__name__}"
        )
    return optim


def _check_group(group: object, api: str) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{api}: group must be None or a ProcessGroup, got {group!r}")


def _check_osd(osd: object, api: str, what: str = "optim_state_dict") -> Mapping[str, Any]:
    if not isinstance(osd, Mapping) or not {"state", "param_groups"} <= osd.keys():
        got = sorted(osd) if isinstance(osd, Mapping) else type(osd).__name__
        raise ValueError(
            f"{api}: {what} must be a dict with 'state' and 'param_groups' (an optimizer state "
            f"dict), got {got}"
        )
    if not isinstance(osd["param_groups"], (list, tuple)) or not isinstance(osd["state"], Mapping):
        raise ValueError(
            f"{api}: {what}['param_groups'] must be a list of dicts and {what}['state'] a dict"
        )
    return osd


def _param_names(model: nn.Module) -> dict[int, list[str]]:
    """``id(parameter) -> its names`` in ``model.named_parameters(remove_duplicate=False)``
    order (the first is the one ``named_parameters()`` gives). Includes the sharded parameter
    of a group that is unsharded right now (its full parameters are registered)."""
    names: dict[int, list[str]] = {}
    order: dict[str, int] = {}
    for i, (name, p) in enumerate(model.named_parameters(remove_duplicate=False)):
        names.setdefault(id(p), []).append(name)
        order[name] = i
    prefixes: dict[int, str] = {}
    for prefix, m in model.named_modules(remove_duplicate=False):
        prefixes.setdefault(id(m), prefix)
    for fp in managed_params(model, recurse=True):
        if id(fp.sharded) in names:
            continue
        fqns = [
            f"{prefixes[id(owner)]}.{attr}" if prefixes[id(owner)] else attr
            for owner, attr in fp.owners
            if id(owner) in prefixes
        ]
        if fqns:
            names[id(fp.sharded)] = sorted(fqns, key=lambda n: order.get(n, len(order)))
    return names


def _optim_params(optim: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    return [list(group["params"]) for group in optim.param_groups]


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: Mapping[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    state_dict_type: StateDictType | None = None,
    config: OptimStateDictConfig | None = None,
) -> dict[str, Any]:
    """``optim``'s state dict keyed by parameter names, in FSDP1's format
    (``FSDP.optim_state_dict``): ``{"state": {fqn: {"step": ..., "exp_avg": ...}},
    "param_groups": [{..., "params": [fqn, ...]}]}``; see [Note: FSDP1 optimizer state dicts].

    Collective for FULL (every rank must call it; the optimizer must hold state for the same
    parameters on every rank, as it does after fsdp2 training). FULL values are full plain
    tensors (only on
    rank 0 with ``rank0_only``: the other ranks get ``{}``), SHARDED values the optimizer's
    DTensors (a DCP save or load target), LOCAL values this rank's shards. Non-DTensor values
    (AdamW's ``step``) stay plain tensors. Parameters without state (never stepped) have no
    entry; a tied parameter appears once, under its first name.

    Args:
        model: the module whose parameters ``optim`` holds (the root passed to ``shard_model``).
        optim: the optimizer.
        optim_state_dict: an ``optim.state_dict()`` to convert; ``None``: ``optim.state_dict()``.
        group: accepted for FSDP1 compatibility and unused (each DTensor carries its mesh).
        state_dict_type: a ``StateDictType``; ``None``: the type set by ``state_dict_type`` /
            ``set_state_dict_type`` on ``model``, else SHARDED.
        config: an ``OptimStateDictConfig`` of the type (``None``: the one set on ``model`` if
            the type came from there, else the type's default): ``offload_to_cpu`` moves plain
            tensors to CPU (default ``True`` as FSDP1, except LOCAL; SHARDED keeps DTensors
            where they are); ``rank0_only`` (FULL only).

    Returns:
        The optimizer state dict.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: ``optim`` holds a parameter that is not in ``model``, a malformed
            ``optim_state_dict``, a config of another type, or ``rank0_only`` with a type
            other than FULL.
    """
    api = "optim_state_dict"
    kind, offload, rank0_only = _optim_settings(model, state_dict_type, config, api)
    _check_optim(optim, api)
    _check_group(group, api)
    osd = _check_osd(optim.state_dict() if optim_state_dict is None else optim_state_dict, api)
    names = _param_names(model)
    params = _optim_params(optim)
    if len(osd["param_groups"]) != len(params):
        raise ValueError(
            f"{api}: optim_state_dict has {len(osd['param_groups'])} param groups but optim "
            f"has {len(params)}; pass optim's own state_dict()"
        )
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for saved_group, group_params in zip(osd["param_groups"], params, strict=True):
        ids = list(saved_group["params"])
        if len(ids) != len(group_params):
            raise ValueError(
                f"{api}: a param group of optim_state_dict has {len(ids)} parameters but "
                f"optim's has {len(group_params)}; pass optim's own state_dict()"
            )
        fqns = []
        for pid, p in zip(ids, group_params, strict=True):
            fqn = _name_of(p, names, api)
            fqns.append(fqn)
            if pid in osd["state"]:
                # every rank walks the same parameters and keys: FULL's gathers line up
                state[fqn] = {k: _export(v, kind, offload) for k, v in osd["state"][pid].items()}
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": fqns})
    if rank0_only and dist.get_rank() != 0:
        return {}
    return {"state": state, "param_groups": groups}


def _name_of(p: torch.Tensor, names: Mapping[int, list[str]], api: str) -> str:
    fqns = names.get(id(p))
    if not fqns:
        raise ValueError(
            f"{api}: optim holds a parameter of shape {tuple(p.shape)} that is not a parameter "
            "of model; pass the root module whose parameters the optimizer was built from"
        )
    return fqns[0]


def _export(value: object, kind: StateDictType, offload: bool) -> object:
    if isinstance(value, DTensor):
        if kind is StateDictType.FULL_STATE_DICT:
            return gather_full(value, offload)
        if kind is StateDictType.LOCAL_STATE_DICT:
            local = value.to_local()
            return local.cpu() if offload else local
        return value
    if isinstance(value, torch.Tensor):
        if kind is StateDictType.FULL_STATE_DICT:
            return gather_full(value, offload)
        return value.cpu() if offload else value
    return value


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: Mapping[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    state_dict_type: StateDictType | None = None,
    config: OptimStateDictConfig | None = None,
) -> dict[str, Any]:
    """Turn an FQN-keyed optimizer state dict (``optim_state_dict``'s or torch's FSDP1's
    format) into one ``optim.load_state_dict`` takes (FSDP1's ``FSDP.optim_state_dict_to_load``);
    see [Note: FSDP1 optimizer state dicts].

    Parameter-shaped tensors become DTensors of the parameter's layout without communication:
    full tensors (FULL) are cut locally, local shards (LOCAL) wrapped, DTensors (SHARDED)
    redistributed if their layout differs. FSDP1 wrapper prefixes are stripped from the names
    and a tied parameter may appear under any of its names. The checkpoint's parameter order
    within a group does not matter; its groups are matched to ``optim``'s by their parameters.
    Parameters without state in the checkpoint get none. Collective with ``rank0_only`` (FULL):
    rank 0 broadcasts its ``optim_state_dict``; the other ranks' is ignored (may be ``{}``).

    Args:
        model: the module whose parameters ``optim`` holds (the root passed to ``shard_model``).
        optim: the optimizer to load into.
        optim_state_dict: the FQN-keyed optimizer state dict.
        is_named_optimizer: must be ``False`` (TorchRec's keyed optimizers are not supported).
        load_directly: also call ``optim.load_state_dict`` with the result.
        group: accepted for FSDP1 compatibility and unused (each DTensor carries its mesh).
        state_dict_type: a ``StateDictType``; ``None``: the type set on ``model``, else
            SHARDED.
        config: an ``OptimStateDictConfig`` of the type; only ``rank0_only`` (FULL) matters.

    Returns:
        The state dict for ``optim.load_state_dict``: integer ids in ``optim``'s own order.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: a name that is not a parameter of ``model``, param groups that do not
            match ``optim``'s, a tensor of the wrong shape, a ``ShardedTensor`` (load it with
            DCP instead), or ``is_named_optimizer``.
    """
    api = "optim_state_dict_to_load"
    kind, _, rank0_only = _optim_settings(model, state_dict_type, config, api)
    _check_optim(optim, api)
    _check_group(group, api)
    if is_named_optimizer:
        raise ValueError(f"{api}: is_named_optimizer=True is not supported; pass False")
    if rank0_only:
        osd = broadcast_tree(lambda: _check_osd(optim_state_dict, api))
    else:
        osd = _check_osd(optim_state_dict, api)
    names = _param_names(model)
    by_name: dict[str, torch.Tensor] = {}
    for p in _all_params(model, names):
        for fqn in names[id(p)]:
            by_name[fqn] = p

    def canonical(fqn: object, where: str) -> str:
        if not isinstance(fqn, str):
            raise ValueError(f"{api}: {where} must be parameter names (str), got {fqn!r}")
        stripped = next(iter(strip_fsdp1_prefixes({fqn: None})))
        p = by_name.get(stripped)
        if p is None:
            raise ValueError(f"{api}: {where} names {fqn!r}, which is not a parameter of model")
        return names[id(p)][0]

    saved_groups: list[tuple[dict[str, Any], list[str]]] = []
    for i, g in enumerate(osd["param_groups"]):
        if not isinstance(g, Mapping) or "params" not in g:
            raise ValueError(f"{api}: param_groups[{i}] must be a dict with 'params'")
        fqns = [canonical(f, f"param_groups[{i}]['params']") for f in g["params"]]
        saved_groups.append(({k: v for k, v in g.items() if k != "params"}, fqns))
    saved_state = {canonical(f, "state keys"): v for f, v in osd["state"].items()}
    grouped = {f for _, fqns in saved_groups for f in fqns}
    if not saved_state.keys() <= grouped:
        raise ValueError(
            f"{api}: state for {sorted(saved_state.keys() - grouped)}, which no param group lists"
        )

    params = _optim_params(optim)
    if len(saved_groups) != len(params):
        raise ValueError(
            f"{api}: optim_state_dict has {len(saved_groups)} param groups but optim has "
            f"{len(params)}"
        )
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    used: set[int] = set()
    next_id = 0
    for gi, group_params in enumerate(params):
        fqns = [_name_of(p, names, api) for p in group_params]
        match = [
            j
            for j, (_, saved) in enumerate(saved_groups)
            if j not in used and set(saved) == set(fqns)
        ]
        if not match:
            raise ValueError(
                f"{api}: optim's param group {gi} holds {_some(fqns)}, which no param group "
                "of optim_state_dict holds exactly (same parameters, any order)"
            )
        used.add(match[0])
        ids = list(range(next_id, next_id + len(group_params)))
        next_id += len(group_params)
        for pid, p, fqn in zip(ids, group_params, fqns, strict=True):
            if fqn in saved_state:
                values = saved_state[fqn]
                if not isinstance(values, Mapping):
                    raise ValueError(f"{api}: state[{fqn!r}] must be a dict, got {values!r}")
                state[pid] = {
                    k: _import(v, p, kind, f"state[{fqn!r}][{k!r}]", api) for k, v in values.items()
                }
        groups.append({**saved_groups[match[0]][0], "params": ids})
    out = {"state": state, "param_groups": groups}
    if load_directly:
        optim.load_state_dict(out)
    return out


def _some(names: list[str], n: int = 6) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return f"[{shown}{', ...' if len(names) > n else ''}] ({len(names)} parameters)"


def _all_params(model: nn.Module, names: Mapping[int, list[str]]) -> list[torch.Tensor]:
    """The parameters ``names`` knows, registered or sharded-but-unregistered."""
    out: dict[int, torch.Tensor] = {
        id(p): p for _, p in model.named_parameters(remove_duplicate=False)
    }
    for fp in managed_params(model, recurse=True):
        out.setdefault(id(fp.sharded), fp.sharded)
    return [p for pid, p in out.items() if pid in names]


def _import(value: object, param: torch.Tensor, kind: StateDictType, what: str, api: str) -> object:
    """``value`` in ``param``'s layout if it is parameter-shaped (see [Note: FSDP1 optimizer
    state dicts]); other values as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "local_shards"):
        raise ValueError(
            f"{api}: {what} is a ShardedTensor (torch's FSDP1 SHARDED format); save it with "
            "torch.distributed.checkpoint and dcp.load it into "
            "optim_state_dict(model, optim, state_dict_type=SHARDED_STATE_DICT)"
        )
    if not isinstance(param, DTensor):  # an ignored or unsharded parameter
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if value.dim() > 0 and value.shape != param.shape:
            raise ValueError(
                f"{api}: {what} has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}"
            )
        return value
    mesh, placements = param.device_mesh, param.placements
    if isinstance(value, DTensor):
        if value.shape != param.shape:
            raise ValueError(
                f"{api}: {what} has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}"
            )
        if value.device_mesh == mesh:
            return value if value.placements == placements else value.redistribute(mesh, placements)
        value = value.full_tensor()
    if value.dim() == 0:
        return value  # scalars (AdamW's step)
    value = value.detach()
    local_shape = param.to_local().shape
    if kind is StateDictType.LOCAL_STATE_DICT and value.shape == local_shape:
        return DTensor.from_local(
            value.to(param.device),
            mesh,
            placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    if value.shape == param.shape:
        # no communication: every rank holds the full value and keeps its piece
        return distribute_tensor(value.to(param.device), mesh, placements, src_data_rank=None)
    want = "local shard" if kind is StateDictType.LOCAL_STATE_DICT else "full"
    shape = local_shape if kind is StateDictType.LOCAL_STATE_DICT else param.shape
    raise ValueError(
        f"{api}: {what} has shape {tuple(value.shape)}, but the parameter's {want} shape is "
        f"{tuple(shape)}; a {kind.name} optimizer state dict of another model?"
    )


def init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Create ``optim``'s state for the parameters that have none, without changing any
    parameter or existing state: one ``optim.step()`` with zero gradients and learning rate 0
    over just those parameters. A DCP load needs the state to exist as its target (FSDP1 users
    take a training step first).

    Works for optimizers whose update is zero at ``lr=0`` (SGD, Adam, AdamW, ...). Gradients
    and learning rates are restored afterwards. No communication for fsdp2 parameters.

    Args:
        optim: the optimizer.

    Raises:
        TypeError: ``optim`` is not a ``torch.optim.Optimizer``.
    """
    _check_optim(optim, "init_optim_state")
    params = [p for g in optim.param_groups for p in g["params"]]
    todo = [p for p in params if p.requires_grad and not optim.state.get(p)]
    if not todo:
        return
    grads = {id(p): p.grad for p in params}
    lrs = [g["lr"] for g in optim.param_groups]
    try:
        for p in params:
            p.grad = None  # parameters with state are skipped by step()
        for p in todo:
            p.grad = torch.zeros_like(p)
        for g in optim.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        optim.step()
    finally:
        for g, lr in zip(optim.param_groups, lrs, strict=True):
            g["lr"] = lr
        for p in params:
            p.grad = grads[id(p)]
