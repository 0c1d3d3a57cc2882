"""The ``fsdp2`` command (also ``python -m fsdp2``). See docs/cli.md.

* ``fsdp2 estimate CONFIG``: will it fit? A Hugging Face ``config.json`` (a file or a model
  folder) built on the meta device, one training step simulated by
  :func:`fsdp2.estimate_memory` on fake tensors for the given mesh, batch and settings: the
  per-rank peak split into parameters, gradients, optimizer state, activations and
  communication buffers, when in the step it happens, and whether it fits ``--device-memory``.
  ``--sweep 8,16,64`` prints one line per world size; ``--json`` for scripts; ``--plot`` a
  PNG bar chart. Also fsdp2's own models by name (``llama-bench``, ...) and
  ``--optimizer muon``.
* ``fsdp2 inspect PATH``: what a checkpoint holds (a DCP folder, safetensors, a ``torch.save``
  file): the model's parameter count and bytes per dtype, optimizer state, how it was
  sharded, one line per tensor (numbered layers folded). ``--json`` for scripts.
* ``fsdp2 convert SRC DST``: DCP, safetensors and ``torch.save`` checkpoints into a Hugging
  Face safetensors folder or a DCP folder, one tensor at a time (see [Note: streamed
  conversion] in fsdp2/checkpoint/_convert.py), published whole.

Exit codes: 0 done, 1 an error in the input (a missing file, a config transformers cannot
read, a mesh that does not divide, a folder that is no checkpoint, an existing DST), 2 bad
arguments.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from fsdp2._version import __version__
from fsdp2.cli._checkpoint import InputError as _InputError
from fsdp2.cli._checkpoint import cmd_convert, cmd_inspect, dtype_arg
from fsdp2.cli._estimate import OWN_MODELS, cmd_estimate

__all__ = ["main"]


def _mesh(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or len(shape) > 2 or any(n < 1 for n in shape):
        raise argparse.ArgumentTypeError(
            f"--mesh must be N (FSDP over N ranks) or RxS (HSDP: R replicas of S-way "
            f"sharding), got {text!r}"
        )
    return shape


def _budget(text: str) -> int:
    """``--offload-budget``: bytes, or a size like ``20GiB``; 0 offloads nothing."""
    from fsdp2.checkpoint._save import parse_size

    if re.fullmatch(r"\s*0+(\.0*)?\s*[A-Za-z]*\s*", text):
        return 0
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--offload-budget must be a number of bytes or a size like 20GiB (0 offloads "
            f"nothing), got {text!r}"
        ) from None


def _sizes(text: str) -> list[tuple[int, ...]]:
    """``--sweep``: world sizes (FSDP) or ``RxS`` HSDP meshes, comma-separated."""
    try:
        shapes = [_mesh(part.strip()) for part in text.split(",") if part.strip()]
    except argparse.ArgumentTypeError:
        shapes = []
    if not shapes:
        raise argparse.ArgumentTypeError(
            f"--sweep takes world sizes or HSDP meshes like 8,16,64 or 8x8,16x8, got {text!r}"
        )
    return shapes


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fsdp2", description="fsdp2 from the command line")
    ap.add_argument("--version", action="version", version=f"fsdp2 {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    est = sub.add_parser(
        "estimate",
        help="per-rank peak memory of a training step, from a Hugging Face config",
        description="Simulate one training step on fake tensors (nothing is allocated) and "
        "print rank 0's peak memory, split into parts.",
    )
    est.add_argument(
        "config",
        help="a config.json, a folder holding one, or one of fsdp2's models: "
        + ", ".join(OWN_MODELS),
    )
    est.add_argument("--mesh", type=_mesh, default=(8,), help="N (FSDP) or RxS (HSDP); 8")
    est.add_argument(
        "--sweep",
        type=_sizes,
        help="world sizes or HSDP meshes, e.g. 8,64 or 8x8,16x8: one line each (with "
        "--shard-over-replicas, each HSDP mesh without and with it)",
    )
    est.add_argument("--batch", type=int, default=1, help="sequences per rank (1)")
    est.add_argument("--seq", type=int, default=2048, help="tokens per sequence (2048)")
    est.add_argument("--mp", choices=("bf16", "fp32"), default="bf16", help="bf16 compute")
    est.add_argument(
        "--param-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="the parameters' dtype in training: fp32 master weights (default; the config's "
        "torch_dtype is the checkpoint's), or bf16 throughout",
    )
    est.add_argument(
        "--optim-dtype",
        choices=("fp32", "bf16"),
        default=None,
        help="the optimizer state's dtype (default: the parameters')",
    )
    est.add_argument(
        "--exact",
        action="store_true",
        help="simulate the whole model (slower) instead of scaling from 4 and 5 blocks",
    )
    est.add_argument(
        "--reshard-after-forward",
        type=lambda t: {"true": True, "false": False}[t.lower()],
        default=None,
        metavar="{true,false}",
        help="fully_shard's reshard_after_forward for every block (default: fsdp2's)",
    )
    est.add_argument(
        "--experts-dim",
        choices=("auto", "0", "1"),
        default="auto",
        help="the dim a mixture of experts' stacked 3-D parameters shard on: auto (default) "
        "dim 1 when the experts are fewer than the shard ranks, as torchtitan does, else 0",
    )
    offload = est.add_mutually_exclusive_group()
    offload.add_argument("--offload", action="store_true", help="CPUOffloadPolicy()")
    offload.add_argument(
        "--offload-budget",
        type=_budget,
        metavar="SIZE",
        help="e.g. 20GiB: fsdp2.cpu_offload_by_budget(model, SIZE), the largest parameters "
        "up to SIZE of full parameter bytes on the host, the others on the device (the "
        "whole model is simulated, as with --exact)",
    )
    est.add_argument(
        "--shard-over-replicas",
        action="store_true",
        help="HSDP (--mesh RxS, or RxS in --sweep): gradients and optimizer state sharded "
        "over the R replicas too (fsdp2.replica_optim.shard_over_replicas)",
    )
    est.add_argument("--ac", choices=("none", "full"), default="none", help="checkpointing")
    est.add_argument(
        "--optimizer",
        choices=("adamw", "adam", "sgd", "muon"),
        default="adamw",
        help="muon: fsdp2.optim.Muon on the hidden matrices, AdamW on the rest",
    )
    est.add_argument("--device", choices=("cuda", "cpu"), default=None, help="plan for")
    est.add_argument("--device-memory", help="e.g. 80GiB: say whether the peak fits")
    est.add_argument("--json", action="store_true", help="print JSON")
    est.add_argument("--plot", metavar="PNG", help="write a bar chart of the parts per world size")
    est.set_defaults(run=cmd_estimate)

    ins = sub.add_parser(
        "inspect",
        help="what a checkpoint holds: DCP, safetensors or torch.save",
        description="Print a checkpoint's tensors: the model's parameter count and bytes per "
        "dtype, optimizer state, how it was sharded, and one line per tensor.",
    )
    ins.add_argument(
        "path", help="a DCP folder, a .safetensors file, an index .json, a folder, or a .pt"
    )
    ins.add_argument("--json", action="store_true", help="print JSON (every tensor)")
    ins.add_argument(
        "--all", action="store_true", help="one line per tensor, optimizer state included"
    )
    ins.add_argument("--prefix", help='the model\'s tensors are under this, e.g. "model."')
    ins.set_defaults(run=cmd_inspect)

    conv = sub.add_parser(
        "convert",
        help="DCP / safetensors / torch.save into safetensors or DCP, streamed",
        description="Convert a checkpoint's model weights, one tensor at a time: DCP or a "
        "torch.save file into a Hugging Face safetensors folder, safetensors into DCP.",
    )
    conv.add_argument("src", help="a DCP folder, safetensors (file, folder, index) or a .pt")
    conv.add_argument("dst", help="a folder (or a .safetensors file) that does not exist yet")
    conv.add_argument(
        "--to",
        choices=("safetensors", "dcp"),
        help="the output format (default: dcp from safetensors, else safetensors)",
    )
    conv.add_argument("--prefix", help='take the tensors under this, e.g. "model."')
    conv.add_argument("--dtype", type=dtype_arg, help="cast floating tensors: bf16, fp16 or fp32")
    conv.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (5GB)")
    conv.add_argument("--config", help="a config.json (or a folder with one) to copy in")
    conv.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    conv.add_argument("--progress", action="store_true", help="a progress bar, even off a TTY")
    conv.set_defaults(run=cmd_convert)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fsdp2`` command; returns its exit code."""
    args = _parser().parse_args(argv)
    for name in ("batch", "seq"):
        if getattr(args, name, 1) < 1:
            print(f"fsdp2 {args.command}: --{name} must be at least 1", file=sys.stderr)
            return 2
    try:
        return int(args.run(args))
    except _InputError as e:
        print(f"fsdp2 {args.command}: {e}", file=sys.stderr)
        return 1
