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
import contextlib
import io
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from fsdp2._cli_checkpoint import InputError as _InputError
from fsdp2._cli_checkpoint import cmd_convert, cmd_inspect, dtype_arg

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


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"--sweep takes world sizes like 8,16,64, got {text!r}")
    return sizes


# fsdp2's own models (fsdp2.models.Llama), by name: their LlamaConfig fields. The rotary
# tables are sized to --seq (max_seq_len), as a training script sizes them.
_OWN_MODELS: dict[str, dict[str, Any]] = {
    # benchmarks/estimate.py's and docs/benchmarks.md's benchmark Llama (25M parameters)
    "llama-bench": {"vocab_size": 256, "dim": 512, "n_layers": 8, "n_heads": 8},
    # examples/train.py's default model (1.8M parameters)
    "llama-train": {"vocab_size": 256, "dim": 192, "n_layers": 4, "n_heads": 6},
    # docs/debugging.md's Llama-3-8B-like shape (6.8B parameters)
    "llama-6.8b": {
        "vocab_size": 128256,
        "dim": 4096,
        "n_layers": 32,
        "n_heads": 32,
        "n_kv_heads": 8,
        "ffn_multiple_of": 1024,
    },
}


class _OwnConfig:
    """One of fsdp2's own models, standing where a Hugging Face config would."""

    def __init__(self, name: str, fields: dict[str, Any]) -> None:
        self.name = name
        self.fields = fields
        self.vocab_size = fields["vocab_size"]


def _config(path: str) -> Any:
    if path in _OWN_MODELS and not os.path.exists(path):
        return _OwnConfig(path, _OWN_MODELS[path])
    if not os.path.exists(path):
        raise _InputError(
            f"{path}: no such file or folder (a config.json or a model folder), nor one of "
            f"fsdp2's models ({', '.join(_OWN_MODELS)})"
        )
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise _InputError(f"{path}: a folder without a config.json")
    from transformers import AutoConfig

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises several kinds for an unreadable config
        raise _InputError(f"{path}: transformers cannot read this config: {e}") from e


def _model(config: Any, ac: str, seq: int) -> Any:
    import torch

    if isinstance(config, _OwnConfig):
        from fsdp2.models import Llama, LlamaConfig

        with torch.device("meta"):
            model = Llama(LlamaConfig(**config.fields, max_seq_len=seq))
        if ac == "full":  # as benchmarks/estimate.py does
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            for i, block in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(block)
        return model
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
    model = _model(config, args.ac, args.seq)
    own = isinstance(config, _OwnConfig)
    optimizer = _muon_and_adamw(model) if args.optimizer == "muon" else args.optimizer
    try:
        return fsdp2.estimate_memory(
            model,
            (ids, ids) if own else {"input_ids": ids, "labels": ids},
            mesh_shape=mesh_shape,
            device=args.device,
            reshard_after_forward=args.reshard_after_forward,
            mp_policy=mp,
            offload_policy=fsdp2.CPUOffloadPolicy() if args.offload else None,
            optimizer=optimizer,
            step_fn=(lambda m, b: m(*b)) if own else None,  # Llama(tokens, targets) -> loss
            compare=False,
        )
    except (ValueError, TypeError) as e:
        raise _InputError(str(e)) from e


def _muon_and_adamw(model: Any) -> Any:
    """``estimate_memory``'s optimizer for ``--optimizer muon``: ``fsdp2.optim.Muon`` on the
    hidden matrices and AdamW on the rest (embeddings, the output head, norms, biases), as
    ``muon_param_groups`` splits them and a Muon training script steps them."""
    import torch

    from fsdp2.optim import Muon, muon_param_groups

    muon_groups, _ = muon_param_groups(model)
    muon_ids = {id(p) for p in muon_groups[0]["params"]}
    # estimate_memory builds the optimizer from its own copy's trainable parameters, in
    # model.parameters() order: which of them are Muon's is read off the original's order.
    is_muon = [id(p) in muon_ids for p in model.parameters() if p.requires_grad]

    class MuonAndAdamW(torch.optim.Optimizer):
        """Two optimizers stepped as one (estimate_memory steps one); ``state`` holds
        both's, which is where the estimate finds the optimizer state."""

        def __init__(self, params: list[Any]) -> None:
            if len(params) != len(is_muon):
                raise ValueError("--optimizer muon: the model's parameters changed")
            muon = [p for p, m in zip(params, is_muon, strict=True) if m]
            adamw = [p for p, m in zip(params, is_muon, strict=True) if not m]
            super().__init__([{"params": muon}, {"params": adamw}], {})
            self.parts: list[torch.optim.Optimizer] = []
            if muon:
                self.parts.append(Muon(muon))
            if adamw:
                self.parts.append(torch.optim.AdamW(adamw))

        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            for opt in self.parts:
                opt.step()
            for opt in self.parts:
                self.state.update(opt.state)

        def zero_grad(self, set_to_none: bool = True) -> None:
            for opt in self.parts:
                opt.zero_grad(set_to_none=set_to_none)

    return MuonAndAdamW


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


def _name(config: Any) -> str:
    return config.name if isinstance(config, _OwnConfig) else type(config).__name__


# The bars of --plot: the estimate's parts, summed into what a person plans for.
_BARS = {
    "parameters": ("parameters (sharded)", "parameters (unsharded)"),
    "gradients": ("gradients (sharded)", "gradients (unsharded)"),
    "optimizer state": ("optimizer state",),
    "activations": ("activations",),
    "buffers": ("communication buffers", "other"),
}


def _plot(path: str, title: str, results: list[Any], budget: int | None) -> None:
    """A PNG of the peak per world size, stacked by part (matplotlib, imported here)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise _InputError(f"--plot needs matplotlib (pip install matplotlib): {e}") from e
    labels = ["x".join(map(str, est.mesh_shape)) for est in results]
    fig, ax = plt.subplots(figsize=(3.2 + 1.0 * len(results), 4.2))
    bottom = [0.0] * len(results)
    for bar, parts in _BARS.items():
        heights = [sum(est.parts[p] for p in parts) / 2**30 for est in results]
        ax.bar(labels, heights, bottom=bottom, label=bar, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    if budget is not None:
        ax.axhline(budget / 2**30, color="black", linestyle="--", linewidth=1)
        ax.text(-0.45, budget / 2**30, "device memory", va="bottom", ha="left", fontsize=8)
    ax.set_xlabel("ranks (mesh)")
    ax.set_ylabel("peak per rank (GiB)")
    ax.set_title(title, fontsize=9)
    handles, names = ax.get_legend_handles_labels()  # top part on top, as stacked
    ax.legend(handles[::-1], names[::-1], fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise _InputError(f"--plot {path}: cannot write it: {e}") from e
    finally:
        plt.close(fig)


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
    if args.plot:
        title = f"{_name(config)}, {args.batch} x {args.seq} tokens per rank, {args.optimizer}"
        _plot(args.plot, title, results, budget)
    if args.json:
        dicts = [_as_dict(est, budget) for est in results]
        print(json.dumps(dicts if args.sweep else dicts[0], indent=1))
        return 0
    if args.sweep:
        print(
            f"{_name(config)}, batch {args.batch} x {args.seq} tokens per rank, "
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
    est.add_argument(
        "config",
        help="a config.json, a folder holding one, or one of fsdp2's models: "
        + ", ".join(_OWN_MODELS),
    )
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
    est.set_defaults(run=_cmd_estimate)

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
