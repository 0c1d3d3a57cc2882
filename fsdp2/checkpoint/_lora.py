"""``iter_full_tensors(merge_lora=True)``: a PEFT LoRA model seen as the model that PEFT's
``merge_and_unload()`` would return: the base model's names, each LoRA base weight with
its active adapters' terms, the adapters themselves dropped. The arithmetic is
``_stream.py``'s (see [Note: streamed full tensors]); this module only reads the PEFT
modules (``peft`` is imported when asked for, never by ``import fsdp2``)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from fsdp2.checkpoint._names import Named, clean
from fsdp2.checkpoint._stream import Term

__all__ = ["merge_view"]


def _peft() -> Any:
    try:
        import peft.tuners.lora.layer as lora
        import peft.tuners.tuners_utils as tuners
        import peft.utils.other as other
    except ImportError as e:
        raise ImportError(
            "iter_full_tensors(merge_lora=True) reads PEFT's LoRA layers: pip install peft"
        ) from e
    return lora, tuners, other


def _base(model: nn.Module) -> nn.Module:
    """The model ``merge_and_unload()`` returns: a ``PeftModel``'s base model, a
    ``LoraModel``'s ``model``, or ``model`` itself (LoRA layers injected in place)."""
    get = getattr(model, "get_base_model", None)
    if callable(get):
        base = get()
        if isinstance(base, nn.Module):
            return base
    inner = getattr(model, "model", None)
    if type(model).__name__ == "LoraModel" and isinstance(inner, nn.Module):
        return inner
    return model


def merge_view(model: nn.Module, named: Named) -> tuple[Named, dict[str, list[Term]]]:
    """``named`` under the merged model's names, and each merged tensor's LoRA terms.

    Raises ``ValueError`` naming the module for what cannot be merged this way (DoRA and
    other LoRA variants, LoRA on convolutions or attention, other PEFT tuners, trainable
    tokens), and when ``model`` has no LoRA layer at all."""
    lora, tuners, other = _peft()
    who = "iter_full_tensors(merge_lora=True)"
    base = _base(model)
    root = next((clean(n) for n, m in model.named_modules(remove_duplicate=False) if m is base), "")
    rules: dict[str, str | None] = {}  # a cleaned name prefix -> its new prefix (None: drop)
    terms: dict[str, list[Term]] = {}  # by the model's (cleaned) name
    layers = 0
    for raw, module in model.named_modules():
        name = clean(raw)
        if isinstance(module, other.AuxiliaryTrainingWrapper):
            if not isinstance(module, other.ModulesToSaveWrapper):
                raise ValueError(
                    f"{who}: {name} is a {type(module).__name__}, which is not merged on the "
                    "way out; merge it with PEFT on an unsharded copy"
                )
            kept = (
                f"{name}.modules_to_save.{module.active_adapter}."
                if module.active_adapters
                else f"{name}.original_module."
            )
            if isinstance(module.modules_to_save[module.active_adapter], tuners.BaseTunerLayer):
                raise ValueError(f"{who}: {name} saves a LoRA layer, which is not merged")
            rules[f"{name}."] = None
            rules[kept] = f"{name}."
        elif isinstance(module, tuners.BaseTunerLayer):
            if type(module) not in (lora.Linear, lora.Embedding):
                raise ValueError(
                    f"{who}: {name} is a {type(module).__module__}.{type(module).__name__}; "
                    "only LoRA on Linear and Embedding layers is merged on the way out"
                )
            if isinstance(module.base_layer, tuners.BaseTunerLayer):
                raise ValueError(f"{who}: {name} wraps another tuner layer, which is not merged")
            layers += 1
            rules[f"{name}."] = None
            rules[f"{name}.base_layer."] = f"{name}."
            _add_terms(module, name, lora, terms, who)
    if not layers:
        raise ValueError(f"{who}: {type(model).__name__} has no PEFT LoRA layer")

    def new_name(name: str) -> str | None:
        hit = max((p for p in rules if name.startswith(p)), key=len, default=None)
        if hit is not None:
            target = rules[hit]
            if target is None:
                return None
            name = target + name[len(hit) :]
        if root:
            if not name.startswith(root + "."):
                raise ValueError(f"{who}: {name} is outside the base model {root}")
            name = name[len(root) + 1 :]
        return name

    tensors, aliases, moved = {}, {}, {}
    for name, t in named.tensors.items():
        new = new_name(name)
        if new is not None:
            if new in tensors:
                raise ValueError(f"{who}: two tensors would both be named {new}")
            tensors[new], moved[name] = t, new
    for alias, first in named.aliases.items():
        new = new_name(alias)
        if new is None or new in tensors:
            continue
        if first in moved:
            aliases[new] = moved[first]
        else:  # its first name is dropped (an adapter's copy): it stands on its own
            tensors[new], moved[first] = named.tensors[first], new
    transient = {n: t for n, t in named.transient.items() if new_name(n) is not None}
    merged = {moved[n]: ts for n, ts in terms.items() if n in moved}
    return Named(tensors, aliases, transient), merged


def _add_terms(module: Any, name: str, lora: Any, terms: dict[str, list[Term]], who: str) -> None:
    """The terms PEFT's ``merge()`` adds for ``module``'s active adapters not yet merged."""
    for adapter in module.active_adapters:
        if adapter in module.merged_adapters:
            continue  # already in the base weight
        embedding = isinstance(module, lora.Embedding)
        if adapter not in (module.lora_embedding_A if embedding else module.lora_A):
            continue
        if adapter in getattr(module, "lora_variant", {}):
            raise ValueError(
                f"{who}: {name} uses a LoRA variant ({type(module.lora_variant[adapter]).__name__},"
                f" e.g. DoRA) for adapter {adapter!r}, which is not merged on the way out"
            )
        scale = float(module.scaling[adapter])
        weight = terms.setdefault(f"{name}.base_layer.weight", [])
        if embedding:
            a, b = module.lora_embedding_A[adapter], module.lora_embedding_B[adapter]
            weight.append(Term(a, b, scale, transpose=True))
            continue
        a, b = module.lora_A[adapter], module.lora_B[adapter]
        weight.append(Term(a.weight, b.weight, scale, transpose=bool(module.fan_in_fan_out)))
        if module.lora_bias[adapter]:
            if getattr(module.get_base_layer(), "bias", None) is None:
                raise ValueError(f"{who}: {name} has a LoRA bias but its base layer has none")
            terms.setdefault(f"{name}.base_layer.bias", []).append(
                Term(None, b.bias, scale, transpose=False)
            )
