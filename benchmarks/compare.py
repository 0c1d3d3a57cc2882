"""Step time, tokens/s and peak memory per rank: fsdp2 vs torch's FSDP2, FSDP1,
DDP and an unsharded single-rank compute floor, on the Llama example model.

Every implementation trains the same model (same init, same data) in the same
process group; steps are interleaved (one step of each in turn) so machine
noise hits all alike. Prints a table with ratios to torch's FSDP2 and the loss
at the last step of each (they must agree).

    python benchmarks/compare.py --world-size 2 --dtype fp32 --reshard true
    python benchmarks/compare.py --float8 --impls fsdp2,torch_fsdp2   # torchao float8
    python benchmarks/compare.py --impls fsdp2_replicate,ddp,torch_replicate,fsdp2
    python benchmarks/compare.py --impls fsdp2,fsdp2_deterministic,fsdp2_exchange,\
        fsdp2_wire_bf16,fsdp2_reduce_bf16,torch_fsdp2     # fsdp2.reduction's ways

``fsdp2_deterministic`` is ``fsdp2.reduction.set_deterministic``; ``fsdp2_exchange`` /
``fsdp2_wire_bf16`` / ``fsdp2_wire_fp8`` reduce by exchange with an fp32 / bf16 / fp8 wire
(``set_exchange_reduce``); ``fsdp2_reduce_bf16`` is ``reduce_dtype=torch.bfloat16``.

``--float8`` converts every linear layer but the output head with torchao's float8
training and float8 all-gather (``enable_fsdp_float8_all_gather=True``), and calls
``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step. The table's
``AG MiB`` column is the all-gather input bytes one rank sends in one step.

``--baseline DIR`` adds ``fsdp2_baseline``: the ``fsdp2`` package under DIR (e.g. a
``git worktree`` of an older commit) imported as a second package and sharding the
model exactly as ``fsdp2`` does, stepped right after ``fsdp2`` in every repeat (or where
``--impls`` puts ``fsdp2_baseline``), to measure a change A/B in one run. Below the table
it prints fsdp2 / fsdp2_baseline: the step ratio of the medians, the median and range of
the per-repeat ratios (the two stepped back to back), and the peak-memory ratio. DIR's
fsdp2 is loaded by ``benchmarks/_baseline.py`` (either import style).

    git worktree add /tmp/before HEAD~1
    python benchmarks/compare.py --impls fsdp2,torch_fsdp2 --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import platform
import statistics
import sys
import time
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _baseline import BASELINE, load_baseline, runtime_fsdp2_imports  # noqa: E402
from _memory import peak_step_bytes  # noqa: E402

from fsdp2._core.support.observe import HUB, Collective, Observer  # noqa: E402
from fsdp2.models import Llama, LlamaConfig, TransformerBlock  # noqa: E402

IMPLS = ("fsdp2", "torch_fsdp2", "torch_fsdp1", "ddp", "single")
# also: fsdp2_replicate / torch_replicate (``replicate`` on every block and the root)
MORE_IMPLS = ("fsdp2_replicate", "torch_replicate", "fsdp2_reduce_bf16", "fsdp2_deterministic")
# fsdp2 reducing by exchange (fsdp2.reduction): the wire's dtype, summed in fp32
WIRE_IMPLS = {
    "fsdp2_exchange": None,
    "fsdp2_wire_bf16": "bfloat16",
    "fsdp2_wire_fp8": "float8_e4m3fn",
}


class _AllGathers(Observer):
    """Sums the bytes of fsdp2's all-gathers (however carried), and knows when fsdp2 is
    inside one of its "... issue" regions (its own ``torch.distributed`` calls)."""

    def __init__(self) -> None:
        self.sent = 0
        self.depth = 0

    def collective(self, c: Collective) -> None:
        if c.kind == "all-gather":
            self.sent += c.input_numel * c.dtype.itemsize

    def enter(self, kind: str, what: str) -> None:
        self.depth += kind.endswith(" issue")

    def exit(self, kind: str) -> None:
        self.depth -= kind.endswith(" issue")


def build(cfg: LlamaConfig, float8: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = Llama(cfg)
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model,
            config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
            module_filter_fn=lambda m, fqn: fqn != "output",
        )
    return model


def all_gather_bytes(fn) -> int:  # type: ignore[no-untyped-def]
    """Bytes of all-gather input this rank sends while ``fn()`` runs: fsdp2's through its
    observer interface, everyone else's (torch's, the baseline's) through ``torch.distributed``
    and the baseline's own gloo exchanges."""
    fsdp2_seen, baseline_seen = _AllGathers(), _AllGathers()
    sent = [0]
    patches = []
    for name in ("all_gather_single", "all_gather_into_tensor"):
        orig = getattr(dist, name, None)
        if orig is None:
            continue

        def counted(output, input, *a, _orig=orig, **k):  # type: ignore[no-untyped-def]
            if not (fsdp2_seen.depth or baseline_seen.depth):
                sent[0] += input.numel() * input.element_size()
            return _orig(output, input, *a, **k)

        patches.append(mock.patch.object(dist, name, counted))
    baseline_hub = getattr(sys.modules.get(f"{BASELINE}._core.observe"), "HUB", None)
    if BASELINE in sys.modules and baseline_hub is None:  # before the observer interface
        mod = importlib.import_module(f"{BASELINE}._collectives")
        exchange = getattr(mod, "_all_gather_by_exchange", None)
        if exchange is not None:

            def counted_exchange(output, input, group, _orig=exchange):  # type: ignore[no-untyped-def]
                sent[0] += input.numel() * input.element_size()
                return _orig(output, input, group)

            patches.append(mock.patch.object(mod, "_all_gather_by_exchange", counted_exchange))
        into = getattr(mod, "all_gather_into", None)  # straight into the parameters
        if into is not None:

            def counted_into(input, sizes, rows, group, _orig=into):  # type: ignore[no-untyped-def]
                sent[0] += input.numel() * input.element_size()
                return _orig(input, sizes, rows, group)

            patches.append(mock.patch.object(mod, "all_gather_into", counted_into))
    for patch in patches:
        patch.start()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(HUB.observing(fsdp2_seen))
            if baseline_hub is not None:  # the baseline's own observer interface
                stack.enter_context(baseline_hub.observing(baseline_seen))
            fn()
    finally:
        for patch in patches:
            patch.stop()
    return sent[0] + fsdp2_seen.sent + baseline_seen.sent


def llama_config(args: argparse.Namespace) -> LlamaConfig:
    """The model shape from the command line (``--vocab --dim --layers --heads --seq``)."""
    return LlamaConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=args.seq,
    )


def wrap(impl: str, model: nn.Module, mesh, args) -> nn.Module:  # type: ignore[no-untyped-def]
    bf16 = args.dtype == "bf16"
    ours = ("fsdp2", "fsdp2_reduce_bf16", "fsdp2_deterministic", *WIRE_IMPLS)
    if impl in (*ours, BASELINE, "torch_fsdp2"):
        if impl in ours:
            import fsdp2 as api
        elif impl == BASELINE:
            api = sys.modules[BASELINE]
        else:
            import torch.distributed.fsdp as api
        fully_shard = api.fully_shard
        mp_policy = api.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.bfloat16
            if impl == "fsdp2_reduce_bf16"
            else torch.float32
            if bf16
            else None,
        )
        CPUOffloadPolicy, OffloadPolicy = api.CPUOffloadPolicy, api.OffloadPolicy
        # pin_memory needs an accelerator; on CPU meshes the policy moves nothing anyway.
        offload = CPUOffloadPolicy(pin_memory=False) if args.offload else OffloadPolicy()
        kw = {"mp_policy": mp_policy, "offload_policy": offload}
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=args.reshard, **kw)
        fully_shard(model, mesh=mesh, **kw)
        if impl == "fsdp2_deterministic":
            from fsdp2.reduction import set_deterministic

            set_deterministic(model)
        if impl in WIRE_IMPLS:
            from fsdp2.reduction import set_exchange_reduce

            wire = WIRE_IMPLS[impl]
            set_exchange_reduce(model, None if wire is None else getattr(torch, wire))
        return model
    if impl in ("fsdp2_replicate", "torch_replicate"):  # DDP's communication, FSDP2's API
        if impl == "fsdp2_replicate":
            import fsdp2 as api

            replicate = api.replicate
        else:
            import torch.distributed.fsdp as api
            from torch.distributed._composable.replicate_with_fsdp import replicate
        mp_policy = api.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
        )
        for block in model.layers:
            replicate(block, mesh=mesh, mp_policy=mp_policy)
        replicate(model, mesh=mesh, mp_policy=mp_policy)
        return model
    if impl == "torch_fsdp1":
        from torch.distributed.fsdp import (
            FullyShardedDataParallel,
            MixedPrecision,
            ShardingStrategy,
        )
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
            sharding_strategy=ShardingStrategy.FULL_SHARD
            if args.reshard
            else ShardingStrategy.SHARD_GRAD_OP,
            mixed_precision=MixedPrecision(torch.bfloat16, torch.float32) if bf16 else None,
            use_orig_params=True,
            device_id=torch.device("cpu") if mesh.device_type == "cpu" else None,
        )
    if impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    return model  # single: the unsharded compute floor, no communication


def worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    torch.set_num_threads(args.threads)
    mesh = init_device_mesh("cpu", (args.world_size,))
    cfg = llama_config(args)
    impls = impl_list(args)
    if args.baseline:
        load_baseline(args.baseline)
    models, optims = {}, {}
    for impl in impls:
        models[impl] = wrap(impl, build(cfg, args.float8), mesh, args)
        optims[impl] = torch.optim.AdamW(models[impl].parameters(), lr=1e-3, foreach=True)
    gen = torch.Generator().manual_seed(1234)
    total = args.steps + args.warmup
    data = torch.randint(
        0, cfg.vocab_size, (total, args.world_size * args.batch, args.seq + 1), generator=gen
    )

    def step(impl: str, i: int) -> float:
        batch = data[i, rank * args.batch : (rank + 1) * args.batch]
        model = models[impl]
        use_autocast = args.dtype == "bf16" and impl in ("ddp", "single")
        with torch.autocast("cpu", torch.bfloat16, enabled=use_autocast):
            loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        optims[impl].step()
        optims[impl].zero_grad()
        if args.float8 and impl in ("fsdp2", BASELINE, "torch_fsdp2"):
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)
        return loss.item()

    times: dict[str, list[float]] = {i: [] for i in impls}
    losses: dict[str, float] = {}
    for i in range(total):
        for impl in impls:
            dist.barrier()
            t0 = time.perf_counter()
            losses[impl] = step(impl, i)
            if i >= args.warmup:
                times[impl].append(time.perf_counter() - t0)
    ag_bytes = {}
    for impl in impls:
        dist.barrier()
        ag_bytes[impl] = all_gather_bytes(functools.partial(step, impl, total - 1))
    peaks = {}
    for impl in impls:
        dist.barrier()
        peaks[impl] = peak_step_bytes(
            functools.partial(step, impl, total - 1), models[impl], optims[impl]
        )
    loss_t = torch.tensor([losses[i] for i in impls])
    dist.all_reduce(loss_t)
    loss_t /= args.world_size
    peak_t = torch.tensor([peaks[i] for i in impls], dtype=torch.float64)
    dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
    if rank == 0:
        report(args, impls, times, loss_t.tolist(), peak_t.tolist(), ag_bytes)
    dist.destroy_process_group()


def report(args, impls, times, losses, peaks, ag_bytes) -> None:  # type: ignore[no-untyped-def]
    tokens = args.world_size * args.batch * args.seq
    med = {i: statistics.median(times[i]) for i in impls}
    ref = "torch_fsdp2" if "torch_fsdp2" in impls else impls[0]
    print(f"# python {' '.join(sys.argv)}")
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cpus, torch {torch.__version__}, gloo, world {args.world_size}, "
        f"{args.layers} layers dim {args.dim}, batch {args.batch}x{args.seq}/rank, {args.dtype}, "
        f"reshard_after_forward={args.reshard}, offload={args.offload}, float8={args.float8}, "
        f"{args.steps} steps (median)"
    )
    print(
        f"| impl | step s | tokens/s | peak MiB/rank | AG MiB/step | step vs {ref} | "
        f"mem vs {ref} | last loss |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    iref = impls.index(ref)
    for k, i in enumerate(impls):
        print(
            f"| {i} | {med[i]:.3f} | {tokens / med[i]:,.0f} | {peaks[k] / 2**20:.0f} | "
            f"{ag_bytes[i] / 2**20:.2f} | "
            f"{med[i] / med[ref]:.2f}x | {peaks[k] / peaks[iref]:.2f}x | {losses[k]:.5f} |"
        )
    if BASELINE in impls and "fsdp2" in impls:
        # Both are stepped in every repeat, so each repeat gives a paired ratio.
        paired = sorted(a / b for a, b in zip(times["fsdp2"], times[BASELINE], strict=True))
        ia, ib = impls.index("fsdp2"), impls.index(BASELINE)
        print(
            f"\nfsdp2 / {BASELINE}: step {med['fsdp2'] / med[BASELINE]:.3f}x (medians; "
            f"per repeat: median {statistics.median(paired):.3f}x, "
            f"{paired[0]:.3f}-{paired[-1]:.3f}x over {len(paired)}), "
            f"peak mem {peaks[ia] / peaks[ib]:.3f}x"
        )


def impl_list(args: argparse.Namespace) -> list[str]:
    """``--impls``, with ``fsdp2_baseline`` right after ``fsdp2`` (or last) under
    ``--baseline`` unless ``--impls`` places it."""
    impls = args.impls.split(",")
    if args.baseline and BASELINE not in impls:
        impls.insert(impls.index("fsdp2") + 1 if "fsdp2" in impls else len(impls), BASELINE)
    return impls


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--reshard", type=lambda s: s.lower() in ("1", "true", "yes"), default=True)
    ap.add_argument("--offload", action="store_true", help="CPUOffloadPolicy (FSDP2 impls)")
    ap.add_argument("--float8", action="store_true", help="torchao float8 + float8 all-gather")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--port", type=int, default=29555)
    ap.add_argument(
        "--baseline", metavar="DIR", help=f"also run DIR's fsdp2 package, as {BASELINE}"
    )
    args = ap.parse_args(argv)
    unknown = set(impl_list(args)) - {*IMPLS, *MORE_IMPLS, *WIRE_IMPLS, BASELINE}
    if unknown:
        choices = ", ".join((*IMPLS, *MORE_IMPLS, *WIRE_IMPLS))
        ap.error(f"unknown --impls {sorted(unknown)}; choose from {choices}")
    if BASELINE in impl_list(args) and not args.baseline:
        ap.error(f"--impls {BASELINE} needs --baseline DIR")
    if args.baseline:
        if not os.path.isfile(os.path.join(args.baseline, "fsdp2", "__init__.py")):
            ap.error(f"--baseline: no fsdp2 package under {args.baseline}")
        late = runtime_fsdp2_imports(args.baseline)
        if late:
            ap.error(f"--baseline: {args.baseline}'s fsdp2 imports fsdp2 in functions: {late}")
    mp.spawn(worker, args=(args,), nprocs=args.world_size)


if __name__ == "__main__":
    main()
