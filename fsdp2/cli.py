"""The ``fsdp2`` command (also ``python -m fsdp2``). See docs/cli.md.

* ``fsdp2 estimate CONFIG``: will it fit? A Hugging Face ``config.json`` (a file or a model
  folder) built on the meta device, one training step simulated by
  :func:`fsdp2.estimate_memory` on fake tensors for the given mesh, batch and settings: the
  per-rank peak split into parameters, gradients, optimizer state, activations and
  communication buffers, when in the step it happens, and whether it fits ``--device-memory``.
  ``--sweep 8,16,64`` prints one line per world size; ``--json`` for scripts.

Exit codes: 0 done, 1 an error in the input (a missing file, a config transformers cannot
read, a mesh that does not divide), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


class _InputError(Exception):
    """An input a person must fix: printed as ``fsdp2 <command>: <message>``, exit 1."""


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


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"--sweep takes world sizes like 8,16,64, got {text!r}")
    return sizes


def _config(path: str) -> Any:
    if not os.path.exists(path):
        raise _InputError(f"{path}: no such file or folder (a config.json or a model folder)")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise _InputError(f"{path}: a folder without a config.json")
    from transformers import AutoConfig

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises several kinds for an unreadable config
        raise _InputError(f"{path}: transformers cannot read this config: {e}") from e


def _model(config: Any, ac: str) -> Any:
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM: the bare model
            model = AutoModel.from_config(config)
    if ac == "full":
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is None:  # transformers before activation_checkpointing_enable
            enable = model.gradient_checkpointing_enable
        enable()
    return model


def _estimate(args: argparse.Namespace, config: Any, mesh_shape: tuple[int, ...]) -> Any:
    import torch

    import fsdp2

    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 1:
        raise _InputError("the config has no vocab_size: only token-input models are planned")
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    mp = None
    if args.mp == "bf16":
        mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    try:
        return fsdp2.estimate_memory(
            _model(config, args.ac),
            {"input_ids": ids, "labels": ids},
            mesh_shape=mesh_shape,
            device=args.device,
            reshard_after_forward=args.reshard_after_forward,
            mp_policy=mp,
            offload_policy=fsdp2.CPUOffloadPolicy() if args.offload else None,
            optimizer=args.optimizer,
            compare=False,
        )
    except (ValueError, TypeError) as e:
        raise _InputError(str(e)) from e


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def _as_dict(est: Any, budget: int | None) -> dict[str, Any]:
    out = {
        "world_size": est.world_size,
        "mesh_shape": list(est.mesh_shape),
        "device": est.device,
        "settings": est.settings,
        "peak_bytes": est.peak_bytes,
        "parts": est.parts,
        "when": est.when,
        "unsharded": list(est.unsharded),
        "host_peak_bytes": est.host_peak_bytes,
    }
    if budget is not None:
        out["device_memory_bytes"] = budget
        out["fits"] = est.peak_bytes <= budget
    return out


def _cmd_estimate(args: argparse.Namespace) -> int:
    from fsdp2.checkpoint._save import parse_size

    budget = None
    if args.device_memory is not None:
        try:
            budget = parse_size(args.device_memory, "--device-memory")
        except ValueError as e:
            raise _InputError(str(e)) from e
    config = _config(args.config)
    meshes = [(n,) for n in args.sweep] if args.sweep else [args.mesh]
    results = [_estimate(args, config, shape) for shape in meshes]
    if args.json:
        dicts = [_as_dict(est, budget) for est in results]
        print(json.dumps(dicts if args.sweep else dicts[0], indent=1))
        return 0
    if args.sweep:
        print(
            f"{type(config).__name__}, batch {args.batch} x {args.seq} tokens per rank, "
            f"{results[0].settings}, {results[0].device}"
        )
        head = ["ranks", "peak GiB", "params", "grads", "optimizer", "activations", "comm"]
        print(" | ".join(head) + (" | fits" if budget else ""))
        for est in results:
            p = est.parts
            cells = [
                str(est.world_size),
                _gib(est.peak_bytes),
                _gib(p["parameters (sharded)"] + p["parameters (unsharded)"]),
                _gib(p["gradients (sharded)"] + p["gradients (unsharded)"]),
                _gib(p["optimizer state"]),
                _gib(p["activations"]),
                _gib(p["communication buffers"]),
            ]
            fits = " | " + ("yes" if est.peak_bytes <= budget else "no") if budget else ""
            print(" | ".join(cells) + fits)
        return 0
    est = results[0]
    print(est)
    if budget is not None:
        verdict = "fits" if est.peak_bytes <= budget else "does NOT fit"
        print(f"{verdict} in {_gib(budget)} GiB of device memory")
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fsdp2", description="fsdp2 from the command line")
    sub = ap.add_subparsers(dest="command", required=True)
    est = sub.add_parser(
        "estimate",
        help="per-rank peak memory of a training step, from a Hugging Face config",
        description="Simulate one training step on fake tensors (nothing is allocated) and "
        "print rank 0's peak memory, split into parts.",
    )
    est.add_argument("config", help="a config.json, or a folder holding one")
    est.add_argument("--mesh", type=_mesh, default=(8,), help="N (FSDP) or RxS (HSDP); 8")
    est.add_argument("--sweep", type=_sizes, help="world sizes, e.g. 8,16,64: one line each")
    est.add_argument("--batch", type=int, default=1, help="sequences per rank (1)")
    est.add_argument("--seq", type=int, default=2048, help="tokens per sequence (2048)")
    est.add_argument("--mp", choices=("bf16", "fp32"), default="bf16", help="bf16 compute")
    est.add_argument(
        "--reshard-after-forward",
        type=lambda t: {"true": True, "false": False}[t.lower()],
        default=None,
        metavar="{true,false}",
        help="fully_shard's reshard_after_forward for every block (default: fsdp2's)",
    )
    est.add_argument("--offload", action="store_true", help="CPUOffloadPolicy()")
    est.add_argument("--ac", choices=("none", "full"), default="none", help="checkpointing")
    est.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), default="adamw")
    est.add_argument("--device", choices=("cuda", "cpu"), default=None, help="plan for")
    est.add_argument("--device-memory", help="e.g. 80GiB: say whether the peak fits")
    est.add_argument("--json", action="store_true", help="print JSON")
    est.set_defaults(run=_cmd_estimate)
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
