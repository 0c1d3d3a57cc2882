"""Checkpoint files for ``fsdp2.checkpoint``: read slices of tensors out of safetensors and
``torch.save`` files (one file, or a Hugging Face directory of several), and stream a
safetensors file out one tensor at a time.

# [Note: reading boxes]
# A rank needs only its shard of each tensor: a box (a start and a length per dimension)
# of the full tensor. In a safetensors file a tensor is row-major at a known offset, so a
# box is a set of contiguous byte runs (one run for a dim-0 shard, one per row for a
# Shard(1) one), read with ``readinto`` straight into the shard's memory when dtypes
# match: no copy, no mapping. (A memory map would count every page touched in the
# process's RSS, up to the whole file.) ``torch.load(mmap=True)`` files are mapped: the
# box is indexed and copied, touching only its pages. No full tensor is materialised
# unless the caller asks for one (a box of ``None``).

# [Note: streamed safetensors]
# A safetensors file is an 8-byte little-endian header length, a JSON header (name ->
# dtype, shape, [begin, end) byte offsets into the data; ``__metadata__``), then the
# tensors' bytes back to back in header order. Shapes and dtypes are known before any
# tensor is gathered, so the header is written first and each tensor's bytes are appended
# as soon as it is gathered: the writer never holds more than one tensor.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from collections.abc import Iterator
from typing import IO, Any, NamedTuple

import torch

from fsdp2._core.params.storage import contiguous_stride as _contiguous_stride

__all__ = ["Entry", "Source", "StreamWriter", "open_source", "st_dtype"]

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_SINGLE = "pytorch_model.bin"


def st_dtype(dtype: torch.dtype, what: str) -> str:
    """The safetensors name of ``dtype``; ``TypeError`` naming ``what`` if it has none."""
    try:
        return _ST_NAMES[dtype]
    except KeyError:
        raise TypeError(f"{what}: dtype {dtype} cannot be stored in safetensors") from None


class Entry(NamedTuple):
    """One tensor of a checkpoint: the file holding it, its shape and dtype."""

    file: str
    shape: torch.Size
    dtype: torch.dtype


Box = tuple[slice, ...] | None


class Source:
    """The tensors of a checkpoint (one or several files), read box by box.

    ``entries`` maps each checkpoint name to its :class:`Entry`; ``read(name, box)``
    returns the ``box`` of that tensor (see [Note: reading boxes]), or the whole tensor
    for ``box=None``, as a CPU tensor in the checkpoint's dtype. Files are opened once,
    lazily memory-mapped; use as a context manager to close them."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self._raw: dict[str, IO[bytes]] = {}  # safetensors file -> unbuffered reader
        self._offsets: dict[str, int] = {}  # safetensors tensor -> its first byte in its file
        self._pt: dict[str, dict[str, torch.Tensor]] = {}  # file -> mmapped state dict

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        for raw in self._raw.values():
            raw.close()
        self._raw.clear()
        self._pt.clear()

    def add_safetensors(self, file: str, names: list[str] | None = None) -> None:
        """Index ``file``'s tensors (all, or ``names``: an index file's list for it).
        safetensors validates the file; reads then use plain ``readinto`` at each
        tensor's offset (see [Note: reading boxes])."""
        from safetensors import safe_open

        if not os.path.isfile(file):
            raise FileNotFoundError(f"checkpoint file {file} does not exist")
        try:
            with safe_open(file, framework="pt", device="cpu") as handle:
                keys = set(handle.keys())
            layout = _safetensors_layout(file)
        except Exception as e:
            raise ValueError(f"{file}: not a readable safetensors file: {e}") from e
        self._raw[file] = open(file, "rb", buffering=0)  # noqa: SIM115 (closed in __exit__)
        for name in names if names is not None else sorted(keys):
            if name not in keys:
                raise ValueError(f"{file}: the index lists tensor {name!r} in it, which it lacks")
            offset, shape, dtype_name = layout[name]
            if dtype_name not in _ST_DTYPES:
                raise ValueError(f"{file}: tensor {name!r} has unsupported dtype {dtype_name}")
            self._add(name, Entry(file, shape, _ST_DTYPES[dtype_name]))
            self._offsets[name] = offset

    def add_torch(self, file: str, names: list[str] | None = None) -> None:
        """Index a ``torch.save`` file of a flat ``{name: tensor}`` dict (memory-mapped)."""
        if not os.path.isfile(file):
            raise FileNotFoundError(f"checkpoint file {file} does not exist")
        try:
            loaded = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:
            raise ValueError(
                f"{file}: not a readable torch.save checkpoint (torch.load(mmap=True) needs "
                f"the zip format of torch >= 1.6): {e}"
            ) from e
        if not isinstance(loaded, dict):
            raise ValueError(
                f"{file}: expected a state dict ({{name: tensor}}), got {type(loaded).__name__}"
            )
        for name, value in loaded.items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"{file}: expected a flat state dict ({{name: tensor}}), but {name!r} "
                    f"holds a {type(value).__name__}; save model.state_dict() itself"
                )
        self._pt[file] = loaded
        for name in names if names is not None else list(loaded):
            if name not in loaded:
                raise ValueError(f"{file}: the index lists tensor {name!r} in it, which it lacks")
            self._add(name, Entry(file, loaded[name].shape, loaded[name].dtype))

    def _add(self, name: str, entry: Entry) -> None:
        if name in self.entries:
            raise ValueError(
                f"tensor {name!r} is in both {self.entries[name].file} and {entry.file}"
            )
        self.entries[name] = entry

    def read(self, name: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``box`` of tensor ``name`` (all of it for ``None``), read into ``out`` when
        ``out`` is a contiguous CPU tensor of the right shape and dtype, else into a new
        tensor; returns what it read into."""
        entry = self.entries[name]
        if entry.file not in self._raw:
            tensor = self._pt[entry.file][name]
            return tensor if box is None or not box else tensor[box]
        shape = tuple(entry.shape)
        box = box or tuple(slice(0, n) for n in shape)
        sizes = tuple(b.stop - b.start for b in box)
        if not (
            out is not None
            and type(out) in (torch.Tensor, torch.nn.Parameter)  # not a tensor subclass
            and out.dtype == entry.dtype
            and out.device.type == "cpu"
            and out.is_contiguous()
            and tuple(out.shape) == sizes
        ):
            out = torch.empty(sizes, dtype=entry.dtype)
        if out.numel() == 0:
            return out
        raw, base, itemsize = self._raw[entry.file], self._offsets[name], entry.dtype.itemsize
        dst = out.reshape(-1).view(torch.uint8).numpy().data
        if not shape:
            _read_exactly(raw, dst, base, entry.file)
            return out
        # Dims after the last partial one are whole: each run of bytes is contiguous.
        last = max((d for d in range(len(shape)) if sizes[d] != shape[d]), default=0)
        strides = _contiguous_stride(shape)
        run = sizes[last] * strides[last] * itemsize
        pos = 0
        for index in itertools.product(*(range(b.start, b.stop) for b in box[:last])):
            first = sum(i * s for i, s in zip(index, strides, strict=False))
            first += box[last].start * strides[last]
            _read_exactly(raw, dst[pos : pos + run], base + first * itemsize, entry.file)
            pos += run
        return out


def _read_exactly(raw: IO[bytes], dst: memoryview, offset: int, file: str) -> None:
    raw.seek(offset)
    got = 0
    while got < len(dst):
        n = raw.readinto(dst[got:])  # type: ignore[attr-defined]
        if not n:
            raise ValueError(f"{file}: truncated (ends before byte {offset + len(dst)})")
        got += n


def _safetensors_layout(file: str) -> dict[str, tuple[int, torch.Size, str]]:
    """name -> (first byte in the file, shape, dtype name), from the (validated) header."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {
        name: (8 + n + int(v["data_offsets"][0]), torch.Size(v["shape"]), str(v["dtype"]))
        for name, v in header.items()
        if name != "__metadata__"
    }


def open_source(path: str | os.PathLike[str]) -> Source:
    """The checkpoint at ``path``: a ``.safetensors`` file, a ``torch.save`` file, or a
    directory holding ``model.safetensors.index.json`` (+ its files), ``model.safetensors``,
    ``pytorch_model.bin.index.json`` (+ its files) or ``pytorch_model.bin`` (first found).
    Raises ``FileNotFoundError`` naming what is missing, ``ValueError`` naming a file
    that cannot be read."""
    path = os.fspath(path)
    source = Source()
    try:
        if os.path.isdir(path):
            _open_dir(source, path)
        elif not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        elif path.endswith(".safetensors"):
            source.add_safetensors(path)
        elif path.endswith(".json"):
            _open_index(source, path)
        else:
            source.add_torch(path)
    except BaseException:
        source.__exit__()
        raise
    return source


def _open_dir(source: Source, path: str) -> None:
    for name in (SAFETENSORS_INDEX, SAFETENSORS_SINGLE, TORCH_INDEX, TORCH_SINGLE):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        if name.endswith(".json"):
            _open_index(source, file)
        elif name.endswith(".safetensors"):
            source.add_safetensors(file)
        else:
            source.add_torch(file)
        return
    raise FileNotFoundError(
        f"checkpoint directory {path} holds none of {SAFETENSORS_INDEX}, {SAFETENSORS_SINGLE}, "
        f"{TORCH_INDEX}, {TORCH_SINGLE}"
    )


def _open_index(source: Source, index: str) -> None:
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a checkpoint index with a weight_map: {e!r}") from e
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(str(file), []).append(str(name))
    folder = os.path.dirname(index)
    for file, names in by_file.items():
        full = os.path.join(folder, file)
        if not os.path.isfile(full):
            raise FileNotFoundError(f"{index} lists {file}, which does not exist in {folder}")
        if file.endswith(".safetensors"):
            source.add_safetensors(full, names)
        else:
            source.add_torch(full, names)


class StreamWriter:
    """Writes one safetensors file whose tensors arrive one at a time, in the order given
    up front (see [Note: streamed safetensors]). Writes to ``<path>.partial``; ``commit``
    renames it to ``path``, ``abort`` deletes it."""

    def __init__(self, path: str, specs: list[tuple[str, torch.Size, torch.dtype]]) -> None:
        self.path = path
        self.tmp = path + ".partial"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        self._expected: list[tuple[str, int]] = []
        offset = 0
        for name, shape, dtype in specs:
            nbytes = shape.numel() * dtype.itemsize
            header[name] = {
                "dtype": st_dtype(dtype, name),
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._expected.append((name, nbytes))
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # tensor data 8-byte aligned, as safetensors writes it
        self._file: IO[bytes] | None = open(self.tmp, "wb")  # noqa: SIM115 (closed in commit)
        self._file.write(struct.pack("<Q", len(blob)))
        self._file.write(blob)
        self._next: Iterator[tuple[str, int]] = iter(self._expected)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (a contiguous CPU tensor), which must be the next one expected."""
        expected, nbytes = next(self._next)
        data = tensor.reshape(-1).view(torch.uint8)
        assert expected == name and data.numel() == nbytes, (name, expected, nbytes)
        assert self._file is not None
        self._file.write(data.numpy().data)

    def commit(self) -> None:
        """Close the file (all tensors written) and flush it to disk; the rename to the
        final name is :meth:`publish`, done once every writer has committed."""
        assert next(self._next, None) is None, f"{self.path}: not every tensor was written"
        assert self._file is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None

    def publish(self) -> None:
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if os.path.exists(self.tmp):
            os.remove(self.tmp)
