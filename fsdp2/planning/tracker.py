"""The dispatch mode that follows every storage of ``fsdp2.estimate_memory``'s simulated
step, sorting it into parts, and the peak (see [Note: simulated step]). It is also an
observer of the engine ([Note: observation] in fsdp2/_core/support/observe.py): the engine's
regions, resizes and taken gradients tell it what each storage is for.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fsdp2._core.support.observe import Observer

__all__ = ["PARTS", "Tracker", "sort_persistent"]

PARTS = (
    "parameters (sharded)",
    "parameters (unsharded)",
    "gradients (sharded)",
    "gradients (unsharded)",
    "optimizer state",
    "activations",
    "communication buffers",
    "other",
)

# [Note: simulated step]
# Every storage the step creates gets a part when it is allocated, from where the
# engine is: inside any of its labels (fsdp2/_core/support/labels.py: copy-in, all-gather, copy-out,
# reshard, reduce-scatter, all-reduce) it is a communication buffer; in a forward it is
# an activation; in a backward, outside the engine's labels, an activation's gradient
# (counted with the activations); in the optimizer step, optimizer state (its temporaries
# included); before the forward, "other" (the batch). The unsharded parameters are the
# storages fsdp2 resizes (fsdp2/_core/params/storage.py tells the tracker). Two parts are known only
# later, and move when they become known: a parameter's unsharded gradient (autograd
# allocates it in the backward; it moves to "gradients (unsharded)" when the group's
# post-backward hook takes it) and a reduce-scatter's output (moves to "gradients
# (sharded)" once it is the sharded ``.grad``, ``fsdp2.replica_optim``'s gradient pieces
# included). What exists when the measured step starts is sorted by
# identity: the sharded parameters, gradients, the optimizer's state; buffers are "other".
#
# The simulated rank is rank 0, whose shards are the largest (dim-0 shards are
# ``ceil(rows / world)`` rows, the last ranks get fewer or none).


# Whether a storage is dead, by its StorageWeakRef's cdata (``StorageWeakRef.expired``
# without the method call: sweeps ask it of every entry).
_expired = torch.UntypedStorage._expired


class _Entry:
    __slots__ = ("nbytes", "part", "ref")

    def __init__(self, ref: StorageWeakRef, nbytes: int, part: str) -> None:
        self.ref = ref
        self.nbytes = nbytes
        self.part = part


class Tracker(TorchDispatchMode, Observer):
    """Live storages on the compute device (and the host), their parts, and the peak."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device_type = device.type
        self.entries: dict[int, _Entry] = {}  # by storage identity (its weak cdata)
        self.host: dict[int, _Entry] = {}
        self.upper = 0  # live bytes, counting the dead not yet swept: never below live
        self.host_upper = 0  # the same on the host
        self.phase = "setup"
        self.where = "setup"
        self.labels: list[str] = []
        self.hooks: list[str] = []
        self.unsharded: dict[int, str] = {}  # id(unsharded storage) -> group path, while alive
        self.params: list[nn.Parameter] = []
        # where -> the parts at the most live bytes seen there (``moments=True``), else None
        self.moments: dict[str, dict[str, int]] | None = None
        self.moment_unsharded: dict[str, tuple[str, ...]] = {}  # where -> groups gathered then
        self.reset_peak()

    # -- bookkeeping
    def reset_peak(self) -> None:
        self.sweep()
        self.peak = -1
        self.host_peak = 0
        if self.moments is not None:
            self.moments = {}
            self.moment_unsharded = {}
        self.check_peak()

    def sweep(self) -> None:
        for table in (self.entries, self.host):
            dead = [k for k in table if _expired(k)]  # (a key is its entry's ref.cdata)
            for k in dead:
                self._add(table, -table[k].nbytes)
                del table[k]

    def _add(self, table: dict[int, _Entry], nbytes: int) -> None:
        if table is self.entries:
            self.upper += nbytes
        else:
            self.host_upper += nbytes

    def check_peak(self) -> None:
        if self.moments is not None:
            self._check_moment()
        if self.upper <= self.peak and self.host_upper <= self.host_peak:
            return
        self.sweep()
        self.host_peak = max(self.host_peak, self.host_upper)
        if self.upper <= self.peak:
            return
        self.peak = self.upper
        parts = dict.fromkeys(PARTS, 0)
        for e in self.entries.values():
            parts[e.part] += e.nbytes
        self.peak_parts = parts
        self.peak_where = self.where
        self.peak_unsharded = tuple(dict.fromkeys(self.unsharded.values()))

    def _check_moment(self) -> None:
        """The most live bytes at the current moment (``where``), with its parts."""
        seen = self.moments.get(self.where) if self.moments is not None else None
        if seen is not None and self.upper <= sum(seen.values()):
            return
        self.sweep()
        parts = dict.fromkeys(PARTS, 0)
        for e in self.entries.values():
            parts[e.part] += e.nbytes
        if seen is None or sum(parts.values()) > sum(seen.values()):
            assert self.moments is not None
            self.moments[self.where] = parts
            self.moment_unsharded[self.where] = tuple(dict.fromkeys(self.unsharded.values()))

    def part_now(self) -> str:
        if self.labels:
            return "communication buffers"
        if self.phase == "optimizer":
            return "optimizer state"
        if self.hooks and self.hooks[-1] in ("post_backward", "final_callback"):
            return "gradients (sharded)"
        if self.phase in ("forward", "backward"):
            return "activations"
        return "other"

    def track(self, t: torch.Tensor, part: str | None = None, *, move: bool = False) -> None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        if type(t) is not torch.Tensor and not isinstance(t, torch._subclasses.FakeTensor):
            if hasattr(t, "__tensor_flatten__"):  # e.g. a float8 weight: its inner tensors
                for name in t.__tensor_flatten__()[0]:
                    self.track(getattr(t, name), part, move=move)
            return
        storage = t.untyped_storage()
        key = storage._cdata  # its StorageWeakRef's cdata; the ref is made only for a new entry
        table = self.entries if t.device.type == self.device_type else self.host
        e = table.get(key)
        if e is not None and _expired(key):  # a dead storage's address, reused
            self._add(table, -e.nbytes)
            del table[key]
            e = None
        if e is None:
            nbytes = storage.nbytes()
            table[key] = _Entry(StorageWeakRef(storage), nbytes, part or self.part_now())
            self._add(table, nbytes)
        elif move and part is not None:
            e.part = part

    # -- what the engine tells its observers ([Note: observation] in fsdp2/_core/support/observe.py)
    def resized(self, t: torch.Tensor, owner: str) -> None:
        """fsdp2 resized an unsharded parameter storage of group ``owner``."""
        table = self.entries if t.device.type == self.device_type else self.host
        key = StorageWeakRef(t.untyped_storage()).cdata
        e = table.get(key)
        nbytes = t.untyped_storage().nbytes()
        if e is None:
            self.track(t, "parameters (unsharded)")
        else:
            self._add(table, nbytes - e.nbytes)
            e.nbytes = nbytes
            e.part = "parameters (unsharded)"
        if nbytes:
            self.unsharded[id(t)] = owner
        else:
            self.unsharded.pop(id(t), None)
        self.check_peak()

    def enter(self, kind: str, what: str) -> None:
        if not kind.startswith("hook"):
            self.labels.append(kind)  # copy-in, all-gather, copy-out, reshard, reduce, ...
            return
        hook = kind.removeprefix("hook ") if kind != "hook" else what  # "hook", "final_callback"
        if hook == "pre_forward":
            self.phase = "forward" if self.phase != "backward" else "backward"
            self.where = f"{'recompute' if self.phase == 'backward' else 'forward'} of {what}"
        elif hook == "pre_backward":
            self.phase = "backward"
            self.where = f"backward of {what}"
        elif hook == "post_backward":
            self.where = f"post-backward of {what}"
        elif hook == "final_callback":
            self.where = "end of the backward"
        self.hooks.append(hook)

    def exit(self, kind: str) -> None:
        if not kind.startswith("hook"):
            self.labels.pop()
            return
        hook = self.hooks.pop()
        if hook in ("post_backward", "final_callback"):
            self.sharded_grads_landed()

    def gradients_taken(self, grads: list[torch.Tensor]) -> None:
        """A group's unsharded gradients (autograd made them in the backward) are taken."""
        for g in grads:
            self.track(g, "gradients (unsharded)", move=True)

    def sharded_grads_landed(self) -> None:
        for p in self.params:
            if p.grad is not None:
                self.track(p.grad, "gradients (sharded)", move=True)

    # -- every operator
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):  # most operators: one tensor, no pytree walk
            self.track(out)
        elif out is not None and type(out) is not torch.device:  # (prim.device: half of all)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.track(t)
        self.check_peak()
        return out


def sort_persistent(tracker: Tracker, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Sort what exists when the measured step starts, by identity."""
    tracker.sweep()
    for e in (*tracker.entries.values(), *tracker.host.values()):
        if e.part != "parameters (unsharded)":
            e.part = "other"
    for p in model.parameters():
        tracker.track(p, "parameters (sharded)", move=True)
        if p.grad is not None:
            tracker.track(p.grad, "gradients (sharded)", move=True)
    for b in model.buffers():
        tracker.track(b, "other", move=True)
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                tracker.track(v, "optimizer state", move=True)
