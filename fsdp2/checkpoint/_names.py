"""Tensor names of a model for full checkpoints and streamed full tensors: the
``state_dict`` names with wrapper parts dropped, tied tensors, ``key_map``. See
[Note: full checkpoints] in ``__init__.py``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2._core.front.seam import compute_device, managed_params

__all__ = [
    "KeyMap",
    "Named",
    "clean",
    "model_device",
    "named_tensors",
    "rename",
    "renamed",
    "reshard",
]

KeyMap = Mapping[str, str | None] | Callable[[str], str | None]
"""Renames tensors: a dict (names it lacks stay as they are) or a function of the name.
``None`` drops the tensor (e.g. an old checkpoint's ``rotary_emb.inv_freq``)."""

_WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})


class Named(NamedTuple):
    tensors: dict[str, torch.Tensor]  # first name -> parameter or persistent buffer
    aliases: dict[str, str]  # another name of a tied tensor -> its first name
    transient: dict[str, torch.Tensor]  # non-persistent buffers (in no checkpoint)


def clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def named_tensors(model: nn.Module) -> Named:
    """See [Note: full checkpoints]: names in ``state_dict`` order."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    transient: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        own = [(n, t, True) for n, t in module._parameters.items()]
        own += [
            (n, t, n not in module._non_persistent_buffers_set) for n, t in module._buffers.items()
        ]
        for local_name, tensor, persistent in own:
            if tensor is None:
                continue
            name = clean(f"{prefix}.{local_name}" if prefix else local_name)
            if not persistent:
                transient[name] = tensor
            elif id(tensor) in first:
                if first[id(tensor)] != name:
                    aliases[name] = first[id(tensor)]
            else:
                first[id(tensor)] = name
                tensors[name] = tensor
    return Named(tensors, aliases, transient)


def rename(key_map: KeyMap | None, name: str) -> str | None:
    if key_map is None:
        return name
    if callable(key_map):
        return key_map(name)
    return key_map.get(name, name)


def renamed(names: Iterable[str], key_map: KeyMap | None, who: str) -> dict[str, str]:
    """``{new name: name}`` for every name ``key_map`` keeps, in order; two names mapped to
    one are a ``ValueError``."""
    out: dict[str, str] = {}
    for name in names:
        new = rename(key_map, name)
        if new is None:
            continue
        if new in out:
            raise ValueError(
                f"{who}: {out[new]!r} and {name!r} both map to {new!r}: fix the key_map"
            )
        out[new] = name
    return out


def reshard(model: nn.Module) -> None:
    """Register the sharded parameters everywhere (a manual ``unshard`` or a kept
    ``reshard_after_forward=False`` copy would otherwise be what we read or write)."""
    managed_params(model, recurse=True, reshard=True)


def model_device(model: nn.Module) -> torch.device:
    device = compute_device(model)
    if device is not None:
        return device
    for t in model.parameters():
        if isinstance(t, DTensor):
            mesh = t.device_mesh
            if mesh.device_type == "cpu":
                return torch.device("cpu")
            index = torch.accelerator.current_device_index()
            return torch.device(mesh.device_type, index)
    return torch.device("cpu")
