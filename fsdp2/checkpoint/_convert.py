"""Checkpoint conversion for ``fsdp2 convert`` (fsdp2/cli/__init__.py, docs/cli.md): any checkpoint
``_inspect.open_checkpoint`` reads (DCP, safetensors, a ``torch.save`` file) into a Hugging
Face safetensors folder (or one ``.safetensors`` file) or a DCP folder.

# [Note: streamed conversion]
# A model larger than the machine's memory converts: no step holds more than one tensor
# (plus, while it is read, the piece of it being read).
# * Reading: a DCP tensor comes from one ``dcp.load(..., no_dist=True)`` into a tensor
#   allocated for it alone (``_inspect._DcpSource``); a safetensors tensor is read into a
#   fresh tensor with ``readinto``; a ``torch.save`` file is memory-mapped.
# * Writing safetensors: each file's header is known from the shapes before any tensor is
#   read (``plan_files``, save_pretrained's cut at ``max_shard_size``), so each tensor is
#   appended to its file as soon as it is read (``StreamWriter``) and dropped.
# * Writing DCP: ``dcp.save`` plans from meta tensors (shapes and dtypes only); the planner's
#   ``resolve_data``, which the writer calls for each tensor as it writes it, reads that
#   tensor then (``_Planner``). One ``.distcp`` file per tensor: DCP's writer keeps the
#   tensors of a file until the file is complete.
# Publication: the output is written as ``<dst>.partial`` (a folder, or a file) and renamed
# to ``dst`` once complete (see [Note: atomic publication] in _publish.py), so a crash or
# Ctrl-C leaves no ``dst`` that looks complete; the next conversion removes the leftover.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fsdp2.checkpoint._files import SAFETENSORS_INDEX, StreamWriter, st_dtype
from fsdp2.checkpoint._inspect import Checkpoint, TensorInfo, unwrap_dcp_errors
from fsdp2.checkpoint._publish import fsync_dir, prepare_stage, replace_dir
from fsdp2.checkpoint._save import Spec, finish_dir, plan_files

__all__ = ["Written", "out_dtype", "resolve_config", "write_dcp", "write_safetensors"]


@dataclass
class Written:
    """What a conversion wrote."""

    files: list[str]
    """The files under ``dst`` (weights, then the index and config if any)."""
    tensors: int
    bytes: int


def out_dtype(info: TensorInfo, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``info``'s tensor is written in: ``dtype`` for a floating-point tensor."""
    return dtype if dtype is not None and info.dtype.is_floating_point else info.dtype


def _progress(total: int, show: bool) -> Any:
    """A tqdm bar over bytes on stderr, or one that does nothing."""
    if not show:
        return _NoBar()
    try:  # tqdm comes with transformers and huggingface_hub; not a dependency of fsdp2
        tqdm = importlib.import_module("tqdm").tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert")


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def write_safetensors(
    ckpt: Checkpoint,
    kept: dict[str, str],
    dst: str,
    *,
    dtype: torch.dtype | None,
    max_shard_size: int,
    config: str | None,
    progress: bool,
) -> Written:
    """Write ``kept`` (``{name in dst: name in ckpt}``) as a Hugging Face safetensors folder
    ``dst`` (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files of at most
    ``max_shard_size`` bytes and ``model.safetensors.index.json``; ``config`` copied in as
    ``config.json``), or as one file when ``dst`` ends in ``.safetensors``. Replaces what is
    at ``dst`` only once complete. See [Note: streamed conversion].

    Raises:
        TypeError: a tensor's dtype cannot be stored in safetensors (nothing written).
    """
    single = dst.endswith(".safetensors")
    specs: dict[str, Spec] = {}
    for out, name in kept.items():
        info = ckpt.tensors[name]
        to = out_dtype(info, dtype)
        st_dtype(to, name)  # before anything is written
        specs[out] = Spec(name, torch.empty(0, device="meta"), torch.Size(info.shape), to)
    files = plan_files(specs, max_shard_size, dst, single)
    stage = os.path.dirname(os.path.abspath(dst)) if single else prepare_stage(dst)
    total = sum(s.shape.numel() * s.dtype.itemsize for s in specs.values())
    bar = _progress(total, progress)
    writer: StreamWriter | None = None
    try:
        for file, members in files:
            writer = StreamWriter(
                os.path.join(stage, os.path.basename(file)),
                [(out, s.shape, s.dtype) for out, s in members],
            )
            names = [s.name for _, s in members]
            for (out, spec), (_, tensor) in zip(members, ckpt.read(names), strict=True):
                data = tensor.to(spec.dtype).contiguous()
                del tensor
                writer.write(out, data)
                bar.update(data.nbytes)
                del data
            writer.commit()
            writer.publish()
            writer = None
        if single:
            return Written([dst], len(specs), total)
        finish_dir(stage, files)
        written = [file for file, _ in files]
        if len(files) > 1:
            written.append(os.path.join(dst, SAFETENSORS_INDEX))
        if config is not None:
            shutil.copyfile(config, os.path.join(stage, "config.json"))
            written.append(os.path.join(dst, "config.json"))
        _publish_dir(stage, dst)
        return Written(written, len(specs), total)
    except BaseException:
        if writer is not None:
            writer.abort()
        if not single:
            shutil.rmtree(stage, ignore_errors=True)
        raise
    finally:
        bar.close()


def write_dcp(
    ckpt: Checkpoint,
    kept: dict[str, str],
    dst: str,
    *,
    dtype: torch.dtype | None,
    config: str | None,
    progress: bool,
) -> Written:
    """Write ``kept`` (``{name in dst: name in ckpt}``) as a ``torch.distributed.checkpoint``
    folder ``dst`` (a ``.distcp`` file per tensor and ``.metadata``, loadable by ``dcp.load``
    into any sharding), read tensor by tensor as DCP writes them; ``config`` copied in as
    ``config.json``. Replaces what is at ``dst`` only once complete. See
    [Note: streamed conversion]."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    to = {out: out_dtype(ckpt.tensors[name], dtype) for out, name in kept.items()}
    total = sum(ckpt.tensors[name].numel * to[out].itemsize for out, name in kept.items())
    bar = _progress(total, progress)

    class _Planner(DefaultSavePlanner):
        # dcp.save plans from the meta tensors below; the writer calls resolve_data for each
        # tensor just before writing it, so it is read only then.
        def resolve_data(self, write_item: Any) -> Any:
            if write_item.tensor_data is None:  # not a tensor (there are none here)
                return super().resolve_data(write_item)
            out = write_item.index.fqn
            ((_, tensor),) = ckpt.read([kept[out]])
            data = tensor.to(to[out]).contiguous()
            bar.update(data.nbytes)
            return data

    state = {
        out: torch.empty(ckpt.tensors[name].shape, dtype=to[out], device="meta")
        for out, name in kept.items()
    }
    stage = prepare_stage(dst)
    try:
        # A file per tensor: DCP's writer keeps every tensor of a file alive until the file
        # is done (for its safetensors format), so one file for all would hold the model.
        writer = FileSystemWriter(stage, single_file_per_rank=False, sync_files=True)
        # "assuming the intent is to save in a single process": it is
        with warnings.catch_warnings(), unwrap_dcp_errors():
            warnings.simplefilter("ignore", UserWarning)
            save(state, storage_writer=writer, planner=_Planner(), no_dist=True)
        if config is not None:
            shutil.copyfile(config, os.path.join(stage, "config.json"))
        # in the order written: .metadata, then __0_0.distcp, __0_1.distcp, ... __0_10.distcp
        names = sorted(
            os.listdir(stage),
            key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)],
        )
        _publish_dir(stage, dst)
        return Written([os.path.join(dst, n) for n in names], len(kept), total)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    finally:
        bar.close()


def _publish_dir(stage: str, dst: str) -> None:
    """Put the finished folder ``stage`` at ``dst`` (see [Note: atomic publication]); a
    file at ``dst`` (``--overwrite``) is removed first."""
    if os.path.isfile(dst) or os.path.islink(dst):
        os.remove(dst)
    replace_dir(stage, dst)
    fsync_dir(os.path.dirname(os.path.abspath(dst)))


def resolve_config(path: str, fail: Callable[[str], Exception]) -> str:
    """A ``--config`` argument as a file: a ``config.json``, or a folder holding one."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise fail(f"--config {path}: no such file (a config.json, or a folder holding one)")
    return path
