"""Full checkpoints (safetensors, Hugging Face directories, ``torch.save`` files) straight
into and out of a sharded model, with bounded memory on every rank.

* :func:`load_full_checkpoint`: each rank reads only its own shards' bytes from the
  memory-mapped files and copies them into its local shards. No collective; no full
  tensor on any rank, except transiently one tensor at a time where a layout is not a box
  of the full tensor (``_StridedShard`` from FSDP + tensor parallel on one dim).
* :func:`save_full_checkpoint`: writes a Hugging Face-compatible sharded safetensors
  checkpoint (files + ``model.safetensors.index.json``): each tensor is gathered to the rank
  writing its file (see [Note: gathering to the writer] in _save.py) and streamed to
  disk from a writer thread, files spread over the ranks. A crash leaves no checkpoint
  that looks complete.

# [Note: full checkpoints]
# Names: a model's tensors are its parameters and persistent buffers under their
# ``state_dict`` names, with wrapper components (``_checkpoint_wrapped_module``,
# ``_orig_mod``) dropped so that an activation-checkpointed or compiled model uses the
# plain model's names. A tied tensor (``lm_head.weight is embed_tokens.weight``) is one
# tensor: saved once under its first name (as Hugging Face does), loaded from whichever
# of its names the checkpoint has.
# Save order: every rank walks the same tensors in the same order, so the all-gathers
# of ``DTensor.full_tensor()`` match across ranks; a writer's own failure (disk full) is
# recorded, not raised, until every rank agrees at the end (``all_gather_object``): no
# rank leaves the gathers early, so a failure is an error on every rank, never a hang.
# Publication: a folder is written into a staging folder beside it and swapped in whole
# once every rank has written its files, with the index and the Hugging Face config: see
# [Note: atomic publication] in _publish.py. A save that fails or is killed leaves an older
# checkpoint at ``path`` as it was.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdp2._core.front.seam import install_exit_drain, step_phase
from fsdp2.checkpoint._files import (
    Source,
    open_source,
    st_dtype,
)
from fsdp2.checkpoint._lora import merge_view
from fsdp2.checkpoint._names import (
    KeyMap,
    Named,
    model_device,
    named_tensors,
    renamed,
    reshard,
)
from fsdp2.checkpoint._save import (
    Spec,
    check_same_plan,
    parse_size,
    plain,
    plan_files,
    write_checkpoint,
)
from fsdp2.checkpoint._stream import Term, plan, stream

__all__ = [
    "KeyMap",
    "LoadResult",
    "iter_full_tensors",
    "load_full_checkpoint",
    "save_full_checkpoint",
]


class LoadResult(NamedTuple):
    """What :func:`load_full_checkpoint` did not match (empty lists under ``strict``)."""

    missing_keys: list[str]
    """Model tensors the checkpoint has no value for (left unchanged)."""
    unexpected_keys: list[str]
    """Checkpoint tensors (under their names in the checkpoint, before ``key_map``) the
    model has no tensor for (ignored)."""


def load_full_checkpoint(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    key_map: KeyMap | None = None,
    strict: bool = True,
) -> LoadResult:
    """Load a full (unsharded) checkpoint into ``model``, each rank reading only its shards.

    ``model`` is sharded with ``fully_shard`` (or not sharded at all), materialised or still
    on the meta device: then it is materialised here (``to_empty`` on the engine's device:
    one shard per rank) before loading. Every parameter and persistent buffer is loaded,
    cast to its own dtype. No collective runs, so ranks may load at different times.

    Args:
        model: the model to load into; its parameter objects stay the same.
        path: a ``.safetensors`` file, a ``torch.save`` file of a state dict (read with
            ``torch.load(mmap=True)``), or a directory: Hugging Face's
            ``model.safetensors.index.json`` and its files, ``model.safetensors``,
            ``pytorch_model.bin.index.json`` (+ files) or ``pytorch_model.bin``.
        key_map: renames checkpoint names to the model's names (see :data:`KeyMap`).
        strict: raise if the model and the checkpoint do not have the same tensors.

    Returns:
        :class:`LoadResult` with the missing and unexpected names (empty under ``strict``).

    Raises:
        FileNotFoundError: ``path``, or a file its index lists, does not exist.
        ValueError: a file cannot be read (corrupt header, not a state dict), two
            checkpoint names map to one model name, or the model is on the meta device and
            the checkpoint does not initialise all of it (non-persistent buffers, such as
            rotary tables, are in no checkpoint: build them on a real device).
        RuntimeError: (``strict``) missing or unexpected names; (always) a shape mismatch,
            naming the tensor and both shapes. Nothing is loaded when any error is raised.
    """
    reshard(model)
    named = named_tensors(model)
    with open_source(path) as source:
        plan, unexpected = _match(named, source, key_map)
        missing = [name for name in named.tensors if name not in plan]
        errors = []
        if strict and missing:
            errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing))
        if strict and unexpected:
            keys = ", ".join(f'"{k}"' for k in unexpected)
            errors.append(f"Unexpected key(s) in state_dict: {keys}")
        for name, ckpt_name in plan.items():
            have, want = source.entries[ckpt_name].shape, named.tensors[name].shape
            if have != want:
                errors.append(
                    f"size mismatch for {name}: copying a param with shape {have} from "
                    f"checkpoint {ckpt_name!r}, the shape in current model is {want}"
                )
        if errors:
            raise RuntimeError(
                f"Error(s) in loading {os.fspath(path)} into {type(model).__name__}:\n\t"
                + "\n\t".join(errors)
            )
        everything = {**named.tensors, **named.transient}
        uninitialised = [n for n, t in everything.items() if t.is_meta and n not in plan]
        if uninitialised:
            raise ValueError(
                f"{type(model).__name__} is on the meta device and {os.fspath(path)} has no "
                f"values for {', '.join(uninitialised)}: non-persistent buffers (e.g. rotary "
                "tables) and tensors missing from the checkpoint would be uninitialised "
                "memory; build or initialise them on a real device before loading"
            )
        if any(t.is_meta for t in everything.values()):
            named = _materialise(model, everything, plan)
        with torch.no_grad():
            for name, ckpt_name in plan.items():
                _load_one(source, ckpt_name, named.tensors[name])
    return LoadResult(missing, unexpected)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _materialise(
    model: nn.Module, everything: dict[str, torch.Tensor], plan: dict[str, str]
) -> Named:
    """``to_empty`` on the engine's device (one shard per rank), keeping the values of the
    tensors that were real already and are not about to be loaded (e.g. rotary tables
    the user built, while the rest of the model is still on meta)."""
    kept = {
        n: _local(t).detach().clone()
        for n, t in everything.items()
        if not t.is_meta and n not in plan
    }
    model.to_empty(device=model_device(model), recurse=True)
    named = named_tensors(model)
    with torch.no_grad():
        for n, t in {**named.tensors, **named.transient}.items():
            if n in kept:
                _local(t).copy_(kept[n])
    return named


def _match(
    named: Named, source: Source, key_map: KeyMap | None
) -> tuple[dict[str, str], list[str]]:
    """``{model name: checkpoint name}`` for every tensor the checkpoint provides (tied
    tensors from their first name if present, else another one), and the unexpected names."""
    plan: dict[str, str] = {}
    unexpected = []
    for target, ckpt_name in renamed(source.entries, key_map, "load_full_checkpoint").items():
        first = named.aliases.get(target, target)
        if first not in named.tensors:
            unexpected.append(ckpt_name)
        elif first == target or first not in plan:
            plan[first] = ckpt_name
    return plan, unexpected


def _box(t: DTensor) -> tuple[slice, ...] | None:
    """The region of the full tensor this rank's shard holds, if it is one box."""
    if not all(
        isinstance(p, (Shard, Replicate)) and type(p) in (Shard, Replicate) for p in t.placements
    ):
        return None  # e.g. _StridedShard: rows interleaved from several places
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape) != tuple(t._local_tensor.shape):
        return None
    return tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


def _load_one(source: Source, ckpt_name: str, t: torch.Tensor) -> None:
    if not isinstance(t, DTensor):
        _fill(t, source.read(ckpt_name, None, out=t))
        return
    local = t._local_tensor
    if local.numel() == 0:
        return
    box = _box(t)
    if box is not None:
        _fill(local, source.read(ckpt_name, box, out=local))
        return
    # Transiently the full tensor; distribute_tensor with src_data_rank=None only slices.
    full = source.read(ckpt_name, None).to(local.dtype)
    local.copy_(
        distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None)._local_tensor
    )


def _fill(dst: torch.Tensor, data: torch.Tensor) -> None:
    if data is not dst:  # read into a temporary: another dtype or device
        dst.copy_(data)


def save_full_checkpoint(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    key_map: KeyMap | None = None,
    writers: int | None = None,
    config: bool = True,
) -> list[str]:
    """Write ``model``'s full tensors as a Hugging Face-compatible safetensors checkpoint.

    Collective: every rank of the default process group calls it with the same arguments.
    Tensors are gathered one at a time to the rank writing their file (one ``gather`` over
    the shard group for FSDP / HSDP layouts, ``DTensor.full_tensor()`` for others) and
    streamed into the file by a writer thread while the next one is gathered, so a rank
    holds at most three full tensors beyond its shards.
    Files are spread over the ranks (file ``i`` is written by rank ``i % writers``); with
    ranks on several nodes, ``path`` must be on a shared filesystem, or pass ``writers=1``.

    Args:
        model: a model sharded with ``fully_shard`` (or any module).
        path: a directory (created if needed) that receives ``model.safetensors`` or, past
            ``max_shard_size``, ``model-0000i-of-0000n.safetensors`` files and
            ``model.safetensors.index.json``, as ``save_pretrained`` writes them; or a
            ``.safetensors`` file name (one file, whatever its size).
        max_shard_size: the largest file, in bytes or as ``"5GB"`` / ``"500MiB"``; a tensor
            larger than it gets a file of its own.
        dtype: cast floating-point tensors to this dtype (e.g. ``torch.bfloat16``) in the
            file; ``None`` keeps each tensor's dtype.
        key_map: renames the model's names to the checkpoint's (see :data:`KeyMap`).
        writers: how many ranks write files (default: all).
        config: for a directory ``path``, also write the model's Hugging Face config
            (``model.config.save_pretrained``, ``config.json``) where it has one, so that
            ``from_pretrained(path)`` builds this model and not transformers' defaults.
            ``False``: weights only.

    A directory is published whole (see [Note: atomic publication] in ``_publish.py``): it is
    written as ``<path>.partial`` and swapped in when complete; files of an older checkpoint
    at ``path`` that are not weights are kept. A save that fails or is killed leaves what was
    at ``path`` before untouched and loadable.

    Returns:
        The paths of the files written (the index last, if any), on every rank.

    Raises:
        ValueError / TypeError: bad arguments, a model still on the meta device, two names
            mapped to one: raised before any collective. ``ValueError`` on every rank, before
            any tensor is gathered, if the ranks would write different checkpoints
            (different models, key maps or arguments on some rank).
        RuntimeError: a rank failed to write (on every rank, naming it; disk full, say);
            nothing is published and an older checkpoint at ``path`` is untouched.
    """
    install_exit_drain()  # its last collective must not abort the exit: [Note: clean exit]
    limit = parse_size(max_shard_size)
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"save_full_checkpoint: dtype must be a floating-point dtype, got {dtype}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if writers is not None and (not isinstance(writers, int) or writers < 1):
        raise ValueError(f"save_full_checkpoint: writers must be a positive int, got {writers!r}")
    n_writers = min(writers or world, world)
    path = os.fspath(path)
    single_file = path.endswith(".safetensors")
    if os.path.isfile(path) and not single_file:
        raise ValueError(
            f"save_full_checkpoint: {path} is a file; pass a directory or a .safetensors name"
        )
    reshard(model)
    named = named_tensors(model)
    on_meta = [name for name, t in named.tensors.items() if t.is_meta]
    if on_meta:
        raise ValueError(f"save_full_checkpoint: {', '.join(on_meta)} are on the meta device")
    specs = _save_specs(named, key_map, dtype)
    files = plan_files(specs, limit, path, single_file)
    check_same_plan(files, n_writers)
    hf_config = _hf_config(model) if config and not single_file else None
    extra = None if hf_config is None else hf_config.save_pretrained
    return write_checkpoint(path, files, n_writers, rank, single_file, extra)


def iter_full_tensors(
    model: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = 64 << 20,
    key_map: KeyMap | None = None,
    ranks: Iterable[int] | None = None,
    merge_lora: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for every tensor of ``model``'s ``state_dict()``, in
    memory, a few all-gathers in all: what an inference engine's weight update takes
    (vLLM's ``load_weights(weights)``, SGLang's ``update_weights_from_tensor``).

    Collective: every rank calls it with the same arguments and iterates to the end.
    Tensors sharded on dim 0 over one mesh dim (FSDP, HSDP; uneven sizes too) are packed
    into buckets of about ``bucket_bytes``, one all-gather per bucket, the
    next bucket's issued while the current one's tensors are handed out; other layouts
    (tensor or expert parallel) are gathered alone with ``full_tensor()``; replicated and
    plain tensors need no collective. See [Note: streamed full tensors] in ``_stream.py``.

    Args:
        model: a model sharded with ``fully_shard`` (or any module), between steps.
        dtype: cast floating-point tensors to it *before* the gather (``torch.bfloat16``
            halves the bytes); ``None`` keeps each tensor's dtype.
        bucket_bytes: the memory of one all-gather's bucket: its gathered tensors and
            this rank's packed rows (a larger tensor goes alone). At most two buckets are
            alive at once, when the consumer drops each tensor once it has handed it on.
        key_map: renames the names (see :data:`KeyMap`); ``None`` drops a tensor.
        ranks: the global ranks that receive; the others run the same collectives and
            yield nothing. ``None``: every rank.
        merge_lora: for a PEFT LoRA model, yield what ``merge_and_unload()`` would leave:
            the base model's names, each base weight with its active adapters merged
            (``W + scale * B @ A``), no adapter tensors; the model is not changed. Each rank
            merges its own rows after the adapters are gathered (they stay in memory
            until the end). LoRA on ``Linear`` and ``Embedding`` layers (also
            ``fan_in_fan_out``, LoRA bias) and ``modules_to_save``; DoRA and other
            variants raise ``ValueError``. Needs ``peft``.

    Yields:
        ``(name, tensor)``: the names of ``state_dict()`` (wrapper parts dropped, as in
        :func:`save_full_checkpoint`), parameters and persistent buffers in state-dict
        order, a tied tensor's other names right after its first (the same tensor); each
        tensor a new full tensor on the model's device (the mesh's), owned by the caller.

    Raises:
        RuntimeError: called inside a forward or backward.
        ValueError / TypeError: bad arguments, a tensor on the meta device, a LoRA layer
            that cannot be merged: raised by the call itself, before any collective.
    """
    phase = step_phase(model)
    if phase is not None:
        raise RuntimeError(
            f"iter_full_tensors: called inside the model's {phase}; call it between steps "
            "(after optimizer.step(), or before the next forward)"
        )
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"iter_full_tensors: dtype must be a floating-point dtype, got {dtype}")
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
        raise ValueError(
            f"iter_full_tensors: bucket_bytes must be a positive int, got {bucket_bytes!r}"
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    receivers = set(range(world)) if ranks is None else set(ranks)
    if not receivers <= set(range(world)):
        raise ValueError(
            f"iter_full_tensors: ranks must be in 0..{world - 1}, got {sorted(receivers)}"
        )
    reshard(model)
    named = named_tensors(model)
    on_meta = [name for name, t in named.tensors.items() if t.is_meta]
    if on_meta:
        raise ValueError(f"iter_full_tensors: {', '.join(on_meta)} are on the meta device")
    terms: dict[str, list[Term]] = {}
    if merge_lora:
        named, terms = merge_view(model, named)
    mapping = renamed(list(named.tensors) + list(named.aliases), key_map, "iter_full_tensors")
    new_name = {old: new for new, old in mapping.items()}
    aliases_of: dict[str, list[str]] = {}
    for alias, first in named.aliases.items():
        if alias in new_name:
            aliases_of.setdefault(first, []).append(new_name[alias])
    entries, merged = [], {}
    for name, t in named.tensors.items():
        cast_to = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if name in new_name:
            entries.append((new_name[name], t, cast_to, aliases_of.get(name, [])))
        elif name in aliases_of:  # dropped, but a tied name is kept: yield it under that
            first, *rest = aliases_of[name]
            entries.append((first, t, cast_to, rest))
        else:
            continue
        if name in terms:
            merged[entries[-1][0]] = terms[name]
    return stream(plan(entries, merged), bucket_bytes, receive=rank in receivers)


def _hf_config(model: nn.Module) -> Any:
    """``model.config`` where it is a Hugging Face config (has ``save_pretrained``)."""
    cfg = getattr(model, "config", None)
    return cfg if callable(getattr(cfg, "save_pretrained", None)) else None


def _save_specs(named: Named, key_map: KeyMap | None, dtype: torch.dtype | None) -> dict[str, Spec]:
    specs: dict[str, Spec] = {}
    for ckpt_name, name in renamed(named.tensors, key_map, "save_full_checkpoint").items():
        tensor = named.tensors[name]
        out = dtype if dtype is not None and tensor.dtype.is_floating_point else tensor.dtype
        st_dtype(out, f"save_full_checkpoint: {name}")
        plain(_local(tensor), name)  # a subclass without plain values: TypeError on every rank
        specs[ckpt_name] = Spec(name, tensor, tensor.shape, out)
    return specs
