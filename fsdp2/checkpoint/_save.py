"""Saving for ``fsdp2.checkpoint``: the file plan, gathering each tensor to the rank that
writes it, the writer thread, agreement on errors and publication.

# [Note: gathering to the writer]
# Only the rank writing a tensor's file needs its full value. A tensor sharded on dim 0
# over one mesh dim (FSDP's ``Shard(0)``, HSDP's ``(Replicate(), Shard(0))``) is gathered
# with one ``dist.gather`` to that rank over the shard group that contains it: each rank
# sends its (padded) rows once, only the writer receives, and ranks of other replica
# groups take no part. Total traffic is one copy of the model, not one per rank as with
# an all-gather. Other layouts (tensor parallel, ``_StridedShard``, 0-dim) use
# ``DTensor.full_tensor()`` on every rank of the mesh. Every rank decides alike from the
# tensor's layout and the writer's rank, so each process group sees the same collectives
# in the same order.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import re
import shutil
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fsdp2.checkpoint._files import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, StreamWriter
from fsdp2.checkpoint._publish import carry_over, prepare_stage, replace_dir, stage_of

__all__ = [
    "Spec",
    "check_same_plan",
    "comm_device",
    "coordinates",
    "full_on_mesh",
    "gather_to",
    "plain",
    "parse_size",
    "plan_files",
    "write_checkpoint",
]

_SHARD_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


def write_checkpoint(
    path: str,
    files: list[tuple[str, list[tuple[str, Spec]]]],
    n_writers: int,
    rank: int,
    single_file: bool,
    extra: Callable[[str], None] | None = None,
) -> list[str]:
    """Gather every tensor to the rank writing its file, stream it there, publish the files
    when all ranks succeeded (see [Note: atomic publication] in _publish.py). ``extra(dir)``
    runs on rank 0 before publication, to add files (the Hugging Face config). Collective."""
    error: str | None = None
    stage = os.path.dirname(path) if single_file else stage_of(path)
    if rank == 0:
        try:
            if single_file:
                if stage:
                    os.makedirs(stage, exist_ok=True)
            else:
                prepare_stage(path)
        except Exception as e:
            error = f"{type(e).__name__} preparing {stage}: {e}"
    failed = agree(error)  # collective: the stage exists before any rank writes into it
    if failed:
        raise RuntimeError(f"save_full_checkpoint({path}) failed, nothing was published: {failed}")
    staged = (
        files if single_file else [(os.path.join(stage, os.path.basename(f)), m) for f, m in files]
    )
    writers_of: dict[int, StreamWriter] = {}
    try:
        for i, (file, members) in enumerate(staged):
            if i % n_writers == rank:
                writers_of[i] = StreamWriter(file, [(n, s.shape, s.dtype) for n, s in members])
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    disk = Disk() if writers_of else None
    try:
        for i, (ckpt_name, spec) in interleaved(files):
            full = gather_to(spec.tensor, spec.dtype, spec.name, i % n_writers, rank)
            writer = writers_of.get(i)
            if disk is not None and writer is not None and full is not None and error is None:
                disk.put(writer, ckpt_name, full)
            del full
    except BaseException:  # a collective failed: no rank publishes anything
        if disk is not None:
            disk.close()
        for writer in writers_of.values():
            writer.abort()
        raise
    if disk is not None:
        error = error or disk.close()
    if error is None:
        try:
            for writer in writers_of.values():
                writer.commit()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    failed = agree(error)
    if failed:
        _discard(writers_of, stage, rank, single_file)
        raise RuntimeError(f"save_full_checkpoint({path}) failed, nothing was published: {failed}")
    try:
        for writer in writers_of.values():
            writer.publish()  # within the stage, for a folder: see [Note: atomic publication]
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    failed = agree(error)
    if not failed and rank == 0 and not single_file:
        try:
            finish_dir(stage, files)
            if extra is not None:
                extra(stage)
            carry_over(path, stage, _SHARD_FILE, SAFETENSORS_INDEX)
            replace_dir(stage, path)
        except Exception as e:
            error = f"{type(e).__name__} publishing {path}: {e}"
    failed = agree(error)
    if failed:
        _discard(writers_of, stage, rank, single_file)
        raise RuntimeError(f"save_full_checkpoint({path}) failed, nothing was published: {failed}")
    written = [file for file, _ in files]
    if len(files) > 1:
        written.append(os.path.join(path, SAFETENSORS_INDEX))
    return written


def _discard(writers_of: dict[int, StreamWriter], stage: str, rank: int, single_file: bool) -> None:
    """After a failure every rank agreed on: delete this rank's partial files, and (rank 0)
    the stage. Best effort: the error being raised is the one to report."""
    for writer in writers_of.values():
        with contextlib.suppress(OSError):
            writer.abort()
    if rank == 0 and not single_file:
        shutil.rmtree(stage, ignore_errors=True)


class Disk:
    """Appends gathered tensors to their files on a background thread, so the next gather
    overlaps the write (both release the GIL); at most one tensor waits in between, so a
    rank holds at most three full tensors (gathering, waiting, being written)."""

    def __init__(self) -> None:
        self.error: str | None = None
        self._queue: queue.Queue[tuple[StreamWriter, str, torch.Tensor] | None]
        self._queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._run, name="fsdp2-ckpt-writer", daemon=True)
        self._thread.start()

    def put(self, writer: StreamWriter, name: str, tensor: torch.Tensor) -> None:
        self._queue.put((writer, name, tensor))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            writer, name, tensor = item
            if self.error is None:
                try:
                    writer.write(name, tensor)
                except Exception as e:
                    self.error = f"{type(e).__name__} writing {writer.tmp}: {e}"
            del item, tensor

    def close(self) -> str | None:
        """Wait for the queued writes; the first error, if any."""
        self._queue.put(None)
        self._thread.join()
        return self.error


class Spec(NamedTuple):
    name: str  # the model's name (for errors)
    tensor: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype  # in the file


def plan_files(
    specs: dict[str, Spec], limit: int, path: str, single_file: bool
) -> list[tuple[str, list[tuple[str, Spec]]]]:
    """Tensors in order, cut into files of at most ``limit`` bytes (save_pretrained's rule)."""
    groups: list[list[tuple[str, Spec]]] = [[]]
    size = 0
    for ckpt_name, spec in specs.items():
        nbytes = spec.shape.numel() * spec.dtype.itemsize
        if not single_file and groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append((ckpt_name, spec))
        size += nbytes
    if single_file:
        return [(path, groups[0])]
    if len(groups) == 1:
        return [(os.path.join(path, SAFETENSORS_SINGLE), groups[0])]
    n = len(groups)
    return [
        (os.path.join(path, f"model-{i + 1:05d}-of-{n:05d}.safetensors"), g)
        for i, g in enumerate(groups)
    ]


def interleaved(
    files: list[tuple[str, list[tuple[str, Spec]]]],
) -> list[tuple[int, tuple[str, Spec]]]:
    """Round-robin over the files, so every writer has work in every round."""
    order = []
    for k in range(max(len(members) for _, members in files)):
        for i, (_, members) in enumerate(files):
            if k < len(members):
                order.append((i, members[k]))
    return order


def plain(t: torch.Tensor, name: str) -> torch.Tensor:
    """A plain tensor of ``t``'s values: a wrapper subclass holding one tensor of its dtype
    (e.g. torchao's float8 training weight) gives that tensor."""
    t = t.detach()
    wrapper: Any = t
    while type(t) is not torch.Tensor and is_traceable_wrapper_subclass(wrapper):
        inner_names, _ = wrapper.__tensor_flatten__()
        inner = getattr(wrapper, inner_names[0]) if len(inner_names) == 1 else None
        if inner is None or inner.dtype != t.dtype or inner.shape != t.shape:
            raise TypeError(
                f"save_full_checkpoint: {name} is a {type(t).__qualname__}, which has no "
                "plain tensor of its values; save it with torch.distributed.checkpoint"
            )
        t = wrapper = inner
    return t


def comm_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def row_layout(t: DTensor) -> bool:
    """Whether ``t`` is sharded on tensor dim 0 over at most one mesh dim and replicated on
    the others (FSDP, HSDP), so that each shard is a run of rows; not tensor parallel,
    strided or 0-dim."""
    placements = t.placements
    if t.dim() == 0 or any(type(p) not in (Shard, Replicate) for p in placements):
        return False
    sharded = [p for p in placements if isinstance(p, Shard)]
    return len(sharded) == 0 or (len(sharded) == 1 and sharded[0].dim == 0)


def shard_dim(t: DTensor) -> int | None:
    """The mesh dim ``t`` is sharded over (of a ``row_layout`` tensor); ``None``: none."""
    return next((i for i, p in enumerate(t.placements) if isinstance(p, Shard)), None)


def coordinates(mesh: DeviceMesh, dim: int, group: dist.ProcessGroup) -> list[int]:
    """For each rank of ``group`` (``mesh``'s group along ``dim``), its coordinate on
    ``dim``: where its rows go in the full tensor."""
    ranks = mesh.mesh
    return [int((ranks == g).nonzero()[0][dim]) for g in dist.get_process_group_ranks(group)]


def gather_to(
    t: torch.Tensor, dtype: torch.dtype, name: str, owner: int, rank: int
) -> torch.Tensor | None:
    """``t``'s full value in ``dtype``, a contiguous CPU tensor, on rank ``owner``; ``None``
    on other ranks. See [Note: gathering to the writer]."""
    if not isinstance(t, DTensor):
        return plain(t, name).to(dtype).to("cpu").contiguous() if rank == owner else None
    plan = _row_plan(t, owner)
    if plan is None:
        full = full_on_mesh(t, dtype, name).to("cpu").contiguous()
        return full if rank == owner else None
    dim, same_group = plan
    if not same_group:
        return None
    mesh = t.device_mesh
    local = plain(t._local_tensor, name)
    if dim is None or mesh.size(dim) == 1 or t.numel() == 0:
        return local.to(dtype).to("cpu").contiguous() if rank == owner else None
    device, size, rows = comm_device(mesh), mesh.size(dim), t.shape[0]
    chunk = -(-rows // size)
    piece = torch.zeros((chunk, *t.shape[1:]), dtype=dtype, device=device)
    piece[: local.shape[0]].copy_(local)
    group = mesh.get_group(dim)
    if rank != owner:
        dist.gather(piece, None, dst=owner, group=group)
        return None
    out = torch.empty((size * chunk, *t.shape[1:]), dtype=dtype, device=device)
    pieces = out.split(chunk)
    at = coordinates(mesh, dim, group)
    dist.gather(piece, [pieces[k] for k in at], dst=owner, group=group)
    return out[:rows].to("cpu").contiguous()


def _row_plan(t: DTensor, owner: int) -> tuple[int | None, bool] | None:
    """For a ``row_layout`` DTensor: ``(its shard mesh dim or None, whether this rank is in
    the owner's shard group)``; ``None`` for other layouts."""
    if not row_layout(t):
        return None
    mesh = t.device_mesh
    hit = (mesh.mesh == owner).nonzero()
    me = mesh.get_coordinate()
    if len(hit) == 0 or me is None:
        return None
    dim = shard_dim(t)
    theirs = hit[0].tolist()
    return dim, all(a == b for k, (a, b) in enumerate(zip(me, theirs, strict=True)) if k != dim)


def full_on_mesh(t: DTensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """Every rank of ``t``'s mesh gets the full value in ``dtype``, on the mesh's device
    (``full_tensor()``: any layout; collective)."""
    mesh = t.device_mesh
    local = plain(t._local_tensor, name).to(device=comm_device(mesh), dtype=dtype)
    spread = DTensor.from_local(
        local, mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )
    return spread.full_tensor()


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: int | str, what: str = "save_full_checkpoint: max_shard_size") -> int:
    """Bytes of ``size``: a positive int, or a string like ``'5GB'`` or ``'500MiB'``."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
        if m and m.group(2).upper() in _UNITS and float(m.group(1)) > 0:
            return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    raise ValueError(
        f"{what} must be a positive number of bytes or a size like '5GB' or '500MiB', got {size!r}"
    )


def check_same_plan(files: list[tuple[str, list[tuple[str, Spec]]]], n_writers: int) -> None:
    """Raise ``ValueError`` on every rank, before any tensor is gathered, unless every rank
    is about to write the same files with the same tensors (names, shapes, dtypes): ranks
    with different models, key maps or arguments would otherwise gather mismatched tensors
    (a hang, or a garbled file). One small collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    plan: list[Any] = [("writers", n_writers)] + [
        (file, name, tuple(s.shape), str(s.dtype)) for file, members in files for name, s in members
    ]
    digest = hashlib.sha256(repr(plan).encode()).hexdigest()
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return
    plans: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(plans, plan)
    diffs = []
    for r, other in enumerate(plans):
        if other == plans[0]:
            continue
        pairs = enumerate(zip(plans[0], other, strict=False))
        k = next((i for i, (a, b) in pairs if a != b), None)
        if k is None:
            diffs.append(f"rank {r} has {len(other) - 1} tensors, rank 0 {len(plans[0]) - 1}")
        else:
            diffs.append(f"rank 0 has {plans[0][k]!r} where rank {r} has {other[k]!r}")
    raise ValueError(
        "save_full_checkpoint: the ranks would write different checkpoints (different models, "
        "key_map, path, dtype, max_shard_size or writers?): " + "; ".join(diffs)
    )


def agree(error: str | None) -> str:
    """Every rank's error (``""`` if none): a collective, so all ranks decide alike."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return f"rank 0: {error}" if error else ""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error)
    return "; ".join(f"rank {r}: {e}" for r, e in enumerate(gathered) if e)


def finish_dir(path: str, files: list[tuple[str, list[tuple[str, Spec]]]]) -> None:
    """Rank 0, in the stage ``path`` once every file is in it: the index, if several files."""
    if len(files) > 1:
        weight_map = {ck: os.path.basename(file) for file, members in files for ck, _ in members}
        total = sum(s.shape.numel() * s.dtype.itemsize for _, m in files for _, s in m)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(path, SAFETENSORS_INDEX), "w") as f:
            json.dump(index, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
