"""``fsdp2 inspect`` and ``fsdp2 convert``: the command line's checkpoint commands (the
parser and ``main`` are in fsdp2/cli/__init__.py; the work in fsdp2/checkpoint/_inspect.py and
_convert.py). See docs/cli.md."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["InputError", "cmd_convert", "cmd_inspect", "dtype_arg"]


class InputError(Exception):
    """An input a person must fix: printed as ``fsdp2 <command>: <message>``, exit 1."""


_DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}


def dtype_arg(text: str) -> str:
    try:
        return _DTYPES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"bf16, fp16 or fp32 (casts floating-point tensors), got {text!r}"
        ) from None


def _open(path: str) -> Any:
    from fsdp2.checkpoint._inspect import open_checkpoint

    try:
        return open_checkpoint(path)
    except (FileNotFoundError, ValueError) as e:
        raise InputError(str(e)) from e


def cmd_inspect(args: argparse.Namespace) -> int:
    from fsdp2.checkpoint._inspect import summary, table

    with _open(args.path) as ckpt:
        info = summary(ckpt, args.prefix)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        sys.stdout.write(table(info, every=args.all))
    return 0


def _selected(ckpt: Any, prefix: str | None) -> tuple[dict[str, str], str | None]:
    """The tensors to convert, and the prefix stripped; what is left out, on stderr."""
    from fsdp2.checkpoint._inspect import select, size_text

    kept, stripped = select(ckpt, prefix)
    if not kept:
        tops = sorted({n.split(".", 1)[0] for n in ckpt.tensors})
        hint = f"--prefix {prefix!r} matches no tensor" if prefix else "no model tensors found"
        raise InputError(
            f"{ckpt.path}: {hint}; its top-level names are {', '.join(tops) or 'none'} "
            "(pass --prefix NAME. to take the tensors under NAME.)"
        )
    left = [n for n in ckpt.tensors if n not in set(kept.values())]
    if left or ckpt.objects:
        nbytes = sum(ckpt.tensors[n].nbytes for n in left)
        what = []
        if left:
            what.append(f"{len(left)} tensors ({size_text(nbytes)}, e.g. {left[0]})")
        if ckpt.objects:
            what.append(f"{len(ckpt.objects)} non-tensor objects (e.g. {ckpt.objects[0]})")
        print(
            f"fsdp2 convert: not converted, not model weights: {' and '.join(what)}",
            file=sys.stderr,
        )
    if stripped:
        print(
            f'fsdp2 convert: the model\'s tensors are under "{stripped}"; written without it',
            file=sys.stderr,
        )
    return kept, stripped


def cmd_convert(args: argparse.Namespace) -> int:
    import torch

    from fsdp2.checkpoint._convert import out_dtype, resolve_config, write_dcp, write_safetensors
    from fsdp2.checkpoint._inspect import size_text
    from fsdp2.checkpoint._save import parse_size

    try:
        limit = parse_size(args.max_shard_size, "--max-shard-size")
    except ValueError as e:
        raise InputError(str(e)) from e
    src, dst = os.path.normpath(args.src), os.path.normpath(args.dst)
    a, b = os.path.realpath(src), os.path.realpath(dst)
    if a == b or b.startswith(a + os.sep) or a.startswith(b + os.sep):
        # replacing DST would replace (or write into) what is being read
        raise InputError(f"{args.dst}: DST must not be SRC, lie inside it or hold it")
    to = args.to
    if dst.endswith(".safetensors"):
        if to == "dcp":
            raise InputError(f"{args.dst}: a .safetensors name with --to dcp; name a folder")
        to = "safetensors"
        if args.config:
            raise InputError("--config needs a folder DST (a .safetensors file has no room)")
    config = resolve_config(args.config, InputError) if args.config else None
    with _open(src) as ckpt:
        if to is None:
            to = "dcp" if ckpt.format == "safetensors" else "safetensors"
        if os.path.lexists(dst) and not args.overwrite:
            raise InputError(f"{args.dst} exists: remove it, or pass --overwrite to replace it")
        kept, _ = _selected(ckpt, args.prefix)
        dtype = getattr(torch, args.dtype) if args.dtype else None
        show = args.progress or sys.stderr.isatty()
        try:
            if to == "safetensors":
                written = write_safetensors(
                    ckpt,
                    kept,
                    dst,
                    dtype=dtype,
                    max_shard_size=limit,
                    config=config,
                    progress=show,
                )
            else:
                written = write_dcp(ckpt, kept, dst, dtype=dtype, config=config, progress=show)
        except (TypeError, ValueError) as e:  # a dtype safetensors cannot hold, a bad file
            raise InputError(f"{e}; nothing was written") from e
        except OSError as e:  # disk full, permissions
            raise InputError(f"writing {args.dst} failed, nothing was written: {e}") from e
        dtypes = sorted(
            {str(out_dtype(ckpt.tensors[n], dtype)).removeprefix("torch.") for n in kept.values()}
        )
    params = sum(ckpt.tensors[n].numel for n in kept.values())
    print(
        f"{args.src} ({ckpt.format}) -> {args.dst} ({to}): {written.tensors} tensors, "
        f"{params:,} parameters, {size_text(written.bytes)}, " + ", ".join(dtypes)
    )
    files = written.files
    if len(files) > 6:  # a DCP folder has a file per tensor
        files = [*files[:3], f"... {len(files) - 4} more", files[-1]]
    for file in files:
        print(f"  {file}")
    if to == "dcp" and _tied(config or os.path.join(src, "config.json")):
        print(
            "tied embeddings (the config's tie_word_embeddings): the output head is the "
            "embedding, stored once; load with dcp.load(model.state_dict(), checkpoint_id="
            "DST, planner=DefaultLoadPlanner(allow_partial_load=True))"
        )
    return 0


def _tied(config: str) -> bool:
    """Whether ``config`` (a config.json, maybe absent) ties the embedding and the head."""
    try:
        with open(config) as f:
            return bool(json.load(f).get("tie_word_embeddings", False))
    except (OSError, ValueError):
        return False
