"""The checkpoint file layer of ``fsdp2.checkpoint`` (``fsdp2/checkpoint/_files.py``), one process.

* Reading boxes: for tensors of 0 to 4 dims and several dtypes (fp32, bf16, int64, bool) in a
  ``safetensors.torch.save_file`` file, every box (random starts and lengths per dim, empty
  ones too) read with ``Source.read`` equals the slice of the tensor; reading into a matching
  ``out`` fills it in place; a ``torch.save`` file gives the same.
* The streamed writer: a file written tensor by tensor by ``StreamWriter`` loads with
  ``safetensors.torch.load_file`` (header format "pt") to the same tensors; ``abort`` leaves
  no file, and nothing appears at the final name before ``publish``.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fsdp2.checkpoint._files import StreamWriter, open_source

SHAPES = [(), (7,), (5, 6), (3, 4, 5), (2, 3, 2, 3), (0, 4)]
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, shape in enumerate(SHAPES):
        for dtype in DTYPES:
            t = torch.randn(shape, generator=g) * 10
            out[f"t{i}.{str(dtype)[6:]}"] = t > 0 if dtype is torch.bool else t.to(dtype)
    return out


def _boxes(shape: tuple[int, ...], rng: random.Random, n: int = 12) -> list[tuple[slice, ...]]:
    boxes = [tuple(slice(0, s) for s in shape)]
    for _ in range(n):
        box = []
        for s in shape:
            a = rng.randint(0, s)
            box.append(slice(a, rng.randint(a, s)))
        boxes.append(tuple(box))
    return boxes


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_read_boxes(tmp_path, fmt):
    tensors = _tensors()
    path = str(tmp_path / ("w.safetensors" if fmt == "safetensors" else "w.pt"))
    if fmt == "safetensors":
        save_file(tensors, path)
    else:
        torch.save(tensors, path)
    rng = random.Random(0)
    with open_source(path) as source:
        assert sorted(source.entries) == sorted(tensors)
        for name, t in tensors.items():
            assert source.entries[name].shape == t.shape and source.entries[name].dtype == t.dtype
            for box in _boxes(tuple(t.shape), rng):
                got = source.read(name, box)
                assert torch.equal(got, t[box]), (name, box)
            assert torch.equal(source.read(name, None), t), name
            out = torch.empty_like(t)
            got = source.read(name, None, out=out)
            assert torch.equal(out if fmt == "safetensors" else got, t), name
            if fmt == "safetensors":
                assert got is out, "a matching out is filled in place"


def test_stream_writer(tmp_path):
    tensors = _tensors()
    path = str(tmp_path / "s.safetensors")
    writer = StreamWriter(path, [(n, t.shape, t.dtype) for n, t in tensors.items()])
    for name, t in tensors.items():
        writer.write(name, t)
    writer.commit()
    assert not os.path.exists(path), "nothing at the final name before publish"
    writer.publish()
    loaded = load_file(path)
    assert sorted(loaded) == sorted(tensors)
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t) and loaded[name].dtype == t.dtype, name
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}

    aborted = str(tmp_path / "a.safetensors")
    writer = StreamWriter(aborted, [(n, t.shape, t.dtype) for n, t in tensors.items()])
    writer.write(*next(iter(tensors.items())))
    writer.abort()
    assert os.listdir(tmp_path) == ["s.safetensors"]
