"""``fsdp2 estimate`` (fsdp2/cli/__init__.py parses its arguments): will it fit? See docs/cli.md.

A Hugging Face ``config.json`` (or one of fsdp2's own models by name) is built on the meta
device in the dtype training keeps its weights in (fp32 master weights unless
``--param-dtype bf16``; the config's ``torch_dtype`` is the checkpoint's, not training's),
and one training step is simulated by :func:`fsdp2.estimate_memory` for the asked mesh.
[Note: scaled estimates] says how a large model answers in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from fsdp2.cli._checkpoint import InputError as _InputError
from fsdp2.cli._plot import check as check_plot
from fsdp2.cli._plot import plot

__all__ = ["OWN_MODELS", "cmd_estimate"]


# fsdp2's own models (fsdp2.models.Llama), by name: their LlamaConfig fields. The rotary
# tables are sized to --seq (max_seq_len), as a training script sizes them.
OWN_MODELS: dict[str, dict[str, Any]] = {
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
    if path in OWN_MODELS and not os.path.exists(path):
        return _OwnConfig(path, OWN_MODELS[path])
    if not os.path.exists(path):
        raise _InputError(
            f"{path}: no such file or folder (a config.json or a model folder), nor one of "
            f"fsdp2's models ({', '.join(OWN_MODELS)})"
        )
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise _InputError(f"{path}: a folder without a config.json")
    from transformers import AutoConfig

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises several kinds for an unreadable config
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise _InputError(f"{path}: transformers cannot read this config: {first}") from e


@contextlib.contextmanager
def _quiet_extras() -> Iterator[None]:
    """Building a Hugging Face model imports torchao when it is installed (the test extras
    install it), whose CUDA kernels fail to load on a CPU-only torch and whose enums warn
    through torch's pytree logger: noise that says nothing about the estimate."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


@contextlib.contextmanager
def _grouped_mm_as_output() -> Iterator[None]:
    """transformers' MoE experts run ``torch.nn.functional.grouped_mm`` where the device has
    a kernel. Its meta kernel (what the simulation runs) accepts bf16 only, and the CPU
    kernel allocates scratch the simulation cannot see; the GPU kernels allocate the output
    alone. So the simulation takes transformers' own fallback, whose shape function is
    exactly that output (see docs/cli.md, "Mixtures of experts")."""
    try:
        from transformers.integrations import moe
    except ImportError:  # a transformers without MoE kernels: nothing to do
        yield
        return
    orig = getattr(moe, "_can_use_grouped_mm", None)
    if orig is None:
        yield
        return
    moe._can_use_grouped_mm = lambda *args: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = orig


def _layers(config: Any) -> int | None:
    """The number of blocks, when the model's blocks are all alike (so a model of fewer
    blocks scales: [Note: scaled estimates]); else ``None``."""
    if isinstance(config, _OwnConfig):
        return int(config.fields["n_layers"])
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int):
        return None
    kinds = getattr(config, "layer_types", None)
    if kinds is not None and len(set(kinds)) > 1:
        return None  # e.g. sliding and full attention alternating
    if getattr(config, "mlp_only_layers", None) or getattr(config, "first_k_dense_replace", 0):
        return None  # dense layers among MoE ones
    if getattr(config, "decoder_sparse_step", 1) not in (None, 1):
        return None
    return n


# built models, by (config's contents, blocks, ac, seq, dtype): a sweep simulates the same model
# on every mesh (estimate_memory copies it), and building a large one on meta takes seconds.
# Keyed by contents, not id(config): a freed config's id is reused by the next one (several
# calls in one process, main(argv) from a script).
_BUILT: dict[tuple[Any, ...], Any] = {}


def _fingerprint(config: Any) -> Any:
    if isinstance(config, _OwnConfig):
        return ("own", config.name, repr(sorted(config.fields.items())))
    to_json = getattr(config, "to_json_string", None)
    return to_json(use_diff=False) if to_json is not None else repr(config)


def _with_layers(config: Any, n: int) -> Any:
    if isinstance(config, _OwnConfig):
        return _OwnConfig(config.name, {**config.fields, "n_layers": n})
    out = copy.deepcopy(config)
    out.num_hidden_layers = n
    if getattr(out, "layer_types", None) is not None:
        out.layer_types = out.layer_types[:n]
    return out


def _model(config: Any, ac: str, seq: int, dtype: Any) -> Any:
    import torch

    if isinstance(config, _OwnConfig):
        from fsdp2.models import Llama, LlamaConfig

        with torch.device("meta"):
            model = Llama(LlamaConfig(**config.fields, max_seq_len=seq)).to(dtype)
        if ac == "full":  # as benchmarks/estimate.py does
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            for i, block in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(block)
        return model
    with _quiet_extras():
        from transformers import AutoModel, AutoModelForCausalLM

        with torch.device("meta"):
            # dtype: the weights' dtype in training, never the config's torch_dtype (the
            # checkpoint's: nearly every Hub config says bfloat16)
            try:
                try:
                    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)
                except ValueError:  # not a causal LM: the bare model
                    model = AutoModel.from_config(copy.deepcopy(config), dtype=dtype)
            except (ValueError, KeyError, ImportError) as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise _InputError(
                    f"transformers cannot build a model from this config "
                    f"({type(config).__name__}): {first}"
                ) from e
    if ac == "full":
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is None:  # transformers before activation_checkpointing_enable
            enable = model.gradient_checkpointing_enable
        enable()
    return model


_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _estimate(args: argparse.Namespace, config: Any, mesh_shape: tuple[int, ...]) -> Any:
    """The estimate for ``mesh_shape``: simulated on the whole model with ``--exact`` (or
    when its blocks differ), else scaled from two small ones ([Note: scaled estimates])."""
    n = _layers(config)
    # --offload-budget: what it offloads does not grow with the blocks (one budget for the
    # whole model, largest parameters first), so the whole model is simulated
    whole = args.exact or args.offload_budget is not None
    if whole or n is None or n <= SCALE_FROM[1]:
        return _simulate(args, config, mesh_shape, blocks=None)
    small = [_simulate(args, config, mesh_shape, blocks=k) for k in SCALE_FROM]
    return scale(small[0], small[1], SCALE_FROM, n)


# [Note: scaled estimates]
# Simulating a 70B model's step on fake tensors takes a minute, and planning means trying
# many meshes and settings. A model's blocks are alike, so what the step holds at a given
# moment grows linearly with their number: the sharded parameters, gradients and optimizer
# state, the activations saved for backward; what does not grow (the embedding, the head,
# the logits, the gathered blocks and communication buffers in flight) is the constant term.
# So the command simulates the model with 4 and with 5 blocks, records the memory at every
# moment of the step (``estimate_memory(..., moments=True)``), names each moment by where it
# is (its block counted from the nearer end: ``_positions``), extrapolates each linearly to
# the model's blocks, and takes the largest: 2 small simulations instead of one of the
# whole model. (The peak itself cannot be extrapolated: a small model peaks at the end of
# the backward, a large one in the forward, where its activations pile up.) ``--exact``
# simulates the whole model; the two agree within 2% on the shipped configs
# (tests/planning/test_estimate_configs.py). A model whose blocks differ (alternating
# attention kinds, dense layers among MoE ones) is always simulated whole.
SCALE_FROM = (4, 5)


def _positions(where: str, blocks: int) -> list[str]:
    """``where`` with its block index named by position from either end, the two blocks at
    each (``layers.s0``, ``layers.s1``, ``layers.e1``, ``layers.e0``; ``[]`` for a block
    further in: its moments never exceed both ends', as memory at a block's moment is linear
    in its index but for what is in flight near the ends: reductions queued behind the last
    backward's, prefetches, the head's activations). ``[where]`` when it names no block."""
    m = re.search(r"layers\.(\d+)\b", where)
    if m is None:
        return [where]
    i = int(m.group(1))
    keys = [f"s{i}"] if i < 2 else []
    keys += [f"e{blocks - 1 - i}"] if blocks - 1 - i < 2 else []
    return [where[: m.start(1)] + k + where[m.end(1) :] for k in keys]


def scale(a: Any, b: Any, at: tuple[int, int], n: int) -> Any:
    """``MemoryEstimate`` ``a`` (``at[0]`` blocks) and ``b`` (``at[1]``), simulated with
    ``moments=True``, extrapolated linearly to ``n`` blocks: each moment's parts, then the
    largest moment is the peak ([Note: scaled estimates])."""
    f = (n - at[1]) / (at[1] - at[0])

    def lin(x: int, y: int) -> int:
        return max(0, round(y + (y - x) * f))

    def named(est: Any, blocks: int) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for where, parts in est.moments.items():
            for key in _positions(where, blocks):
                out[key] = parts
        return out

    def rename(where: str) -> str:
        for k, i in (("s0", 0), ("s1", 1), ("e1", n - 2), ("e0", n - 1)):
            where = where.replace(f"layers.{k}", f"layers.{i}")
        return where

    ma, mb = named(a, at[0]), named(b, at[1])
    moments = {key: {k: lin(ma[key][k], mb[key][k]) for k in mb[key]} for key in mb if key in ma}
    when = max(moments, key=lambda key: sum(moments[key].values()))
    parts = moments[when]
    held = {k: lin(a.held[k], b.held[k]) for k in b.held}
    on_host = {k: lin(a.held_on_host[k], b.held_on_host[k]) for k in b.held_on_host}
    # the groups gathered at that moment of the 3-block run, named as in the whole model
    at_when = next(w for w in b.moments if when in _positions(w, at[1]))
    unsharded = tuple(
        rename((_positions(g, at[1]) or [g])[-1]) for g in b.moment_unsharded[at_when]
    )
    return replace(
        b,
        peak_bytes=sum(parts.values()),
        parts=parts,
        held=held,
        held_on_host=on_host,
        when=rename(when),
        unsharded=unsharded,
        host_peak_bytes=lin(a.host_peak_bytes, b.host_peak_bytes),
        settings=f"{b.settings}, scaled from {at[0]} and {at[1]} blocks",
        moments={},
        moment_unsharded={},
    )


def _simulate(
    args: argparse.Namespace, config: Any, mesh_shape: tuple[int, ...], blocks: int | None
) -> Any:
    """One ``estimate_memory`` run: of the whole model, or (``blocks``) of the model cut to
    that many blocks, recording every moment for ``scale``."""
    scaled = blocks is not None
    import torch

    import fsdp2
    from fsdp2.planning import _experts
    from fsdp2.planning._optimizers import muon_and_adamw, states_in

    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 1:
        raise _InputError("the config has no vocab_size: only token-input models are planned")
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    mp = None
    if args.mp == "bf16" and args.param_dtype != "bf16":
        mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    dtype = getattr(torch, _DTYPES[args.param_dtype])
    key = (_fingerprint(config), blocks, args.ac, args.seq, dtype)
    if key not in _BUILT:
        cut = config if blocks is None else _with_layers(config, blocks)
        _BUILT[key] = _model(cut, args.ac, args.seq, dtype)
    model = _BUILT[key]
    own = isinstance(config, _OwnConfig)
    state_dtype = getattr(torch, _DTYPES[args.optim_dtype]) if args.optim_dtype else None
    if args.optimizer == "muon":
        if state_dtype not in (None, dtype):
            raise _InputError("--optim-dtype applies to adamw, adam and sgd, not muon")
        optimizer: Any = muon_and_adamw(model)
    elif state_dtype not in (None, dtype):
        optimizer = states_in(args.optimizer, state_dtype, args.shard_over_replicas)
    else:
        optimizer = args.optimizer
    offload: Any = fsdp2.CPUOffloadPolicy() if args.offload else None
    chosen = ""
    if args.offload_budget is not None:  # cpu_offload_by_budget's selection, model-wide
        offload = fsdp2.cpu_offload_by_budget(model, args.offload_budget)
        from fsdp2.planning.estimate import _fmt

        size = sum(model.get_parameter(n).nbytes for n in offload)
        chosen = f", offload budget {_fmt(args.offload_budget)}: {_fmt(size)} of parameters"
    try:
        with _quiet_extras(), _grouped_mm_as_output():
            est = fsdp2.estimate_memory(
                model,
                (ids, ids) if own else {"input_ids": ids, "labels": ids},
                mesh_shape=mesh_shape,
                device=args.device,
                reshard_after_forward=args.reshard_after_forward,
                mp_policy=mp,
                offload_policy=offload,
                # --experts-dim: see [Note: expert placement] in fsdp2/planning/_experts.py
                shard_placement_fn={"auto": "auto", "0": None, "1": _experts.on_dim1}[
                    args.experts_dim
                ],
                optimizer=optimizer,
                step_fn=(lambda m, b: m(*b)) if own else None,  # Llama(tokens, targets) -> loss
                compare=False,
                moments=scaled,
                shard_over_replicas=args.shard_over_replicas,
            )
    except (ValueError, TypeError, RuntimeError) as e:  # one line, not a traceback
        raise _InputError(str(e).splitlines()[0]) from e
    compute = "bf16" if args.mp == "bf16" or args.param_dtype == "bf16" else "fp32"
    states = args.optim_dtype or args.param_dtype
    what = f"{args.param_dtype} parameters, {compute} compute, {args.optimizer} state in {states}"
    return replace(est, settings=f"{est.settings}, {what}{chosen}")


@contextlib.contextmanager
def _experts_warnings(experts_dim: str, shape: tuple[int, ...], said: set[str]) -> Iterator[None]:
    """Prints the estimate's warnings that its model holds stacked experts padded, worded for
    the command, once each ([Note: expert placement] in fsdp2/planning/_experts.py); other
    warnings are shown as they came."""
    from fsdp2.planning._experts import PaddedExperts, message

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PaddedExperts)
        yield
    fix = (
        "--experts-dim auto (the default) shards them on dim 1, as torchtitan does."
        if experts_dim == "0"
        else "Their dim 1 does not divide evenly over the shard ranks, so --experts-dim auto "
        "kept dim 0: pick a world size, or an HSDP --mesh RxS, whose shard size divides it."
    )
    for w in caught:
        if not isinstance(w.message, PaddedExperts):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
            continue
        text = f"fsdp2 estimate: warning: mesh {'x'.join(map(str, shape))}: "
        text += message(w.message.found, fix)
        if text not in said:
            said.add(text)
            print(text, file=sys.stderr)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def _on_host(est: Any) -> str | None:
    """The line saying what rests on the host between steps (CPU offload), or ``None``."""
    from fsdp2.planning.estimate import _fmt

    held = {k: v for k, v in est.held_on_host.items() if v}
    parts = ", ".join(f"{k} {_fmt(v)}" for k, v in held.items())
    return f"on the host between steps: {_fmt(sum(held.values()))} ({parts})" if held else None


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
        "held": est.held,
        "held_on_host": est.held_on_host,
    }
    if budget is not None:
        out["device_memory_bytes"] = budget
        out["fits"] = est.peak_bytes <= budget
    return out


def _name(config: Any) -> str:
    return config.name if isinstance(config, _OwnConfig) else type(config).__name__


def cmd_estimate(args: argparse.Namespace) -> int:
    from fsdp2.checkpoint._save import parse_size

    budget = None
    if args.device_memory is not None:
        try:
            budget = parse_size(args.device_memory, "--device-memory")
        except ValueError as e:
            raise _InputError(str(e)) from e
    shapes = args.sweep or [args.mesh]
    if args.shard_over_replicas and not any(len(s) == 2 for s in shapes):
        raise _InputError(
            "--shard-over-replicas shards HSDP's gradients and optimizer state over its "
            "replicas: it needs an HSDP mesh, --mesh RxS (or RxS meshes in --sweep)"
        )
    if args.shard_over_replicas and args.optimizer == "muon":  # (Muon updates whole matrices)
        raise _InputError("--shard-over-replicas steps pieces of shards: adamw, adam or sgd")
    if args.plot:
        check_plot(args.plot)
    config = _config(args.config)
    over = args.shard_over_replicas  # a sweep shows each HSDP mesh without it and with it
    runs = [(s, p) for s in shapes for p in ((False, True) if over and args.sweep else (over,))]
    runs = [(s, p) for s, p in runs if len(s) == 2 or not p]
    results, said = [], set[str]()
    for shape, pieces in runs:
        with _experts_warnings(args.experts_dim, shape, said):
            run = argparse.Namespace(**{**vars(args), "shard_over_replicas": pieces})
            results.append(_estimate(run, config, shape))
    if args.plot:
        title = f"{_name(config)}, {args.batch} x {args.seq} tokens per rank, {args.optimizer}"
        plot(args.plot, title, results, budget)
    if args.json:
        dicts = [_as_dict(est, budget) for est in results]
        print(json.dumps(dicts if args.sweep else dicts[0], indent=1))
        return 0
    if args.sweep:
        print(
            f"{_name(config)}, batch {args.batch} x {args.seq} tokens per rank, "
            f"{results[0].settings}, {results[0].device}"
        )
        head = ["mesh", "peak GiB", "params", "grads", "optimizer", "activations", "comm"]
        print(" | ".join(head) + (" | fits" if budget else ""))
        for est, (shape, pieces) in zip(results, runs, strict=True):
            p = est.parts
            cells = [
                "x".join(map(str, shape)) + (" over replicas" if pieces else ""),
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
    host = _on_host(est)
    if host is not None:
        print(host)
    if budget is not None:
        verdict = "fits" if est.peak_bytes <= budget else "does NOT fit"
        print(f"{verdict} in {_gib(budget)} GiB of device memory")
    return 0
