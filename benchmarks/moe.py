"""fsdp2 vs torch's FSDP2 on the expert-parallel MoE: step time, peak memory, bytes per mesh.

The model is ``fsdp2.models.MoETransformer`` in torchtitan's layout (``apply_expert_parallel``
+ ``parallelize_moe``, as in tests/integrations/test_moe.py): on 4 gloo ranks the experts are
split over ``ep`` (default 2, all-to-all token dispatch) and sharded by FSDP over ``efsdp``
(4 / ep), the dense weights over all 4 ranks (``dp``); one ``fully_shard`` per block with a
``shard_placement_fn`` (two parameter groups per block), divide factor 1 and each rank's loss
divided by 4 ([Note: MoE loss scaling] in fsdp2/models/moe.py). ``--ep 1``: plain FSDP over
4 ranks, every expert local.

Both engines train the same model (same init, same data) in one process group, AdamW; steps
are interleaved, one of each in turn, the order alternating every repeat, so machine noise
hits both alike. Reported per engine (rank 0's times; memory and bytes per rank):

* the median step time over ``--steps`` repeats after ``--warmup``, and the per-repeat ratio
  fsdp2 / torch (the two stepped back to back): its median and range;
* the peak live memory of one step (``_memory.peak_step_bytes``: persistent shards, gradients
  and AdamW state plus the C heap's high-water mark during the step), rank 0 and the max over
  ranks, and for fsdp2 ``fsdp2.estimate_memory``'s simulated peak of rank 0 (computed in the
  parent before the ranks start; the MoE layers assume balanced routing there, see
  fsdp2/models/moe.py). Each engine's peak is measured twice, once stepped first and once
  second (after the other engine's step on the same routing), and the lower is kept: the
  engine that first meets a routing (new per-expert token counts, new matmul shapes) can pay
  for C-heap growth that is no tensor (seen in bf16: ``aten.mm`` keeps ~0.25-0.5 MiB per new
  shape, 3-8 MiB a step, whichever engine goes first); both measurements are printed too;
* the all-gather, reduce-scatter and all-reduce bytes one rank issues in one step, per process
  group, labelled by mesh name and size (``dp(4)``, ``efsdp(2)``): an all-gather's input
  (this rank's shard), a reduce-scatter's input (every rank's rows), an all-reduce's tensor.
  fsdp2's through its observer interface (however carried: on gloo it reduce-scatters with an
  in-place all-reduce, counted as a reduce-scatter), torch's by wrapping ``torch.distributed``'s
  collectives during the step, as tests/comm_counter.py does. The MoE's own all-to-alls (the
  same for both) are not counted;
* the last step's loss, averaged over ranks: the two engines must agree (bitwise in fp32).

    python benchmarks/moe.py                          # the table in docs/benchmarks.md
    python benchmarks/moe.py --dtype bf16 --reshard false
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _memory import peak_step_bytes  # noqa: E402

import fsdp2  # noqa: E402
from fsdp2._core.support.observe import HUB, Collective, Observer  # noqa: E402
from fsdp2.models import (  # noqa: E402
    MoEConfig,
    MoETransformer,
    apply_expert_parallel,
    parallelize_moe,
)

ENGINES = ("fsdp2", "torch")
WORLD_SIZE = 4
MiB = 2**20
KINDS = ("all-gather", "reduce-scatter", "all-reduce")
# torch.distributed's collectives torch's FSDP2 may call (2.13 renamed the single-tensor ones)
_TORCH_APIS = {
    "all_gather_single": "all-gather",
    "all_gather_into_tensor": "all-gather",
    "reduce_scatter_single": "reduce-scatter",
    "reduce_scatter_tensor": "reduce-scatter",
    "all_reduce": "all-reduce",
}
_INPUT_ARG = ("input_tensor", "input", "tensor")


def moe_config(args: argparse.Namespace) -> MoEConfig:
    return MoEConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        num_experts=args.experts,
        top_k=args.top_k,
        hidden=args.hidden,
        max_seq_len=args.seq,
    )


class Meshes:
    """The dense mesh ``dp`` (all ranks) and, with EP, ``efsdp`` x ``ep``."""

    def __init__(self, ep: int) -> None:
        self.efsdp: DeviceMesh | None = None
        self.ep: DeviceMesh | None = None
        if ep > 1:
            mesh = init_device_mesh("cpu", (WORLD_SIZE // ep, ep), mesh_dim_names=("efsdp", "ep"))
            self.dp = mesh._flatten("dp")
            self.efsdp, self.ep = mesh["efsdp"], mesh["ep"]
        else:
            self.dp = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("dp",))

    def names(self) -> dict[Any, str]:
        """Process group -> ``"name(size)"``."""
        out = {}
        for mesh in (self.dp, self.efsdp, self.ep):
            if mesh is not None:
                name = (mesh.mesh_dim_names or ("?",))[0]
                out.setdefault(mesh.get_group(), f"{name}({mesh.size()})")  # dp first
        return out


def _torch_results() -> Callable[[Shard, DeviceMesh], Any]:
    """torch's ``ShardPlacementResult`` objects, one mesh info per mesh (torch refuses two
    for one process group in a call), as tests/integrations/test_moe.py builds them."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )

    infos: dict[int, FSDPMeshInfo] = {}

    def make(placement: Shard, mesh: DeviceMesh) -> Any:
        if id(mesh) not in infos:
            infos[id(mesh)] = FSDPMeshInfo(mesh, shard_mesh_dim=0)
        return ShardPlacementResult(placement=placement, mesh_info=infos[id(mesh)])

    return make


def build(engine: str, cfg: MoEConfig, meshes: Meshes, args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    if meshes.ep is not None:
        apply_expert_parallel(model, meshes.ep)
    if engine == "fsdp2":
        api: Any = fsdp2
        results: Callable[[Shard, DeviceMesh], Any] = fsdp2.ShardPlacementResult
    else:
        import torch.distributed.fsdp as api

        results = _torch_results()
    bf16 = args.dtype == "bf16"
    mp_policy = api.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
    )
    return parallelize_moe(
        model,
        fully_shard=api.fully_shard,
        dp_mesh=meshes.dp,
        efsdp_mesh=meshes.efsdp,
        ep_degree=args.ep,
        placement_result=results,
        reshard_after_forward=args.reshard,
        mp_policy=mp_policy,
    )


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The mean loss over this rank's tokens; backpropagate it divided by the world size."""
    loss: torch.Tensor = model(*batch)
    return loss


# ---- bytes per mesh ---------------------------------------------------------------------


class _Fsdp2Bytes(Observer):
    def __init__(self, names: dict[Any, str], out: dict[tuple[str, str], int]) -> None:
        self.names, self.out = names, out

    def collective(self, c: Collective) -> None:
        numel = c.input_numel if c.kind == "all-gather" else c.numel
        label = self.names.get(c.group, f"group({c.group_size})")
        self.out[(label, c.kind)] += numel * c.dtype.itemsize


@contextlib.contextmanager
def _torch_bytes(names: dict[Any, str], out: dict[tuple[str, str], int]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for api, kind in _TORCH_APIS.items():
            orig = getattr(dist, api, None)
            if orig is None:
                continue
            sig = inspect.signature(orig)

            def counted(
                *a: Any, _orig: Any = orig, _sig: Any = sig, _kind: str = kind, **k: Any
            ) -> Any:
                bound = _sig.bind(*a, **k).arguments
                tensor = next(bound[n] for n in _INPUT_ARG if n in bound)
                group = bound.get("group")
                size = dist.get_world_size(group)
                label = names.get(group, f"group({size})")
                out[(label, _kind)] += tensor.numel() * tensor.element_size()
                return _orig(*a, **k)

            stack.enter_context(mock.patch.object(dist, api, counted))
        yield


def count_bytes(
    engine: str, names: dict[Any, str], step: Callable[[], object]
) -> dict[tuple[str, str], int]:
    """``(mesh label, kind) -> bytes`` of the collectives ``engine`` issues in ``step()``."""
    out: dict[tuple[str, str], int] = defaultdict(int)
    if engine == "fsdp2":
        with HUB.observing(_Fsdp2Bytes(names, out)):
            step()
    else:
        with _torch_bytes(names, out):
            step()
    return dict(out)


# ---- the ranks ----------------------------------------------------------------------------


def worker(rank: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    torch.set_num_threads(args.threads)
    cfg = moe_config(args)
    meshes = Meshes(args.ep)
    models = {e: build(e, cfg, meshes, args) for e in ENGINES}
    optims = {e: make_optimizer(m.parameters()) for e, m in models.items()}
    total = args.warmup + args.steps
    gen = torch.Generator().manual_seed(1234)
    data = torch.randint(
        0, cfg.vocab_size, (total, WORLD_SIZE * args.batch, args.seq + 1), generator=gen
    )

    def step(engine: str, i: int) -> float:
        batch = data[i, rank * args.batch : (rank + 1) * args.batch]
        loss = loss_fn(models[engine], (batch[:, :-1], batch[:, 1:]))
        (loss / WORLD_SIZE).backward()
        optims[engine].step()
        optims[engine].zero_grad()
        return loss.item()

    times: dict[str, list[float]] = {e: [] for e in ENGINES}
    losses: dict[str, float] = {}
    for i in range(total):
        order = ENGINES if i % 2 == 0 else ENGINES[::-1]
        for engine in order:
            dist.barrier()
            t0 = time.perf_counter()
            losses[engine] = step(engine, i)
            if i >= args.warmup:
                times[engine].append(time.perf_counter() - t0)
    names = meshes.names()
    comm = {}
    for engine in ENGINES:
        dist.barrier()
        comm[engine] = count_bytes(engine, names, functools.partial(step, engine, total - 1))
    # Twice, each engine stepped first once and second once (see the module docstring).
    peaks: dict[str, list[int]] = {e: [] for e in ENGINES}
    for order in (ENGINES, ENGINES[::-1]):
        for engine in order:
            dist.barrier()
            partial = functools.partial(step, engine, total - 1)
            peaks[engine].append(peak_step_bytes(partial, models[engine], optims[engine]))
    loss_t = torch.tensor([losses[e] for e in ENGINES], dtype=torch.float64)
    dist.all_reduce(loss_t)
    mine = torch.tensor([peaks[e] for e in ENGINES], dtype=torch.float64)  # (engine, order)
    every_peak = [torch.zeros_like(mine) for _ in range(WORLD_SIZE)]
    dist.all_gather(every_peak, mine)
    if rank == 0:
        out["times"] = times
        out["losses"] = dict(zip(ENGINES, (loss_t / WORLD_SIZE).tolist(), strict=True))
        out["peaks"] = [p.tolist() for p in every_peak]  # [rank][engine][order]
        out["comm"] = comm
        out["bitwise"] = losses["fsdp2"] == losses["torch"]
    dist.destroy_process_group()


# ---- the estimate (parent process, before the ranks start) ------------------------------------


def estimate(args: argparse.Namespace) -> fsdp2.MemoryEstimate:
    """``fsdp2.estimate_memory`` of fsdp2's step, rank 0. ``build`` makes its meshes and
    shards on the meta device outside the fake mode (building a mesh and sharding DTensor
    experts read mesh tensors, which fake tensors cannot); the simulation materializes the
    sharded model as fake tensors."""
    cfg = moe_config(args)

    def build_fake(mesh: DeviceMesh) -> nn.Module:
        with unset_fake_temporarily(), torch.device("meta"):
            return build("fsdp2", cfg, Meshes(args.ep), args)

    def step_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return loss_fn(model, batch) / WORLD_SIZE

    tokens = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    return fsdp2.estimate_memory(
        build_fake,
        (tokens, tokens),
        mesh_shape=WORLD_SIZE,
        device="cpu",
        optimizer=make_optimizer,
        step_fn=step_fn,
        compare=False,
    )


def report(args: argparse.Namespace, res: Any, est: fsdp2.MemoryEstimate) -> None:
    times, losses, comm = res["times"], res["losses"], res["comm"]
    # [rank][engine]: the lower of each engine's two measurements (stepped first, second)
    peaks = [[min(by_order) for by_order in rank] for rank in res["peaks"]]
    med = {e: statistics.median(times[e]) for e in ENGINES}
    paired = sorted(a / b for a, b in zip(times["fsdp2"], times["torch"], strict=True))
    tokens = WORLD_SIZE * args.batch * args.seq
    layout = (
        f"efsdp {WORLD_SIZE // args.ep} x ep {args.ep}, dense dp {WORLD_SIZE}"
        if args.ep > 1
        else f"FSDP over {WORLD_SIZE}, no EP"
    )
    with torch.device("meta"):
        n_params = sum(p.numel() for p in MoETransformer(moe_config(args)).parameters())
    print(f"# python {' '.join(sys.argv)}")
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cpus, torch {torch.__version__}, gloo, {WORLD_SIZE} ranks ({layout}), "
        f"{args.threads} thread(s)/rank; MoE {args.layers} layers dim {args.dim}, "
        f"{args.experts} experts top-{args.top_k} hidden {args.hidden}, vocab {args.vocab}, "
        f"{n_params / 1e6:.1f}M params; batch {args.batch}x{args.seq}/rank, {args.dtype}, "
        f"reshard_after_forward={args.reshard}, AdamW; {args.steps} steps after {args.warmup} "
        "warm-up (median)"
    )
    print()
    print(
        "| engine | step s | tokens/s | step vs torch | peak MiB rank 0 | peak MiB max/rank "
        "| mem vs torch | estimate MiB (rank 0) | last loss |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rank0 = dict(zip(ENGINES, peaks[0], strict=True))
    top = {e: max(p[k] for p in peaks) for k, e in enumerate(ENGINES)}
    for e in ENGINES:
        est_cell = "-"
        if e == "fsdp2":
            err = (est.peak_bytes - rank0[e]) / rank0[e]
            est_cell = f"{est.peak_bytes / MiB:.1f} ({err:+.1%})"
        print(
            f"| {e} | {med[e]:.3f} | {tokens / med[e]:,.0f} | {med[e] / med['torch']:.2f}x | "
            f"{rank0[e] / MiB:.1f} | {top[e] / MiB:.1f} | {top[e] / top['torch']:.2f}x | "
            f"{est_cell} | {losses[e]:.6f} |"
        )
    print()
    print(
        f"fsdp2 / torch step, per repeat: median {statistics.median(paired):.3f}x, range "
        f"{paired[0]:.3f}-{paired[-1]:.3f}x over {len(paired)} repeats; last losses "
        f"{'bitwise equal' if res['bitwise'] else 'DIFFER'} (rank 0)"
    )
    print(
        "peak MiB per rank: "
        + "; ".join(
            f"{e} " + " / ".join(f"{p[k] / MiB:.1f}" for p in peaks) for k, e in enumerate(ENGINES)
        )
    )
    first_second = [
        f"{e} {max(r[k][0] for r in res['peaks']) / MiB:.1f} / "
        f"{max(r[k][1] for r in res['peaks']) / MiB:.1f}"
        for k, e in enumerate(ENGINES)
    ]
    print(
        f"peak MiB max over ranks, measured with fsdp2 stepped first / torch first: "
        f"{'; '.join(first_second)}"
    )
    print()
    labels = sorted({label for e in ENGINES for label, _ in comm[e]})
    print("| engine | mesh | all-gather MiB/step | reduce-scatter MiB/step | all-reduce MiB/step |")
    print("| --- | --- | ---: | ---: | ---: |")
    for e in ENGINES:
        for label in labels:
            cells = " | ".join(f"{comm[e].get((label, k), 0) / MiB:.2f}" for k in KINDS)
            print(f"| {e} | {label} | {cells} |")
    print()
    print(f"estimate: {est.when}; " + ", ".join(
        f"{part} {n / MiB:.1f}" for part, n in est.parts.items() if n
    ) + " MiB")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512, help="each expert's hidden size")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--steps", type=int, default=20, help="timed repeats (one step of each)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ep", type=int, default=2, help="expert-parallel degree (1: no EP)")
    ap.add_argument("--reshard", type=lambda s: s.lower() in ("1", "true", "yes"), default=True)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--port", type=int, default=29565)
    args = ap.parse_args(argv)
    if args.ep < 1 or WORLD_SIZE % args.ep or args.experts % args.ep:
        ap.error(f"--ep must divide the world size {WORLD_SIZE} and --experts {args.experts}")
    est = estimate(args)
    out = mp.Manager().dict()
    mp.spawn(worker, args=(args, out), nprocs=WORLD_SIZE)
    report(args, dict(out), est)


if __name__ == "__main__":
    main()
