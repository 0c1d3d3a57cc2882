"""Train a byte-level Llama with fsdp2: the project's example trainer.

Run it with ``make train`` or ``torchrun --standalone --nproc_per_node 2 examples/train.py``
(gloo on CPU; NCCL with one GPU per rank when CUDA is available). By default it trains on the
Python standard library's own source files (every machine has them), holds out the last 10 %
as a validation split, and writes the loss plot, ``metrics.json`` and checkpoints under
``--out-dir`` (``runs/train``). ``--help`` lists the options.

Every block and the root are sharded with ``fully_shard`` over a 1D (FSDP) or 2D (HSDP) mesh.
All ranks draw the same global batch from one seeded generator and each trains on its slice,
so a run is reproducible from its seed, and a run resumed from a checkpoint (model, optimizer,
step and the generator's state, saved with ``torch.distributed.checkpoint``) repeats the loss
curve of an uninterrupted one exactly.

``--timeline`` profiles one step (``fsdp2.timeline``): a Chrome trace and a Gantt chart per
rank under ``--out-dir``, and a one-line summary of compute, exposed communication and fsdp2's
own time.

``--estimate`` prints, without training, what one rank will hold at the peak of a step with
these options on ``--mesh`` (default: 2 ranks; any size: nothing is allocated, no process group
is joined): ``fsdp2.estimate_memory``'s table.

``--optimizer muon`` trains the hidden matrices (attention and MLP weights) with
``fsdp2.optim.Muon`` and the rest (embedding, output head, norms) with AdamW, split by
``fsdp2.optim.muon_param_groups``; both follow the same learning-rate schedule, Muon's peaking
at ``--muon-lr`` (its update scaled to AdamW's RMS: ``adjust_lr_fn="match_rms_adamw"``, as in
Moonlight), and both optimizers' state goes into the checkpoints. The default is AdamW for
every parameter.

``--init-from PATH`` starts from a full safetensors (or ``torch.save``) checkpoint instead of a
random init: the model is built on the meta device, sharded, and each rank reads only its own
shards (``fsdp2.checkpoint.load_full_checkpoint``). ``--export PATH`` writes the trained model
as a Hugging Face-style safetensors checkpoint at the end (``save_full_checkpoint``), which
``--init-from`` reads back.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from fsdp2 import MixedPrecisionPolicy, estimate_memory, fully_shard, timeline
from fsdp2.checkpoint import load_full_checkpoint, save_full_checkpoint
from fsdp2.models import Llama, LlamaConfig
from fsdp2.optim import Muon, muon_param_groups, step_on_local_shards

CORPUS_CAP_BYTES = 4 << 20  # of the default corpus; far more than a default run reads
VAL_FRACTION = 0.1
MUON_LR = 2e-2  # --optimizer muon: the hidden matrices' peak learning rate


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors on rank 0 only (every rank still exits with status 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        if rank == 0:
            self.print_usage(sys.stderr)
            self.exit(2, f"{self.prog}: error: {message}\n")
        self.exit(2)


def _int_at_least(low: int):
    """An argparse ``type``: an integer ``>= low``."""

    def parse(value: str) -> int:
        n = int(value)
        if n < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return n

    parse.__name__ = "int"  # argparse's message for a non-number: "invalid int value: 'x'"
    return parse


_positive, _non_negative = _int_at_least(1), _int_at_least(0)


def _mesh_shape(value: str) -> tuple[int, ...]:
    """``--mesh``: ``"4"`` -> ``(4,)`` (FSDP), ``"2x2"`` -> ``(2, 2)`` (HSDP)."""
    try:
        shape = tuple(int(d) for d in value.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) not in (1, 2) or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected N (FSDP) or RxS (HSDP), got {value!r}")
    return shape


def _reshard(value: str) -> bool | int:
    """``--reshard-after-forward``: ``true``, ``false`` or a positive int."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        return _positive(value)
    except (ValueError, argparse.ArgumentTypeError):  # one message for both
        raise argparse.ArgumentTypeError(f"expected true, false or N >= 1, got {value!r}") from None


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, _Parser]:
    """Parse and check the options that need no process group; return them and the parser."""
    p = _Parser(prog="train.py", description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--data", help="a text file or a directory of them (default: the stdlib's *.py files)")
    add("--out-dir", default="runs/train", help="plot, metrics.json (default: runs/train)")
    add("--steps", type=_positive, default=150, help="optimizer steps (150)")
    add("--batch-size", type=_positive, default=8, help="sequences per rank per microbatch (8)")
    add("--seq-len", type=_positive, default=128, help="bytes per sequence (128)")
    add("--grad-accum", type=_positive, default=1, help="microbatches per optimizer step (1)")
    add("--lr", type=float, default=3e-3, help="peak learning rate (3e-3)")
    add(
        "--optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="adamw (default), or muon: Muon for the hidden matrices, AdamW for the rest",
    )
    add("--muon-lr", type=float, default=MUON_LR, help=f"Muon's peak learning rate ({MUON_LR})")
    add("--warmup", type=_non_negative, default=None, help="warmup steps (default: steps/10)")
    add("--grad-clip", type=float, default=1.0, help="max gradient norm (1.0; 0: off)")
    add("--dim", type=_positive, default=192, help="model width (192)")
    add("--layers", type=_positive, default=4, help="transformer blocks (4)")
    add("--heads", type=_positive, default=6, help="attention heads (6)")
    add("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: fp32 reductions")
    add("--mesh", type=_mesh_shape, help="N (FSDP) or RxS (HSDP: replicate x shard)")
    add("--reshard-after-forward", type=_reshard, default=True, help="true, false or N (blocks)")
    add("--seed", type=int, default=0, help="model init and data order (0)")
    add("--eval-every", type=_non_negative, default=50, help="also at the end; 0: only then (50)")
    add("--eval-batches", type=_positive, default=4, help="validation microbatches per rank (4)")
    add("--log-every", type=_positive, default=10, help="progress line every N steps (10)")
    add("--checkpoint-dir", help="default: OUT_DIR/checkpoints")
    add("--save-every", type=_non_negative, default=50, help="also at the end; 0: only then (50)")
    add("--resume", nargs="?", const="latest", help="from the latest or the given step_* dir")
    add("--init-from", help="start from a full safetensors/torch checkpoint (e.g. an --export)")
    add("--export", help="write the final model as safetensors to this directory")
    add(
        "--timeline",
        action="store_true",
        help="profile step 3 (or the last): OUT_DIR/timeline.rank<r>.json (Perfetto) + .png",
    )
    add("--plot", help="loss-curve PNG (default: OUT_DIR/loss.png; 'none': no plot)")
    add(
        "--estimate",
        action="store_true",
        help="print the per-rank peak memory of a step on --mesh (default 2) and exit",
    )
    args = p.parse_args(argv)
    if args.dim % args.heads or (args.dim // args.heads) % 2:
        head = "with an even quotient (the head size)"
        p.error(f"--dim {args.dim} must be a multiple of --heads {args.heads} {head}")
    if not 0 < args.lr < math.inf:
        p.error(f"--lr must be a positive number, got {args.lr}")
    if not 0 < args.muon_lr < math.inf:
        p.error(f"--muon-lr must be a positive number, got {args.muon_lr}")
    if not 0 <= args.grad_clip <= math.inf:
        p.error(f"--grad-clip must be >= 0, got {args.grad_clip}")
    args.warmup = args.steps // 10 if args.warmup is None else args.warmup
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} must be smaller than --steps {args.steps}")
    if args.estimate and args.optimizer != "adamw":
        p.error("--estimate models AdamW's optimizer state only; drop --optimizer muon")
    if args.init_from and args.resume:
        p.error("--init-from and --resume are exclusive (a resumed run has its own weights)")
    args.checkpoint_dir = args.checkpoint_dir or os.path.join(args.out_dir, "checkpoints")
    args.plot = os.path.join(args.out_dir, "loss.png") if args.plot is None else args.plot
    return args, p


def load_corpus(path: str | None, parser: _Parser) -> tuple[torch.Tensor, str]:
    """The training bytes as a uint8 tensor and a description of where they came from.

    ``path`` is a file or a directory (its files, recursively, sorted by path); ``None`` is the
    standard library's ``*.py`` files (site-packages excluded), sorted, up to 4 MiB.
    """
    if path is None:
        root, cap = os.path.dirname(os.__file__), CORPUS_CAP_BYTES
    elif os.path.exists(path):
        root, cap = path, None
    else:
        parser.error(f"--data {path}: no such file or directory")
    if os.path.isfile(root):
        files = [root]
    else:
        files = []
        for d, subdirs, names in os.walk(root):
            skip = ("site-packages", "__pycache__")
            subdirs[:] = sorted(s for s in subdirs if s not in skip and not s.startswith("."))
            wanted = (n for n in sorted(names) if not n.startswith("."))
            files += [os.path.join(d, n) for n in wanted if path or n.endswith(".py")]
    data, n_files = bytearray(), 0
    for f in files:
        if cap is not None and len(data) >= cap:
            break
        with open(f, "rb") as fh:
            data += fh.read()
        n_files += 1
    if not data:
        parser.error(f"--data {path}: no data to train on")
    return torch.frombuffer(data[:cap], dtype=torch.uint8), f"{n_files} files under {root}"


def sample_batch(data: torch.Tensor, n: int, seq_len: int, gen: torch.Generator):
    """``n`` random windows of ``seq_len + 1`` bytes: inputs and next-byte targets."""
    starts = torch.randint(len(data) - seq_len, (n,), generator=gen)
    windows = data[starts[:, None] + torch.arange(seq_len + 1)].long()
    return windows[:, :-1], windows[:, 1:]


def init_distributed() -> tuple[torch.device, bool]:
    """Join (or, under torchrun, create) the default process group; return the device and
    whether this call created the group. CUDA + NCCL with one GPU per rank when available."""
    if dist.is_initialized():  # e.g. the test harness: trust its backend
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device()), False
        return torch.device("cpu"), False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        return torch.device("cuda", torch.cuda.current_device()), True
    # Ranks on one machine share its cores; oversubscribing them slows every rank down.
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_ranks))
    dist.init_process_group("gloo")
    return torch.device("cpu"), True


def build_mesh(args: argparse.Namespace, device: torch.device, parser: _Parser) -> DeviceMesh:
    """The 1D (FSDP) or 2D (HSDP: replicate x shard) mesh that ``--mesh`` asks for."""
    world = dist.get_world_size()
    shape = args.mesh or (world,)
    if math.prod(shape) != world:
        parser.error(
            f"--mesh {'x'.join(map(str, shape))} has {math.prod(shape)} ranks but the world "
            f"size is {world}; use --mesh {world} (FSDP) or RxS with R*S = {world} (HSDP)"
        )
    raf = args.reshard_after_forward
    if not isinstance(raf, bool) and shape[-1] % raf:
        parser.error(f"--reshard-after-forward {raf} must divide the shard size {shape[-1]}")
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def build_model(args: argparse.Namespace, mesh: DeviceMesh, parser: _Parser) -> Llama:
    """A seeded Llama with every block and then the root sharded by ``fully_shard``.

    It is built unsharded on CPU, so its initial weights do not depend on the mesh; a model
    too big for that would be built on the meta device, then ``to_empty`` + ``init_weights``.
    With ``--init-from`` it is built on the meta device and loaded shard by shard.
    """
    torch.manual_seed(args.seed)
    shape = {"dim": args.dim, "n_layers": args.layers, "n_heads": args.heads}
    cfg = LlamaConfig(**shape, max_seq_len=args.seq_len)
    if args.init_from:
        with torch.device("meta"):
            model = Llama(cfg)
    else:
        model = Llama(cfg)
    mp = mp_policy(args)
    raf = args.reshard_after_forward
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=raf, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # the root keeps its default (no reshard)
    if args.init_from:
        model.rope = model._rope(mesh.device_type)  # a non-persistent buffer: in no checkpoint
        try:
            load_full_checkpoint(model, args.init_from)  # materialises the shards, then loads
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            hint = "pass the saving run's --dim, --layers and --heads"
            parser.error(f"--init-from {args.init_from}: {e}; {hint}")
    return model


def build_optimizer(
    model: torch.nn.Module, args: argparse.Namespace
) -> list[torch.optim.Optimizer]:
    """The optimizers, stepped one after the other (``--optimizer``).

    ``adamw``: AdamW over every parameter, weight decay on matrices only, stepping each
    parameter's local shard as a plain tensor (``fsdp2.optim.step_on_local_shards``: the same
    numbers without DTensor's per-op dispatch; its state stays sharded DTensors for
    checkpoints).

    ``muon``: ``fsdp2.optim.Muon`` over the hidden matrices (``muon_param_groups``: the
    attention and MLP weights; each matrix orthogonalized whole on one rank) with the same
    weight decay, and the AdamW above over the rest (embedding and output head with weight
    decay, norms without). ``adjust_lr_fn="match_rms_adamw"`` scales Muon's update to
    AdamW's RMS; its learning rate follows the same schedule, peaking at ``--muon-lr``
    (``lr_at``).
    """
    if args.optimizer == "muon":
        muon_groups, adamw_groups = muon_param_groups(model, muon={"weight_decay": 0.1})
        params = [p for p in adamw_groups[0]["params"] if p.requires_grad]
        muon_groups[0]["params"] = [p for p in muon_groups[0]["params"] if p.requires_grad]
        muon = Muon(muon_groups, lr=args.muon_lr, adjust_lr_fn="match_rms_adamw")
        return [muon, _adamw(params, args)]
    return [_adamw([p for p in model.parameters() if p.requires_grad], args)]


def _adamw(params: list[torch.nn.Parameter], args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW over ``params``: weight decay 0.1 on matrices, none on vectors; local shards."""
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optim = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), foreach=True)
    return step_on_local_shards(optim)


def lr_at(step: int, args: argparse.Namespace, peak: float | None = None) -> float:
    """Linear warmup to ``peak`` (default ``--lr``) over ``--warmup`` steps, then cosine decay
    to ``peak / 10``."""
    peak = args.lr if peak is None else peak
    if step <= args.warmup:
        return peak * step / max(1, args.warmup)
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def mean_over_ranks(value: torch.Tensor) -> float:
    """The average of a scalar over all ranks (gloo has no ``ReduceOp.AVG``)."""
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def train_step(model, optims, x, y, args: argparse.Namespace) -> tuple[float, float]:
    """One optimizer step over ``--grad-accum`` microbatches; returns (loss, grad norm).

    Gradients are reduced only in the last microbatch's backward (fsdp2 accumulates the others
    unsharded, without communication).
    """
    k, total = args.grad_accum, torch.zeros((), device=x.device)
    for i, (xb, yb) in enumerate(zip(x.chunk(k), y.chunk(k), strict=True)):
        model.set_requires_gradient_sync(i == k - 1)
        loss = model(xb, yb)
        (loss / k).backward()
        total += loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf"))
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    for optim in optims:
        optim.step()
    for optim in optims:
        optim.zero_grad(set_to_none=True)
    return mean_over_ranks(total / k), norm.item()


def profiled_step(model, optims, x, y, args: argparse.Namespace) -> tuple[float, float]:
    """``train_step`` under ``fsdp2.timeline``: writes the step's Chrome trace and (with
    matplotlib) its Gantt chart under ``--out-dir``; rank 0 prints the summary."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        png = False
    else:
        png = True
    with timeline(os.path.join(args.out_dir, "timeline"), png=png) as tl:
        out = train_step(model, optims, x, y, args)
    if dist.get_rank() == 0:
        drawn = f", {tl.png_path}" if png else " (no PNG: matplotlib is not installed)"
        print(f"timeline: {tl.summary}\n  {tl.trace_path}{drawn}", flush=True)
    return out


@torch.no_grad()
def evaluate(model, val: torch.Tensor, args: argparse.Namespace, device: torch.device) -> float:
    """Mean loss over fixed, evenly spaced validation windows (the same in every run)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = args.eval_batches * args.batch_size
    starts = torch.linspace(0, len(val) - args.seq_len - 1, n * world).long()
    starts = starts[rank * n : (rank + 1) * n]
    windows = val[starts[:, None] + torch.arange(args.seq_len + 1)].long().to(device)
    model.eval()
    losses = [model(w[:, :-1], w[:, 1:]) for w in windows.split(args.batch_size)]
    model.train()
    return mean_over_ranks(torch.stack(losses).mean())


def checkpoint_state(model, optims, step: int, gen: torch.Generator, history: dict) -> dict:
    """What a checkpoint holds: sharded model and optimizer state (DTensors, each rank saves its
    shards; with several optimizers, all of their state in one dict keyed by parameter name),
    the step, the data generator's state (identical on every rank) and the history."""
    model_sd, optim_sd = get_state_dict(model, optims)
    train = {"step": torch.tensor(step), "rng": gen.get_state(), "history": json.dumps(history)}
    return {"model": model_sd, "optim": optim_sd, "train": train}


def find_checkpoint(args: argparse.Namespace, parser: _Parser) -> str:
    """The directory ``--resume`` names, or the latest ``step_*`` one in ``--checkpoint-dir``."""
    if args.resume != "latest":
        if not os.path.isfile(os.path.join(args.resume, ".metadata")):
            parser.error(f"--resume {args.resume}: not a checkpoint directory")
        return args.resume
    steps = []
    if os.path.isdir(args.checkpoint_dir):  # complete ones only: see save_checkpoint
        steps = sorted(d for d in os.listdir(args.checkpoint_dir) if re.fullmatch(r"step_\d+", d))
    if not steps:
        parser.error(f"--resume: no step_* checkpoint in --checkpoint-dir {args.checkpoint_dir}")
    return os.path.join(args.checkpoint_dir, steps[-1])


def save_checkpoint(state: dict, path: str) -> None:
    """``dcp.save`` into ``<path>.partial``, renamed to ``path`` once every rank has written
    its part and rank 0 the metadata: a save that fails or is killed (a rank dies, the disk
    fills) never leaves a ``step_*`` directory that ``--resume`` would take for complete, and
    older checkpoints stay as they were. Collective."""
    tmp, rank = path + ".partial", dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
    dist.barrier()
    dcp.save(state, checkpoint_id=tmp)  # fsyncs its files; .metadata is written last
    dist.barrier()  # every rank returned: the checkpoint in tmp is complete
    if rank == 0:
        if os.path.isdir(path):  # a rerun over the same step
            shutil.rmtree(path)
        os.rename(tmp, path)
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself on disk
        finally:
            os.close(fd)
    dist.barrier()


def load_checkpoint(path: str, model, optims, gen: torch.Generator, parser: _Parser):
    """Load ``path`` into the sharded model, the optimizers and ``gen``; return (step, history).

    ``dcp.load`` fills the state dict in place (each rank reads the pieces its shards need, so
    the mesh may differ from the saving run's), then ``set_state_dict`` hands it over.
    """
    state = checkpoint_state(model, optims, 0, gen, {})
    try:
        dcp.load(state, checkpoint_id=path)
    except dcp.CheckpointException as e:  # raised on every rank
        detail = str(e).strip().splitlines()[-1]
        hint = "pass the saving run's --dim, --layers, --heads and --optimizer"
        parser.error(f"--resume {path} does not fit this model ({detail}); {hint}")
    set_state_dict(model, optims, model_state_dict=state["model"], optim_state_dict=state["optim"])
    gen.set_state(state["train"]["rng"])
    return int(state["train"]["step"]), json.loads(state["train"]["history"])


def progress_line(step: int, args, loss: float, norm: float, tok_s: float, device) -> str:
    """Rank 0's progress line; collective: it gathers every rank's peak memory (CUDA: allocated
    by tensors; CPU: the process's peak RSS)."""
    if device.type == "cuda":
        mem = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**20], device=device)
    else:  # Linux reports ru_maxrss in KiB
        mem = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])
    mems = [torch.zeros_like(mem) for _ in range(dist.get_world_size())]
    dist.all_gather(mems, mem)
    label = "peak mem" if device.type == "cuda" else "peak RSS"
    bar = "#" * (20 * step // args.steps)
    return (
        f"step {step:4d}/{args.steps} [{bar:.<20}] loss {loss:.4f} | lr {lr_at(step, args):.2e} "
        f"| gnorm {norm:.2f} | {tok_s:,.0f} tok/s "
        f"| {label} MiB/rank {' '.join(f'{m.item():.0f}' for m in mems)}"
    )


def plot_losses(path: str, history: dict) -> str:
    """Write the train/validation loss curves to ``path``; return a line saying what happened."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install -e '.[train]')"
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(history["train"]) + 1), history["train"], lw=1, label="train")
    if history["val"]:
        ax.plot(*zip(*history["val"], strict=True), "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title="byte-level Llama, fsdp2")
    ax.grid(alpha=0.3)
    ax.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return f"loss plot: {path}"


def mp_policy(args: argparse.Namespace) -> MixedPrecisionPolicy:
    """``--dtype``: fp32, or bf16 compute with fp32 gradient reductions."""
    if args.dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def estimate(args: argparse.Namespace, parser: _Parser) -> dict:
    """``--estimate``: ``fsdp2.estimate_memory`` for this model, batch, mesh, dtype and
    ``--reshard-after-forward`` (every block sharded, then the root; AdamW), printed; the
    returned summary holds it under ``"estimate"``. Needs no process group."""
    shape = args.mesh or (2,)
    raf = args.reshard_after_forward
    if not isinstance(raf, bool) and shape[-1] % raf:
        parser.error(f"--reshard-after-forward {raf} must divide the shard size {shape[-1]}")
    cfg = LlamaConfig(
        dim=args.dim, n_layers=args.layers, n_heads=args.heads, max_seq_len=args.seq_len
    )
    with torch.device("meta"):
        model = Llama(cfg)
    tokens = torch.empty(args.batch_size, args.seq_len, dtype=torch.long, device="meta")
    est = estimate_memory(
        model,
        (tokens, tokens),  # inputs and targets: the model returns the loss
        mesh_shape=shape,
        reshard_after_forward=raf,
        mp_policy=mp_policy(args),
        optimizer=lambda ps: step_on_local_shards(
            torch.optim.AdamW(ps, lr=args.lr, betas=(0.9, 0.95), foreach=True)
        ),
    )
    print(est, flush=True)
    keys = ("peak_bytes", "parts", "when", "unsharded", "settings", "world_size", "device")
    return {"estimate": {k: getattr(est, k) for k in keys}}


def main(argv: list[str] | None = None) -> dict:
    """Train; return the summary that ``OUT_DIR/metrics.json`` holds (on every rank).

    Joins the default process group if one exists (tests), else creates one (torchrun) and
    destroys it at the end. Bad options exit with status 2 and a message on rank 0.
    """
    args, parser = parse_args(argv)
    if args.estimate:
        return estimate(args, parser)
    device, owns_group = init_distributed()
    try:
        return train(args, parser, device)
    finally:
        if owns_group:
            dist.destroy_process_group()


def train(args: argparse.Namespace, parser: _Parser, device: torch.device) -> dict:
    """The training loop: data, mesh, model, optimizer, optional resume, steps, outputs."""
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    data, what = load_corpus(args.data, parser)
    n_val = int(len(data) * VAL_FRACTION)
    train_data, val_data = data[: len(data) - n_val], data[len(data) - n_val :]
    if min(len(train_data), len(val_data)) <= args.seq_len:
        parser.error(f"--data has {len(data)} bytes: too few for --seq-len {args.seq_len}")
    mesh = build_mesh(args, device, parser)
    model = build_model(args, mesh, parser)
    optims = build_optimizer(model, args)
    gen = torch.Generator().manual_seed(args.seed)  # the same global batches on every rank
    start, history = 0, {"train": [], "val": []}
    if args.resume:
        path = find_checkpoint(args, parser)
        start, history = load_checkpoint(path, model, optims, gen, parser)
        if start >= args.steps:
            parser.error(f"--resume: {path} is at step {start}, not before --steps {args.steps}")
        say(f"resumed from {path} at step {start}")

    per_step = args.batch_size * args.grad_accum * world  # sequences per optimizer step
    mine = slice(rank * per_step // world, (rank + 1) * per_step // world)
    say(f"data: {len(train_data):,} train / {len(val_data):,} val bytes from {what}")
    say(
        f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params; mesh "
        f"{tuple(mesh.shape)} on {device.type}; {args.dtype}; {per_step * args.seq_len:,} "
        "tokens/step"
    )
    ckpt_path, t_train, t0 = None, 0.0, time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        t_step = time.perf_counter()
        for optim in optims:
            peak = args.muon_lr if isinstance(optim, Muon) else args.lr
            for group in optim.param_groups:
                group["lr"] = lr_at(step, args, peak)
        x, y = sample_batch(train_data, per_step, args.seq_len, gen)
        if args.timeline and step == min(start + 3, args.steps):
            loss, norm = profiled_step(model, optims, x[mine].to(device), y[mine].to(device), args)
        else:
            loss, norm = train_step(model, optims, x[mine].to(device), y[mine].to(device), args)
        t_train += time.perf_counter() - t_step
        history["train"].append(loss)
        if step % args.log_every == 0 or step in (start + 1, args.steps):
            tok_s = per_step * args.seq_len * (step - start) / t_train
            say(progress_line(step, args, loss, norm, tok_s, device), flush=True)
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            history["val"].append([step, evaluate(model, val_data, args, device)])
            say(f"step {step:4d} validation loss {history['val'][-1][1]:.4f}", flush=True)
        if step == args.steps or (args.save_every and step % args.save_every == 0):
            ckpt_path = os.path.join(args.checkpoint_dir, f"step_{step:06d}")
            save_checkpoint(checkpoint_state(model, optims, step, gen, history), ckpt_path)
    if args.export:
        save_full_checkpoint(model, args.export)

    summary = {
        "steps": args.steps,
        "resumed_from": start,
        "wall_s": time.perf_counter() - t0,
        "tokens_per_s": per_step * args.seq_len * (args.steps - start) / t_train,
        "train_loss": history["train"][-1],
        "val_loss": history["val"][-1][1],
        "checkpoint": ckpt_path,
        "export": args.export,
        "history": history,
    }
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
            json.dump({"args": vars(args), **summary}, f, indent=1)
        plotted = "no plot (--plot none)"
        if args.plot != "none":
            plotted = plot_losses(args.plot, history)
        print(
            f"done: {args.steps - start} steps in {summary['wall_s']:.1f} s, "
            f"{summary['tokens_per_s']:,.0f} tok/s; loss {history['train'][0]:.4f} -> "
            f"{summary['train_loss']:.4f} (train), {summary['val_loss']:.4f} (val)\n"
            f"checkpoint: {ckpt_path}\n"
            + (f"exported: {args.export}\n" if args.export else "")
            + plotted,
            flush=True,
        )
    return summary


if __name__ == "__main__":
    main()
