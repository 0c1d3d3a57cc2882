"""Rank side of the call-order suite: a hypothesis state machine that drives a sharded model
and an unsharded replica through the calls a training script makes, in random orders.

``CallOrders`` holds an fsdp2-sharded ``Net`` (three residual blocks, each its own
``fully_shard`` with a drawn ``reshard_after_forward``, one optionally nested, parameters at
the root on both sides of the blocks; each block and the root drawn as sharded, replicated
(``replicate``) or sharded with its 1-D parameters ``Replicate()``) and a replica built
under the same seed that trains on the whole global batch. Each rule does one thing a
script does, to both when it has a meaning for the replica:

* ``train``: forward + backward of a batch (the sharded model on its rank's slice);
* ``forward``: a forward only: with grad (its loss kept for a later ``backward``: two
  forwards then one backward), under ``torch.no_grad()``, or in ``eval()`` mode;
* ``backward``: backward of the kept losses, optionally ``retain_graph=True`` (and again);
* ``penalty``: a gradient penalty, ``torch.autograd.grad(loss, x, create_graph=True)`` then
  one backward of loss + penalty (or of the penalty alone);
* ``freeze``: ``requires_grad_(value)`` on the root, a block, a linear or a root linear;
* ``build_optimizer``: SGD (plain, momentum, weight decay) from ``model.parameters()`` or
  from each module's ``parameters()`` (a plain submodule of the root gives the registered
  tensors), at any point, right after a forward included; or wrapped with
  ``fsdp2.replica_optim.shard_over_replicas`` (the replicated groups then keep gradients and
  momentum in pieces over the ranks, each piece the parameter's ``.grad``; a later plain
  optimizer over them is refused);
* ``optimizer_step`` (the optimizer's own, or a framework's ``GradScaler`` path:
  ``unscale_``, ``step``, ``update``), ``zero_grad`` (``set_to_none`` either way),
  ``clip_grad_norm_`` (``fsdp2.clip_grad_norm_``, ``torch.nn.utils.clip_grad_norm_`` as the
  frameworks clip, or under the deterministic mode ``fsdp2.reduction.clip_grad_norm_``,
  against torch's on the replica; the norms compared);
* ``state_dict_round_trip``: ``load_state_dict(state_dict())``, in memory or through DCP;
* ``unshard_reshard``: explicit ``unshard()`` / ``reshard()`` of the root or a block;
* ``set_sync``: ``set_requires_gradient_sync(False/True)`` (no-sync micro-steps);
* ``set_reshard_after_forward``: on the root or a block;
* ``failing_forward``: a forward that raises inside a block, then ``reset_iter_state()``.

The mixed-precision policy is drawn once per run: off, ``param_dtype=reduce_dtype=float64``
or ``reduce_dtype=float64``; and the reduction mode: the default, the deterministic one
(``fsdp2.reduction.set_deterministic``: a number of micro-batches per reduction that is not a
power of two is its documented error, after which the step is reset on both sides) or the
exchange (``set_exchange_reduce``, an fp32 wire: the comparison's tolerance is fp32's). Each
``train`` draws the loss's scale (1 or 1/2, as a framework divides by its accumulation
steps), the same on both sides. The wider dtype runs every mixed-precision path (casts before the
all-gather and of the inputs, reduction in another dtype, no-sync sums kept in it) while
keeping the comparison with the fp32 replica tight; bf16 numerics are the settings suite's
(test_parity_property.py).

After every rule (``invariant``): every full parameter equals the replica's; outside forward
and backward ``model.parameters()`` gives sharded DTensors or, for a group that is not
sharded, what torch's FSDP2 registers then (its unsharded parameters, or the parameters
resharded to the smaller mesh); and, unless no-sync micro-steps
are pending, every full gradient equals the replica's (both ``None`` or close; a gradient
held in pieces over the ranks by ``shard_over_replicas`` through its ``full_tensor()``). A rule that
raises one of the documented errors (``EXPECTED``) must raise it on every rank; anything
else is ``Unexpected`` and stops the run at once with the rules so far.

Every comparison has a tolerance that holds on any CPU (``RTOL``/``ATOL``): the replica sums
a batch in another order than the ranks do, so nothing here is bitwise.
"""

from __future__ import annotations

import copy
import shutil
import sys
import tempfile
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from models import full_values, mean_over_ranks, rank_slice
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

import fsdp2
from fsdp2 import reduction
from fsdp2._core.support.unsharded import sharded_of
from fsdp2.replica_optim import shard_over_replicas

IN, DIM, HIDDEN, OUT = 5, 6, 7, 3
ROWS_PER_RANK = 2
LR = 0.05
RTOL, ATOL = 1e-4, 1e-5
MAX_PENDING = 2  # losses kept for a later backward
# how each block and the root are wrapped (see CallOrders._apply)
KINDS = ["shard", "replicate", "small"]
POLICIES: dict[str, dict[str, Any]] = {
    "off": {},
    "fp64": {"param_dtype": torch.float64, "reduce_dtype": torch.float64},
    "reduce64": {"reduce_dtype": torch.float64},
}
# where requires_grad_ is called: a module path ("" is the root)
FREEZE_TARGETS = ["", "inp", "head", "layers.0", "layers.1", "layers.1.lin1", "layers.2.lin2"]
# the errors a rule may raise by design: (type, a piece of the message)
EXPECTED = {
    "optimizer_step": (RuntimeError, "would update the unsharded parameter"),
    # a plain optimizer over parameters whose gradients fsdp2.replica_optim keeps in pieces
    "optimizer_step_pieced": (RuntimeError, "sharded over the replicas"),
    # shard_over_replicas over some of a module's parameters, or over unsharded temporaries
    # (or a deterministic model)
    "build_optimizer": (ValueError, "shard_over_replicas: "),
    # the deterministic mode: a reduction of a number of micro-batches that is not 2**j
    "deterministic": (RuntimeError, "power of two"),
}
MODES = ["default", "deterministic", "exchange"]


class PlannedFailure(Exception):
    """Raised inside a block's forward by ``failing_forward``."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(DIM, HIDDEN)
        self.lin2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.tanh(self.lin1(x)))


class Net(nn.Module):
    """``head(tanh(blocks(tanh(inp(x)))))``; ``fail_at`` makes that block's call raise."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, OUT)
        self.fail_at: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for i, block in enumerate(self.layers):
            if i == self.fail_at:
                raise PlannedFailure(f"planned failure before block {i}")
            h = block(h)
        return self.head(torch.tanh(h))


class Unexpected(BaseException):
    """An exception no rule calls for: raised at once past hypothesis (no replay), with the
    rules run so far; the harness reports every rank's traceback or stack."""


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def _close(got: torch.Tensor, want: torch.Tensor, what: str, errors: list[str]) -> None:
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        errors.append(f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}")
        return
    diff = (got - want).abs()
    bad = ~(diff <= ATOL + RTOL * want.abs())  # NaN counts as bad
    if bad.any():
        errors.append(f"{what}: differs from the replica by up to {diff.max().item():.3g}")


def _any_rank(flag: bool) -> bool:
    t = torch.tensor([float(flag)])
    dist.all_reduce(t)
    return bool(t.item())


class CallOrders(RuleBasedStateMachine):
    """See the module docstring. ``mesh`` and ``stats`` are set on a subclass per run."""

    mesh: DeviceMesh
    stats: dict[str, float]

    def __init__(self) -> None:
        super().__init__()
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.log: list[str] = []  # the rules run, for Unexpected's message
        self.batch_no = 0
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ours, replica's)
        self.unsynced = False  # no-sync backwards since the last synced one
        self.sync = True
        self.opt: torch.optim.Optimizer | None = None
        self.ref_opt: torch.optim.Optimizer | None = None
        self.mode = "default"

    # ---- set-up ------------------------------------------------------------------------

    @initialize(
        policy=st.sampled_from(sorted(POLICIES)),
        reshard=st.tuples(st.booleans(), st.booleans(), st.booleans()),
        nested=st.booleans(),
        bucket=st.sampled_from([None, 1 << 20]),
        kinds=st.tuples(*(st.sampled_from(KINDS),) * 4),
        mode=st.sampled_from(MODES),
    )
    def build(
        self,
        policy: str,
        reshard: tuple[bool, bool, bool],
        nested: bool,
        bucket: int | None,
        kinds: tuple[str, ...] = ("shard",) * 4,  # the regression replays' model
        mode: str = "default",
    ) -> None:
        self._note(
            f"build(policy={policy}, reshard={reshard}, nested={nested}, bucket={bucket}, "
            f"kinds={kinds}, mode={mode})"
        )
        torch.manual_seed(1234)
        self.ref = Net()
        model = copy.deepcopy(self.ref)
        mp = fsdp2.MixedPrecisionPolicy(**POLICIES[policy])
        if nested:
            fsdp2.fully_shard(model.layers[1].lin1, mesh=self.mesh, mp_policy=mp)
        for block, r, kind in zip(model.layers, reshard, kinds, strict=False):
            self._apply(block, kind, mp, reshard_after_forward=r)
        self._apply(model, kinds[-1], mp)
        if bucket is not None:
            model.set_bucket_bytes(bucket)
        if mode == "deterministic":
            reduction.set_deterministic(model)
        elif mode == "exchange":
            try:
                reduction.set_exchange_reduce(model, torch.float32)
            except ValueError as e:  # documented: a call with several groups ("small")
                if "parameter groups on different meshes" not in str(e):
                    raise self._unexpected() from None
                self.stats["exchange refused"] = self.stats.get("exchange refused", 0) + 1
                mode = "default"
        self.mode = mode
        self.model = model
        self.stats["runs"] = self.stats.get("runs", 0) + 1

    def _apply(self, module: nn.Module, kind: str, mp: Any, **kw: Any) -> None:
        """``fully_shard`` (``"shard"``), ``replicate`` (``"replicate"``) or ``fully_shard``
        with the 1-D parameters placed ``Replicate()`` (``"small"``)."""
        if kind == "replicate":
            fsdp2.replicate(module, mesh=self.mesh, mp_policy=mp)
            return
        if kind == "small":
            kw["shard_placement_fn"] = lambda p: Replicate() if p.ndim == 1 else None
        fsdp2.fully_shard(module, mesh=self.mesh, mp_policy=mp, **kw)

    # ---- helpers -----------------------------------------------------------------------

    def _note(self, what: str) -> None:
        self.log.append(what)
        self.stats["rules"] = self.stats.get("rules", 0) + 1
        # per rule (the caller's name), so that a run's printout shows what the draws reached
        key = "ran " + sys._getframe(1).f_code.co_name
        self.stats[key] = self.stats.get(key, 0) + 1

    def _unexpected(self) -> Unexpected:
        rules = "\n  ".join(self.log)
        return Unexpected(
            f"rank {self.rank} raised after these rules:\n  {rules}\n{traceback.format_exc()}"
        )

    def _batch(self, features: int = IN) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(10_000 + self.batch_no)
        self.batch_no += 1
        rows = self.world * ROWS_PER_RANK
        return torch.randn(rows, features, generator=g), torch.randn(rows, OUT, generator=g)

    def _mine(self, t: torch.Tensor) -> torch.Tensor:
        return rank_slice(t, self.rank, self.world)

    def _check(self, errors: list[str]) -> None:
        """Fail on every rank together if any rank found a problem."""
        if _any_rank(bool(errors)):
            rules = "\n  ".join(self.log)
            raise AssertionError(f"after these rules:\n  {rules}\n" + "\n".join(errors))

    def _after_backward(self) -> None:
        self.unsynced = not self.sync

    def _deterministic_refused(self, e: RuntimeError) -> bool:
        """The deterministic mode's documented refusal (every rank raised it, before its
        reduction): reset the step on both sides and go on; ``False`` for anything else."""
        kind, text = EXPECTED["deterministic"]
        if self.mode != "deterministic" or text not in str(e):
            return False
        self._check([])  # every rank is here
        self.model.reset_iter_state()  # type: ignore[operator]
        self.model.zero_grad(set_to_none=True)
        self.ref.zero_grad(set_to_none=True)
        self.pending = []
        self.unsynced = False
        self.stats["deterministic refused"] = self.stats.get("deterministic refused", 0) + 1
        return True

    def _module(self, model: nn.Module, path: str) -> nn.Module:
        return model.get_submodule(path) if path else model

    # ---- rules -------------------------------------------------------------------------

    @rule(scale=st.sampled_from([1.0, 0.5]))
    def train(self, scale: float = 1.0) -> None:
        self._note(f"train(scale={scale}) [sync={self.sync}]")
        x, y = self._batch()
        errors: list[str] = []
        try:
            loss = _loss(self.model(self._mine(x)), self._mine(y))
            if loss.requires_grad:  # not with every parameter frozen
                (loss * scale).backward()
        except RuntimeError as e:
            if self._deterministic_refused(e):
                return
            raise self._unexpected() from None
        except Exception:
            raise self._unexpected() from None
        ref_loss = _loss(self.ref(x), y)
        if ref_loss.requires_grad:
            (ref_loss * scale).backward()
        if loss.requires_grad != ref_loss.requires_grad:
            self._check(["the loss needs a gradient on one side only"])
        if loss.requires_grad:
            self._after_backward()
        _close(mean_over_ranks(loss.detach()), ref_loss, "loss", errors)
        self._check(errors)

    @rule(mode=st.sampled_from(["grad", "no_grad", "eval"]))
    def forward(self, mode: str) -> None:
        if mode == "grad" and len(self.pending) >= MAX_PENDING:
            mode = "no_grad"
        self._note(f"forward({mode!r})")
        x, y = self._batch()
        errors: list[str] = []
        try:
            if mode == "grad":
                loss = _loss(self.model(self._mine(x)), self._mine(y))
            else:
                if mode == "eval":
                    self.model.eval()
                with torch.no_grad():
                    loss = _loss(self.model(self._mine(x)), self._mine(y))
                self.model.train()
        except Exception:
            raise self._unexpected() from None
        if mode == "grad":
            ref_loss = _loss(self.ref(x), y)
            self.pending.append((loss, ref_loss))
        else:
            with torch.no_grad():
                ref_loss = _loss(self.ref(x), y)
        _close(mean_over_ranks(loss.detach()), ref_loss, "loss", errors)
        self._check(errors)

    @precondition(lambda self: bool(self.pending))
    @rule(retain=st.booleans())
    def backward(self, retain: bool) -> None:
        self._note(f"backward(retain_graph={retain}) of {len(self.pending)} losses")
        ours = [t for t, _ in self.pending if t.requires_grad]  # not if all were frozen
        refs = [t for _, t in self.pending if t.requires_grad]
        self._check(
            ["pending losses need gradients on one side only"] if len(ours) != len(refs) else []
        )
        try:
            if ours:
                sum(ours).backward(retain_graph=retain)  # type: ignore[union-attr]
        except RuntimeError as e:
            if self._deterministic_refused(e):
                return
            raise self._unexpected() from None
        except Exception:
            raise self._unexpected() from None
        if refs:
            sum(refs).backward(retain_graph=retain)  # type: ignore[union-attr]
            self._after_backward()
        if not retain:
            self.pending = []

    @rule(alone=st.booleans())
    def penalty(self, alone: bool) -> None:
        """A gradient penalty on the inputs: ``(loss +) c * |d loss / d x|^2``. Each rank's
        input gradient is ``world`` times the replica's rows (its loss averages fewer rows)
        and its gradients are averaged over ranks: ``c / world`` on a rank is ``c``."""
        self._note(f"penalty(alone={alone})")
        x, y = self._batch()
        c = 0.5
        try:
            xs = self._mine(x).requires_grad_(True)
            loss = _loss(self.model(xs), self._mine(y))
            (gx,) = torch.autograd.grad(loss, xs, create_graph=True)
            pen = gx.pow(2).sum() * (c / self.world)
            (pen if alone else loss + pen).backward()
        except RuntimeError as e:
            if self._deterministic_refused(e):
                return
            raise self._unexpected() from None
        except Exception:
            raise self._unexpected() from None
        xr = x.clone().requires_grad_(True)
        ref_loss = _loss(self.ref(xr), y)
        (gr,) = torch.autograd.grad(ref_loss, xr, create_graph=True)
        ref_pen = gr.pow(2).sum() * c
        (ref_pen if alone else ref_loss + ref_pen).backward()
        self._after_backward()

    @rule(where=st.sampled_from(FREEZE_TARGETS), value=st.booleans())
    def freeze(self, where: str, value: bool) -> None:
        self._note(f"{where or 'model'}.requires_grad_({value})")
        self.pending = []  # a graph recorded before would differ from the replica's
        try:
            self._module(self.model, where).requires_grad_(value)
        except Exception:
            raise self._unexpected() from None
        self._module(self.ref, where).requires_grad_(value)

    @rule(
        kind=st.sampled_from(["sgd", "momentum", "wd"]),
        source=st.sampled_from(["model", "modules"]),
        pieces=st.booleans(),
    )
    def build_optimizer(self, kind: str, source: str, pieces: bool = False) -> None:
        self._note(f"build_optimizer({kind!r}, from={source!r}, pieces={pieces})")

        def params(m: nn.Module) -> list[nn.Parameter]:
            if source == "model":
                return list(m.parameters())
            out = list(m.inp.parameters())  # type: ignore[union-attr]
            for block in m.layers:  # type: ignore[union-attr]
                out.extend(block.parameters())
            return out + list(m.head.parameters())  # type: ignore[union-attr]

        kw = {"sgd": {}, "momentum": {"momentum": 0.9}, "wd": {"weight_decay": 0.1}}[kind]
        self.opt = torch.optim.SGD(params(self.model), lr=LR, **kw)
        self.ref_opt = torch.optim.SGD(params(self.ref), lr=LR, **kw)
        if pieces:  # replicated groups keep gradients and momentum in pieces over the ranks
            try:
                self.opt = shard_over_replicas(self.opt)
            except ValueError as e:
                kind_, text = EXPECTED["build_optimizer"]
                if not isinstance(e, kind_) or text not in str(e):
                    raise self._unexpected() from None
                self.stats["wrap refused"] = self.stats.get("wrap refused", 0) + 1
                self.opt = self.ref_opt = None
            except Exception:
                raise self._unexpected() from None

    def _opt_sharded(self) -> bool:
        assert self.opt is not None
        return all(sharded_of(p) is p for g in self.opt.param_groups for p in g["params"])

    @precondition(lambda self: self.opt is not None and not self.unsynced)
    @rule(scaler=st.booleans())
    def optimizer_step(self, scaler: bool = False) -> None:
        """The optimizer's own step, or a framework's ``GradScaler`` path (scale 1: the
        numbers stay; its inf checks and unscaling run on every gradient kind)."""
        assert self.opt is not None and self.ref_opt is not None
        # a GradScaler asserts that it saw a gradient: a framework steps after a backward
        scaler = scaler and any(
            p.grad is not None for g in self.opt.param_groups for p in g["params"]
        )
        self._note(f"optimizer.step(){' through a GradScaler' if scaler else ''}")
        self.pending = []  # the replica refuses a backward through parameters stepped since
        held = [p for g in self.opt.param_groups for p in g["params"]]
        plain = [p for p in held if sharded_of(p) is not p]  # registered temporaries
        try:
            if scaler:
                amp = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1 << 30)
                amp.scale(torch.ones(()))  # its scale, as the loss's scaling would make it
                amp.unscale_(self.opt)
                amp.step(self.opt)
                amp.update()
            else:
                self.opt.step()
        except RuntimeError as e:
            kind, text = EXPECTED["optimizer_step"]
            pieced = EXPECTED["optimizer_step_pieced"][1] in str(e)
            if not isinstance(e, kind) or (text not in str(e) and not pieced):
                raise self._unexpected() from None
            if pieced:  # a plain optimizer after a ReplicaShardedOptimizer: refused
                self.stats["pieced refused"] = self.stats.get("pieced refused", 0) + 1
                self.opt = self.ref_opt = None
                return
            # documented: the optimizer holds unsharded parameters; every rank raised
            self._check([] if plain else [f"the guard raised for sharded parameters: {e}"])
            self.stats["guard raised"] = self.stats.get("guard raised", 0) + 1
            self.opt = self.ref_opt = None
            return
        except Exception:
            raise self._unexpected() from None
        self._check([f"{len(plain)} plain tensors stepped without error"] if plain else [])
        self.ref_opt.step()

    @precondition(lambda self: not self.unsynced)
    @rule(set_to_none=st.booleans(), via=st.sampled_from(["model", "optimizer"]))
    def zero_grad(self, set_to_none: bool, via: str) -> None:
        if via == "optimizer" and (self.opt is None or not self._opt_sharded()):
            # an optimizer holding unsharded tensors zeroes their gradients, not the sharded
            # ones: undefined (its step raises); the model's zero_grad instead
            via = "model"
        self._note(f"{via}.zero_grad(set_to_none={set_to_none})")
        try:
            (self.model if via == "model" else self.opt).zero_grad(set_to_none)  # type: ignore[union-attr]
        except Exception:
            raise self._unexpected() from None
        (self.ref if via == "model" else self.ref_opt).zero_grad(set_to_none)  # type: ignore[union-attr]

    # at any point: fsdp2's clip_grad_norm_ clips the sharded gradients of the groups that
    # register their unsharded parameters meanwhile
    @precondition(lambda self: not self.unsynced)
    @rule(max_norm=st.sampled_from([0.05, 1.0, 100.0]), via=st.sampled_from(["fsdp2", "torch"]))
    def clip(self, max_norm: float, via: str = "fsdp2") -> None:
        """``fsdp2.clip_grad_norm_``, or torch's as the frameworks clip (the deterministic
        mode's clipping for them: ``reduction.clip_grad_norm_``). torch's clips what
        ``model.parameters()`` gives, which are a group's unsharded temporaries while it
        registers them (documented): then fsdp2's."""
        if via == "torch" and any(sharded_of(p) is not p for p in self.model.parameters()):
            via = "fsdp2"
        if via == "torch" and self.mode == "deterministic":
            via = "reduction"
        self._note(f"clip_grad_norm_({max_norm}) via {via}")
        clip = {
            "fsdp2": fsdp2.clip_grad_norm_,
            "torch": torch.nn.utils.clip_grad_norm_,
            "reduction": reduction.clip_grad_norm_,
        }[via]
        try:
            norm = clip(self.model.parameters(), max_norm)
        except Exception:
            raise self._unexpected() from None
        ref_norm = torch.nn.utils.clip_grad_norm_(self.ref.parameters(), max_norm)
        errors: list[str] = []
        got = norm.full_tensor() if isinstance(norm, DTensor) else norm
        _close(got, ref_norm, "gradient norm", errors)
        self._check(errors)

    @precondition(lambda self: not self.unsynced)
    @rule(via=st.sampled_from(["memory", "dcp"]))
    def state_dict_round_trip(self, via: str) -> None:
        self._note(f"load_state_dict(state_dict()) via {via}")
        self.pending = []
        try:
            sd = self.model.state_dict()
            if via == "dcp":
                path = [tempfile.mkdtemp(prefix="fsdp2-orders-") if self.rank == 0 else None]
                dist.broadcast_object_list(path)
                try:
                    dcp.save(sd, checkpoint_id=path[0])
                    sd = {k: torch.zeros_like(v) for k, v in sd.items()}  # other values
                    dcp.load(sd, checkpoint_id=path[0])
                finally:
                    dist.barrier()
                    if self.rank == 0:
                        shutil.rmtree(str(path[0]), ignore_errors=True)
            self.model.load_state_dict(sd)
        except Exception:
            raise self._unexpected() from None

    @rule(
        where=st.sampled_from(["", "layers.0", "layers.2"]),
        op=st.sampled_from(["unshard", "reshard"]),
    )
    def unshard_reshard(self, where: str, op: str) -> None:
        self._note(f"{where or 'model'}.{op}()")
        try:
            getattr(self._module(self.model, where), op)()
        except Exception:
            raise self._unexpected() from None

    @rule(value=st.booleans())
    def set_sync(self, value: bool) -> None:
        self._note(f"set_requires_gradient_sync({value})")
        self.model.set_requires_gradient_sync(value)  # type: ignore[operator]
        self.sync = value

    @rule(where=st.sampled_from(["", "layers.0", "layers.1"]), value=st.booleans())
    def set_reshard_after_forward(self, where: str, value: bool) -> None:
        self._note(f"{where or 'model'}.set_reshard_after_forward({value})")
        self._module(self.model, where).set_reshard_after_forward(value)  # type: ignore[operator]

    @precondition(lambda self: not self.unsynced)
    @rule(at=st.integers(0, 2))
    def failing_forward(self, at: int) -> None:
        self._note(f"forward raising before block {at}, then reset_iter_state()")
        self.pending = []  # reset_iter_state drops the step's bookkeeping
        x, _ = self._batch()
        self.model.fail_at = at  # type: ignore[assignment]
        try:
            try:
                self.model(self._mine(x))
            except PlannedFailure:
                pass
            else:
                raise AssertionError("the planned failure did not happen")
            finally:
                self.model.fail_at = None
            self.model.reset_iter_state()  # type: ignore[operator]
        except Exception:
            raise self._unexpected() from None

    # ---- after every rule ----------------------------------------------------------------

    @invariant()
    def matches_replica(self) -> None:
        if not hasattr(self, "model"):
            return
        errors: list[str] = []
        params = _sharded_named(self.model, errors)
        refs = dict(self.ref.named_parameters())
        if list(params) != list(refs):
            errors.append(f"parameter names {list(params)} != the replica's {list(refs)}")
        self._check(errors)
        # full_values: the values of full_tensor() in one all-gather per group and dtype
        fulls = full_values(list(params.values()))
        for name, full in zip(params, fulls, strict=True):
            _close(full, refs[name], f"parameter {name}", errors)
        if not self.unsynced:
            grads = [p.grad for p in params.values()]
            for (name, g), full in zip(
                zip(params, grads, strict=True), full_values(grads), strict=True
            ):
                want = refs[name].grad
                if (g is None) != (want is None):
                    has = "no gradient" if g is None else "a gradient"
                    errors.append(f"gradient of {name}: fsdp2 has {has}, the replica the other")
                elif g is not None and want is not None:
                    assert isinstance(g, DTensor)
                    _close(full, want, f"gradient of {name}", errors)
        self._check(errors)

    def teardown(self) -> None:
        self.pending = []
        if hasattr(self, "model"):
            del self.model


def _sharded_named(model: nn.Module, errors: list[str]) -> dict[str, DTensor]:
    """``model.named_parameters()`` as sharded DTensors: what a group registers while it is
    not sharded (its unsharded parameters, or its faces on the smaller mesh, as on torch's
    FSDP2) mapped to the sharded parameters; anything else that is not one is an error."""
    out: dict[str, DTensor] = {}
    for name, p in model.named_parameters():
        p = sharded_of(p)
        if not isinstance(p, DTensor):
            errors.append(f"model.named_parameters() gave a {type(p).__name__} for {name}")
        else:
            out[name] = p
    return out


def replay(rules: list[tuple[str, dict[str, Any]]]) -> dict[str, float]:
    """Rank function: run ``rules`` (``(rule name, arguments)``, the first ``build``) on a
    fresh machine, checking the invariant after each: a regression test of a sequence the
    suite found. Returns the machine's counts."""
    stats: dict[str, float] = {}

    class Machine(CallOrders):
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    Machine.stats = stats
    machine = Machine()
    try:
        for name, kwargs in rules:
            getattr(machine, name)(**kwargs)
            machine.matches_replica()
    finally:
        machine.teardown()
    return stats
