"""Any checkpoint on disk, read one tensor at a time, and what it holds: the engine of
``fsdp2 inspect`` and ``fsdp2 convert`` (fsdp2/cli/__init__.py, docs/cli.md).

Three formats, told apart by what is on disk:

* a ``torch.distributed.checkpoint`` (DCP) folder: a ``.metadata`` file and ``*.distcp``
  files, as ``dcp.save`` writes them (fsdp2, torch's FSDP2, FSDP1's ``SHARDED_STATE_DICT``);
* safetensors: a ``.safetensors`` file, a ``model.safetensors.index.json``, or a folder
  holding one (or some ``*.safetensors`` files);
* a ``torch.save`` file (``.pt``, ``.bin``, ...): a state dict, possibly nested
  (``{"model": ..., "optim": ...}``), as FSDP1's ``FULL_STATE_DICT`` saves from rank 0.

# [Note: the model's tensors]
# A training checkpoint often holds more than the model: DCP of ``{"model": model_sd,
# "optim": optim_sd}`` flattens to ``model.<name>`` and ``optim.state.<...>.exp_avg`` keys,
# plus non-tensor objects (``optim.param_groups.0.lr``, a step counter). A safetensors file
# can hold only the weights, so ``model_prefix`` decides which tensors are the model's:
# when the top-level names are ``model`` and only training-state names beside it
# (``optim``, ``lr_scheduler``, ``step``, ... in ``_TRAINING_STATE``), the model is what is
# under ``model.``, with the prefix stripped. Otherwise (a plain ``dcp.save(model.state_dict())``,
# whose own top level may well be ``model`` and ``lm_head`` in a Hugging Face causal LM)
# every tensor is the model's except those under a training-state name. The caller may
# name the prefix instead (``--prefix``; ``""``: every tensor).
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdp2.checkpoint._files import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, Source, open_source

__all__ = [
    "Checkpoint",
    "TensorInfo",
    "model_prefix",
    "open_checkpoint",
    "select",
    "size_text",
    "summary",
    "table",
    "unwrap_dcp_errors",
]

_DCP_METADATA = ".metadata"
_OPTIMIZER = frozenset({"optim", "optimizer", "optimizers", "optim_state", "optimizer_state"})
_TRAINING_STATE = _OPTIMIZER | frozenset(
    "lr_scheduler lr_schedulers scheduler schedulers step steps epoch rng rng_state dataloader "
    "data_loader train_state trainer scaler grad_scaler".split()
)
# Per-parameter state names of torch's optimizers (and fsdp2's Muon): a tensor whose last
# name part is one of these is optimizer state wherever it sits.
_OPTIMIZER_STATE = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta"}
)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint."""

    shape: tuple[int, ...]
    """Its full shape."""
    dtype: torch.dtype
    """Its dtype on disk."""
    chunks: int = 1
    """How many pieces it is stored in (DCP: one per rank shard that saved it)."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class Checkpoint:
    """A checkpoint on disk: its tensors' names, shapes and dtypes (``tensors``, in the
    checkpoint's order), its other entries (``objects``: DCP's pickled values, a torch.save
    file's ints and strings), and :meth:`read` for their values. Use as a context manager."""

    path: str
    format: str  # "dcp", "safetensors" or "torch"
    tensors: dict[str, TensorInfo]
    objects: list[str]
    files: list[str]
    ranks: int | None = None  # DCP: how many ranks wrote it
    _source: Any = field(default=None, repr=False)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        if isinstance(self._source, Source):
            self._source.__exit__()
        self._source = None

    def read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full CPU tensor in its dtype on disk)`` for ``names``, in that order.
        A tensor yielded is the caller's (dropping it frees it): DCP reads one tensor at a
        time, safetensors reads into a fresh tensor, torch.save files hand out a
        memory-mapped tensor."""
        for name in names:
            if isinstance(self._source, _DcpSource):
                yield name, self._source.read(name, self.tensors[name])
            elif isinstance(self._source, Source):  # safetensors, a pytorch_model.bin folder
                yield name, self._source.read(name, None)
            else:  # a torch.save file, flattened
                yield name, self._source[name]


def open_checkpoint(path: str) -> Checkpoint:
    """The checkpoint at ``path`` (see the module docstring for the formats).

    Raises:
        FileNotFoundError: ``path`` does not exist, or is a folder holding no checkpoint
            (the message lists what was looked for).
        ValueError: a file that cannot be read as the checkpoint it looks like.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or folder")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, _DCP_METADATA)):
            return _open_dcp(path)
        named = [SAFETENSORS_INDEX, SAFETENSORS_SINGLE, "pytorch_model.bin.index.json"]
        named.append("pytorch_model.bin")
        if any(os.path.isfile(os.path.join(path, n)) for n in named):
            return _open_source(path)
        loose = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if loose:
            return _open_source(path, loose)
        raise FileNotFoundError(
            f"{path}: a folder that holds no checkpoint: no {_DCP_METADATA} (a "
            f"torch.distributed.checkpoint folder), no {SAFETENSORS_INDEX}, "
            f"{SAFETENSORS_SINGLE} or other *.safetensors file, no pytorch_model.bin"
        )
    if path.endswith((".safetensors", ".json")):
        return _open_source(path)
    if os.path.basename(path) == _DCP_METADATA:
        return _open_dcp(os.path.dirname(path) or ".")
    return _open_torch(path)


def _open_source(path: str, loose: list[str] | None = None) -> Checkpoint:
    """Safetensors (or a Hugging Face ``pytorch_model.bin`` folder) through ``_files``."""
    if loose is None:
        source = open_source(path)
    else:
        source = Source()
        try:
            for name in loose:
                source.add_safetensors(os.path.join(path, name))
        except BaseException:
            source.__exit__()
            raise
    tensors = {n: TensorInfo(tuple(e.shape), e.dtype) for n, e in source.entries.items()}
    files = sorted({e.file for e in source.entries.values()})
    fmt = "safetensors" if all(f.endswith(".safetensors") for f in files) else "torch"
    return Checkpoint(path, fmt, tensors, [], files, _source=source)


def _open_torch(path: str) -> Checkpoint:
    """A ``torch.save`` file of a (possibly nested) state dict, memory-mapped."""
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError:  # the legacy (pre-zip) format cannot be memory-mapped
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"{path}: not a checkpoint torch.load can read: {e}") from e
    except Exception as e:  # pickle errors, a file that is no torch.save at all
        raise ValueError(f"{path}: not a checkpoint torch.load can read: {e}") from e
    if not isinstance(loaded, dict):
        raise ValueError(
            f"{path}: torch.load gives a {type(loaded).__name__}, not a state dict "
            "({name: tensor}, or a dict of them)"
        )
    flat: dict[str, torch.Tensor] = {}
    objects: list[str] = []
    _flatten(loaded, "", flat, objects)
    tensors = {n: TensorInfo(tuple(t.shape), t.dtype) for n, t in flat.items()}
    return Checkpoint(path, "torch", tensors, objects, [path], _source=flat)


def _flatten(value: Any, prefix: str, flat: dict[str, torch.Tensor], objects: list[str]) -> None:
    """Nested dicts and lists to dotted names, as DCP flattens a state dict."""
    if isinstance(value, torch.Tensor):
        flat[prefix] = value
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), flat, objects)
    elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), flat, objects)
    else:
        objects.append(prefix)


class _DcpSource:
    """Reads full tensors out of a DCP folder without a process group: one ``dcp.load``
    (``no_dist=True``) per tensor into a tensor allocated for it, so memory holds that
    tensor and the piece of it being read, never the model. The metadata is read once."""

    def __init__(self, path: str) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        class _Reader(FileSystemReader):
            # dcp.load reads the metadata on every call: a 70B checkpoint's, saved by
            # hundreds of ranks, takes a while to unpickle, so it is kept.
            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                if not cached:
                    cached.append(super().read_metadata(*args, **kwargs))
                return cached[0]

        cached: list[Any] = []
        self.reader = _Reader(path)
        self.metadata = self.reader.read_metadata()

    def read(self, name: str, info: TensorInfo) -> torch.Tensor:
        from torch.distributed.checkpoint.state_dict_loader import load

        out = torch.empty(info.shape, dtype=info.dtype)
        with warnings.catch_warnings(), unwrap_dcp_errors():
            # "torch.distributed is disabled ... assuming the intent is to load in a single
            # process": exactly the intent.
            warnings.simplefilter("ignore", UserWarning)
            try:
                load({name: out}, storage_reader=self.reader, no_dist=True)
            except Exception as e:  # a truncated or damaged .distcp file
                raise ValueError(f"{self.reader.path}: cannot read tensor {name!r}: {e}") from e
        return out


@contextlib.contextmanager
def unwrap_dcp_errors() -> Iterator[None]:
    """Raise the error DCP met instead of its ``CheckpointException`` (a ``BaseException``
    holding a traceback per rank: here there is one rank, and its error is the message)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        failures = list(e.failures.values())
        exc = failures[0][0] if failures else None
        if isinstance(exc, BaseException):
            raise exc from None
        raise


def _open_dcp(path: str) -> Checkpoint:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        source = _DcpSource(path)
    except Exception as e:  # a truncated or foreign .metadata: unpickling errors vary
        raise ValueError(f"{path}: unreadable {_DCP_METADATA} (not a DCP checkpoint?): {e}") from e
    tensors: dict[str, TensorInfo] = {}
    objects: list[str] = []
    for name, md in source.metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[name] = TensorInfo(tuple(md.size), md.properties.dtype, len(md.chunks))
        else:
            objects.append(name)
    storage = getattr(source.metadata, "storage_data", None) or {}
    files = sorted({os.path.join(path, info.relative_path) for info in storage.values()})
    # FileSystemWriter names its files __<rank>_<n>.distcp
    ranks = {m.group(1) for f in files if (m := re.match(r"__(\d+)_", os.path.basename(f)))}
    return Checkpoint(path, "dcp", tensors, objects, files, len(ranks) or None, _source=source)


def model_prefix(names: list[str]) -> str | None:
    """``"model."`` where the checkpoint is ``{"model": ..., <training state>}``; else
    ``None``. See [Note: the model's tensors]."""
    tops = {name.split(".", 1)[0] for name in names}
    if "model" in tops and len(tops) > 1 and tops - {"model"} <= _TRAINING_STATE:
        return "model."
    return None


def _training_state(name: str) -> bool:
    return name.split(".", 1)[0] in _TRAINING_STATE or name.rsplit(".", 1)[-1] in _OPTIMIZER_STATE


def select(ckpt: Checkpoint, prefix: str | None) -> tuple[dict[str, str], str | None]:
    """The model's tensors: ``{output name: checkpoint name}`` in checkpoint order, and the
    prefix stripped (``None``: none). ``prefix=None`` decides as [Note: the model's tensors]
    says; a string keeps the tensors under it, stripped (``""``: every tensor)."""
    if prefix is None:
        prefix = model_prefix(list(ckpt.tensors) + ckpt.objects)
        if prefix is None:
            return {n: n for n in ckpt.tensors if not _training_state(n)}, None
    kept = {n[len(prefix) :]: n for n in ckpt.tensors if n.startswith(prefix)}
    return kept, prefix or None


def _optimizer_state(ckpt: Checkpoint, kept: set[str]) -> list[str]:
    return [
        n
        for n in ckpt.tensors
        if n not in kept
        and (n.split(".", 1)[0] in _OPTIMIZER or n.rsplit(".", 1)[-1] in _OPTIMIZER_STATE)
    ]


def _dtype_totals(infos: list[TensorInfo]) -> dict[str, dict[str, int]]:
    totals: dict[str, dict[str, int]] = {}
    for info in infos:
        t = totals.setdefault(_dtype_name(info.dtype), {"tensors": 0, "elements": 0, "bytes": 0})
        t["tensors"] += 1
        t["elements"] += info.numel
        t["bytes"] += info.nbytes
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]["bytes"]))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def summary(ckpt: Checkpoint, prefix: str | None = None) -> dict[str, Any]:
    """What ``ckpt`` holds, as plain data (``fsdp2 inspect --json``): the model's tensors
    (as ``select`` finds them) with totals per dtype, the rest (optimizer state, other
    tensors, objects), and every tensor's shape, dtype and chunks."""
    kept, stripped = select(ckpt, prefix)
    model = [ckpt.tensors[n] for n in kept.values()]
    names = set(kept.values())
    optim = _optimizer_state(ckpt, names)
    other = [n for n in ckpt.tensors if n not in names and n not in set(optim)]
    chunks = sorted({info.chunks for info in model})
    return {
        "path": ckpt.path,
        "format": ckpt.format,
        "files": len(ckpt.files),
        "bytes_on_disk": sum(os.path.getsize(f) for f in ckpt.files if os.path.isfile(f)),
        "ranks": ckpt.ranks,
        "chunks_per_tensor": chunks,  # of the model's tensors
        "model_prefix": stripped,
        "model": {
            "tensors": len(model),
            "parameters": sum(i.numel for i in model),
            "bytes": sum(i.nbytes for i in model),
            "dtypes": _dtype_totals(model),
        },
        "optimizer_state": {
            "present": bool(optim),
            "tensors": len(optim),
            "bytes": sum(ckpt.tensors[n].nbytes for n in optim),
        },
        "other_tensors": other,
        "objects": list(ckpt.objects),
        "tensors": [
            {
                "name": n,
                "shape": list(info.shape),
                "dtype": _dtype_name(info.dtype),
                "bytes": info.nbytes,
                "chunks": info.chunks,
                "model": n in names,
            }
            for n, info in ckpt.tensors.items()
        ],
    }


def size_text(n: int) -> str:
    """``n`` bytes for a person: ``512 B``, ``1.50 KiB``, ``3.74 GiB``."""
    if n < 1024:
        return f"{n} B"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.2f} {unit}"


_FORMATS = {
    "dcp": "torch.distributed.checkpoint (DCP) folder",
    "safetensors": "safetensors",
    "torch": "torch.save file",
}


def _grouped(rows: list[tuple[str, str, str, str]]) -> list[tuple[str, str, str, str]]:
    """Rows (name, shape, dtype, chunks) with numbered names folded: the 32 layers'
    ``model.layers.N.mlp.up_proj.weight`` of one shape and dtype become one row
    ``model.layers.{0..31}.mlp.up_proj.weight``, placed where its first one was."""
    groups: dict[tuple[tuple[str, ...], str, str, str], list[tuple[int, ...]]] = {}
    for name, shape, dtype, chunks in rows:
        parts = name.split(".")
        numbers = tuple(int(p) for p in parts if p.isdigit())
        pattern = tuple("" if p.isdigit() else p for p in parts)  # "": a numbered part
        groups.setdefault((pattern, shape, dtype, chunks), []).append(numbers)
    out = []
    for (pattern, shape, dtype, chunks), members in groups.items():
        # each numbered part: its one value, a range {a..b} if every value in it occurs,
        # else a count of values
        cells = []
        for k in range(len(members[0])):
            values = sorted({m[k] for m in members})
            if len(values) == 1:
                cells.append(str(values[0]))
            elif values == list(range(values[0], values[-1] + 1)):
                cells.append(f"{{{values[0]}..{values[-1]}}}")
            else:
                cells.append(f"{{{len(values)} values}}")
        filled = iter(cells)
        name = ".".join(p if p else next(filled) for p in pattern)
        count = f" (x{len(members)})" if len(members) > 1 else ""
        out.append((name + count, shape, dtype, chunks))
    return out


def table(info: dict[str, Any], every: bool = False) -> str:
    """``summary``'s dict as ``fsdp2 inspect`` prints it: totals, then one line per tensor
    of the model (numbered layers folded into one line unless ``every``; ``every`` also
    lists the tensors that are not the model's)."""
    lines = []
    disk = size_text(info["bytes_on_disk"])
    files = f"{info['files']} file{'s' if info['files'] != 1 else ''}"
    head = f"{info['path']}: {_FORMATS[info['format']]}, {files}, {disk}"
    if info["ranks"]:
        head += f", saved by {info['ranks']} rank{'s' if info['ranks'] != 1 else ''}"
    lines.append(head)
    m = info["model"]
    under = f' (under "{info["model_prefix"]}")' if info["model_prefix"] else ""
    lines.append(
        f"model: {m['tensors']} tensors{under}, {m['parameters']:,} parameters, "
        f"{size_text(m['bytes'])}"
    )
    cells = [
        (dtype, f"{t['tensors']} tensors", f"{t['elements']:,} parameters", size_text(t["bytes"]))
        for dtype, t in m["dtypes"].items()
    ]
    for row in cells:  # dtype left-aligned, the numbers right-aligned
        w = [max(len(r[k]) for r in cells) for k in range(4)]
        text = [row[0].ljust(w[0])] + [c.rjust(wk) for c, wk in zip(row[1:], w[1:], strict=True)]
        lines.append("  " + "  ".join(text))
    o = info["optimizer_state"]
    if o["present"]:
        lines.append(f"optimizer state: {o['tensors']} tensors, {size_text(o['bytes'])}")
    else:
        lines.append("optimizer state: none")
    rest = []
    if info["other_tensors"]:
        rest.append(f"{len(info['other_tensors'])} other tensors")
    if info["objects"]:
        rest.append(f"{len(info['objects'])} non-tensor objects")
    if rest:
        lines.append("also: " + ", ".join(rest) + " (not model weights)")
    if info["format"] == "dcp":
        chunks = info["chunks_per_tensor"]
        if len(chunks) == 1:
            n = chunks[0]
            lines.append(f"sharding: every model tensor in {n} chunk{'s' if n != 1 else ''}")
        elif chunks:
            lines.append(f"sharding: {chunks[0]} to {chunks[-1]} chunks per model tensor")
    rows = [
        (t["name"], "[" + ", ".join(map(str, t["shape"])) + "]", t["dtype"], str(t["chunks"]))
        for t in info["tensors"]
        if every or t["model"]
    ]
    if not every:
        rows = _grouped(rows)
    if rows:
        head_row = ("name", "shape", "dtype", "chunks")
        show_chunks = info["format"] == "dcp"
        cols = 4 if show_chunks else 3
        widths = [max(len(r[k]) for r in [head_row, *rows]) for k in range(cols)]
        lines.append("")
        for r in [head_row, *rows]:
            lines.append(
                "  ".join(c.ljust(w) for c, w in zip(r[:cols], widths, strict=True)).rstrip()
            )
    return "\n".join(lines) + "\n"
