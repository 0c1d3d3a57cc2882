"""What one root shares with every ``fully_shard`` state under it (``StepContext``): the
step's phase (``StepPhase``) and order, each state's place in it (a ``Slot``: its group,
``TrainingState``, prefetch links, gradient state), the all-gathers it starts (alone or
bucketed), the reductions in flight and the final callback. The state layer above
(state.py) owns one ``Slot`` per ``fully_shard`` call and calls down; nothing here calls
up: the slot is the whole contract between the two layers.

# [Note: one step]
# pre-forward:   unshard this group (issue all-gather), prefetch the group that
#                ran next last step (issue only), then wait for ours; register
#                a post-backward node on the inputs that require grad.
# post-forward:  reshard per reshard_after_forward; hook the outputs so the
#                group unshards again when their gradient arrives.
# pre-backward:  unshard (if resharded), prefetch the group that comes next in
#                reverse post-forward order, wait.
# post-backward: fires when every post-backward node registered this step has
#                run, i.e. all of the group's backward is done: the group hands
#                over its gradients (a ``Part``) and reshards; here they are
#                reduce-scattered, alone or bucketed, and the reduction queued
#                (older ones are pushed a stage on, so about one is in flight).
# final callback (queued on the autograd engine by the first pre-backward):
#                reduce what no post-backward reduced (unused inputs, params
#                whose grads came late), finish every reduction, reshard, reset.

# [Note: manual finalization]
# ``set_manual_backward_finalization(True)`` (torch main's API, pytorch PR 197620) moves the
# final callback's finishing work out of autograd: the final callback of each backward only
# ends the backward (training states, phase), and ``finalize_backward()`` does the rest when
# the caller says so (``StepContext.finalize``): reduce what no post-backward reduced (the
# no-sync sums, late gradients) per the *current* sync settings, finish every reduction in
# flight, reshard per ``reshard_after_backward``, reset. Without it the final callback calls
# ``finalize`` itself. It serves gradient accumulation over several backwards that end
# where autograd cannot tell (several pipeline schedule steps: pytorch issue 196641), and
# pipeline schedules, which finish a stage's backward by hand (fsdp2/pipelining.py).
# ``finalize_backward()`` without the mode finishes whatever a backward left (nothing, after
# an ordinary backward), so a schedule may call it after every step.

# [Note: buckets]
# With ``set_bucket_bytes(n)`` (off by default), a group about to be all-gathered takes
# the groups expected to run right after it along (the order ``fwd_next`` / ``bwd_next``
# recorded last time, skipping groups already unsharded or coming) into ONE all-gather of
# their concatenated shards, while the unsharded bytes stay <= n and their settings
# agree (``ParamGroup.gather_key``); each group copies its columns out when it runs.
# Prefetching a group starts the next bucket. Gradients of groups whose backward
# finished are held (``StepContext.parts``) and reduced in ONE reduce-scatter when the
# next would pass n input bytes, or backward ends; groups of other settings
# (``bucket_key``) collect in buckets of their own. Memory: up to two gathered buckets
# (the one in use and the prefetched one) and one bucket of held gradients per key, each
# <= n bytes (a group larger than n alone).

# [Note: several groups]
# A ``fully_shard`` call whose ``shard_placement_fn`` names other meshes holds one group
# per process group ([Note: per-parameter meshes] in sharding.py), all in its one
# ``Slot``: the slot moves through the step as one unit (one training state, one
# post-backward count, one place in the prefetch order), and each step of it runs for
# every group in turn: its all-gathers are issued together, then waited; its
# post-backward hands each group's gradients to its own reduce-scatter (and HSDP
# all-reduce), in the groups' order (the order ``fully_shard`` found their first
# parameters, the same on every rank). A bucket only takes groups of one process group:
# walking the order, the next slot's group on the same process group joins, and a slot
# without one ends the bucket. Held gradients wait in one bucket per key.

# [Note: root prefetch]
# The root's backward comes first and, in a language model, holds the loss and the
# output layer: logits-sized tensors, the step's memory peak. Prefetching the next
# group's all-gather at the root's pre-backward would add that group's unsharded
# parameters to the peak. So the root's implicit backward prefetch waits for the first
# of the root's trainable parameters to get its gradient (a tensor hook on each, removed
# when one fires): for a Llama that is the output layer's weight, right after its
# backward. Any other group's pre-backward first (a root whose parameters get gradients
# last, e.g. an embedding alone) cancels it and gathers as usual; a root with no
# trainable parameter, or an explicit ``set_modules_to_backward_prefetch`` list, prefetches
# at once. On the benchmark Llama (docs/benchmarks.md) this takes one block's gathered
# parameters (12.25 MiB, and gloo's buffer of the same size for the all-gather in
# flight) off the peak; torch's FSDP2 prefetches at the root's pre-backward.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd import Variable

from fsdp2._core.comm.collectives import all_gather
from fsdp2._core.params.group import ParamGroup, Sharded
from fsdp2._core.runtime import relayout
from fsdp2._core.runtime.higher_order import GraphHold, check_no_graph_grads
from fsdp2._core.runtime.reduce import (
    Part,
    Reduction,
    accumulate_in_reduce_dtype,
    bucket_key,
    has_unreduced_grads,
    push_exact,
    reduce,
    take_grads,
)
from fsdp2._core.runtime.slot import LEGAL_MOVES, Slot, TrainingState
from fsdp2._core.support.labels import label
from fsdp2._core.support.observe import HUB

if TYPE_CHECKING:
    from fsdp2._core.params.param import FSDPParam

__all__ = ["LEGAL_MOVES", "Slot", "StepContext", "StepPhase", "TrainingState"]


class StepPhase(enum.Enum):
    """Where a root's step is."""

    IDLE = "idle"  # between steps, or after a forward whose backward has not begun
    FORWARD = "forward"  # inside the root's forward
    BACKWARD = "backward"  # from the first pre-backward hook to the final callback


class StepContext:
    """What all slots under one root share."""

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots
        self.with_group = [s for s in slots if s.groups]
        self.groups = [g for s in self.with_group for g in s.groups]
        self.phase = StepPhase.IDLE
        self.fwd_order: list[Slot] = []
        self.post_fwd_order: list[Slot] = []
        self.reductions: deque[Reduction] = deque()
        self.pending_d2h = False
        # gradients waiting for a bucketed reduce-scatter, per bucket key (groups of one
        # key share a process group and settings): the parts and their packed bytes so far
        self.parts: dict[tuple[Any, ...], tuple[list[Part], int]] = {}
        self.deferred: list[Any] = []  # hook handles of the root's deferred prefetch
        # the backward running has grad mode on (create_graph=True); groups held for the
        # backward of the graph it builds: see [Note: double backward] in higher_order.py
        self.create_graph = False
        self.hold = GraphHold()
        # set_manual_backward_finalization: the final callback leaves the reductions, the
        # unreduced groups and the resharding to finalize_backward(); see [Note: manual
        # finalization]
        self.manual = False
        self.unfinalized = False  # a backward ended without finalizing (manual mode)
        # finalize_backward(async_op=True) issued the reductions; its handle's wait() ends the
        # step. Until then: no forward, reset, unshard or second finalize (awaiting_refusal)
        self.awaiting = False

    # ---- all-gathers -----------------------------------------------------------

    def unshard(self, st: Slot, backward: bool) -> None:
        """Issue the all-gathers ``st``'s groups need (in backward, those gathered for
        backward): each alone, or with a bucket of the groups of the same process group
        expected to run after it (see [Note: buckets])."""
        for g in st.groups:
            if not g.needs_gather() or (backward and not g.gather.unshard_in_backward):
                continue
            key = g.gather_key()
            budget = g.gather.bucket_bytes
            if key is None or budget is None:
                g.unshard()
            else:
                self._unshard_bucket(st, g, key, budget, backward)

    def _unshard_bucket(
        self, st: Slot, g: ParamGroup, key: tuple[Any, ...], budget: int, backward: bool
    ) -> None:
        bucket, total = [g], g.gather_bytes()
        seen, cur = {id(st)}, st
        while True:
            nxt = cur.bwd_next if backward else cur.fwd_next
            if not nxt or id(nxt[0]) in seen:
                break
            cur = nxt[0]
            seen.add(id(cur))
            if not cur.groups or (backward and not gathers_in_backward(cur)):
                break
            # the next slot's group over the same process group (one per slot at most,
            # unless HSDP and FSDP groups share a shard group)
            same = [h for h in cur.groups if h.info.shard_group is g.info.shard_group]
            if not same:
                break
            todo = [h for h in same if h.needs_gather()]
            if not todo:
                continue  # already unsharded or coming
            h = todo[0]
            if h.gather_key() != key or total + h.gather_bytes() > budget:
                break
            bucket.append(h)
            total += h.gather_bytes()
        if len(bucket) == 1:
            g.unshard()
            return
        paths = lambda: "bucket " + ", ".join(h.path for h in bucket)  # noqa: E731
        inputs = lambda: [h.gather_input() for h in bucket]  # noqa: E731
        pendings = all_gather(inputs, key[0], g.world, paths)
        for h, pending in zip(bucket, pendings, strict=True):
            h.gather_issued(pending)

    def prefetch_for_backward(self, states: list[Slot]) -> None:
        for nxt in states:
            if gathers_in_backward(nxt):
                self.unshard(nxt, backward=True)

    def defer_prefetch(self, states: list[Slot], params: list[FSDPParam]) -> None:
        """The root's implicit backward prefetch, issued when the first of the root's
        parameters gets its gradient instead of at once; see [Note: root prefetch]."""
        ts = [p.unsharded for p in params if p.unsharded is not None]
        ts = [t for t in ts if t.requires_grad]
        if not states or not ts:
            self.prefetch_for_backward(states)
            return

        def fire(_grad: torch.Tensor) -> None:
            if self.deferred:
                self.cancel_deferred_prefetch()
                self.prefetch_for_backward(states)

        self.cancel_deferred_prefetch()
        self.deferred = [t.register_hook(fire) for t in ts]

    def cancel_deferred_prefetch(self) -> None:
        for handle in self.deferred:
            handle.remove()
        self.deferred = []

    # ---- reductions ------------------------------------------------------------

    def add_reduction(self, reduction: Reduction) -> None:
        """Queue a reduction and push every older one but the newest
        ``max_inflight`` a stage on (wait its reduce-scatter, start its HSDP
        all-reduce, or land its gradients): gradients land as early as they
        can while few groups' gradient buffers are alive."""
        q = self.reductions
        q.append(reduction)
        for old in list(q)[: -reduction.group.reduce.max_inflight]:
            if self._advance(old):
                q.remove(old)

    def _advance(self, reduction: Reduction) -> bool:
        done = reduction.advance()
        if done and reduction.host_copy:
            self.pending_d2h = True  # synchronized by the final callback
        return done

    def add_part(self, part: Part) -> None:
        """Reduce a group's gradients: at once, or in a bucket with the next groups' of
        the same key (flushed when full and at the end of backward)."""
        key = bucket_key(part.group)
        if key is None:
            self.add_reduction(reduce([part]))
            return
        parts, nbytes = self.parts.pop(key, ([], 0))
        budget = part.group.reduce.bucket_bytes or 0
        if parts and nbytes + part.nbytes > budget:
            self.add_reduction(reduce(parts))
            parts, nbytes = [], 0
        parts.append(part)
        nbytes += part.nbytes
        if nbytes >= budget:
            self.add_reduction(reduce(parts))
        else:
            self.parts[key] = (parts, nbytes)

    def flush_parts(self) -> None:
        """Issue the reduce-scatters of the buckets of gradients collected so far (in the
        order their buckets began: the same on every rank)."""
        buckets, self.parts = self.parts, {}
        for parts, _ in buckets.values():
            self.add_reduction(reduce(parts))

    def drain_reductions(self) -> None:
        q = self.reductions
        while q:
            if self._advance(q[0]):
                q.popleft()

    # ---- step boundaries -------------------------------------------------------

    def begin_forward(self) -> None:
        """The root's forward starts. From FORWARD too: a forward that raised (or a
        root forward nested in a registered method) just starts over."""
        self.awaiting_refusal("the root's forward")
        self.phase = StepPhase.FORWARD
        if self.hold.active:  # the gradient's graph was dropped unused
            self.hold.end()
        if HUB.observers:
            HUB.step_phase("forward", new_step=True)
        self.fwd_order = []
        self.post_fwd_order = []
        for g in self.groups:
            relayout.before_forward(g)  # requires_grad_, unshard(), stale values; may raise
            if g.sharded_state is Sharded.SMALL:  # its backward never came: may be stale
                g.reshard()
            if g.sharded_state is Sharded.SHARDED and relayout.hooks_patched(g):
                relayout.adopt_patched_hooks(g)  # all-gather hooks given to local tensors since

    def end_forward(self) -> None:
        """The root's forward ends: link each state to the one that ran after it (next
        step's implicit forward prefetch) and cancel all-gathers prefetched for groups
        that did not run."""
        self.phase = StepPhase.IDLE
        order = self.fwd_order
        seen: set[int] = set()
        for i, st in enumerate(order):
            if id(st) in seen:
                continue
            seen.add(id(st))
            st.fwd_next = [order[i + 1]] if i + 1 < len(order) else []
        for g in self.groups:
            if g.has_pending_unshard():
                g.reshard()

    def begin_backward(self) -> None:
        if self.phase is StepPhase.FORWARD:
            raise RuntimeError(
                "fsdp2: a backward reached sharded modules while the root's forward was "
                "still running (e.g. torch.autograd.grad inside forward); fsdp2 reduces "
                "gradients once per backward of a finished forward and cannot do that"
            )
        self.phase = StepPhase.BACKWARD
        if HUB.observers:
            HUB.step_phase("backward")
        order = self.post_fwd_order
        for i, st in enumerate(order):  # later occurrences win: backward runs them first
            st.bwd_next = [order[i - 1]] if i > 0 else []
        self.create_graph = torch.is_grad_enabled()
        if not (self.create_graph or self.hold.active):
            for g in self.groups:
                g.release_unread()
        Variable._execution_engine.queue_callback(self.finish_backward)

    def check_recompute(self, name: str) -> None:
        """A forward during the BACKWARD phase must be an activation-checkpoint
        recompute, inside the backward; otherwise the last backward never finished."""
        if torch._C._current_graph_task_id() == -1:
            raise RuntimeError(
                f"fsdp2: forward of {name} started while the previous backward never "
                "finished (it raised, so its gradients were not reduced). Call "
                "reset_iter_state() on the root module after catching the exception, "
                "then run the step again"
            )

    def reset(self) -> None:
        """Recover from an exception mid-step (``reset_iter_state``)."""
        self.awaiting_refusal("reset_iter_state()")
        self.cancel_deferred_prefetch()
        for r in self.reductions:
            r.pending.wait()
        self.reductions.clear()
        self.parts = {}
        for st in self.with_group:
            for g, grads in zip(st.groups, st.grads, strict=True):
                g.reshard()
                g.drop_unsharded_grads()  # unreduced gradients: unsharded, no-sync sums,
                grads.clear()  # HSDP partial sums
                g.drained()
            st.end_step()
        self.phase = StepPhase.IDLE
        self.create_graph = False
        self.hold.end()
        self.fwd_order = []
        self.post_fwd_order = []

    def finish_backward(self) -> None:
        """The root's final callback: see [Note: one step]."""
        with label("hook", "final_callback"):
            self._finish_backward()

    def _finish_backward(self) -> None:
        if HUB.observers:
            HUB.step_phase("final callback of the backward")
        self.cancel_deferred_prefetch()
        if self.create_graph:  # reduce and reshard nothing: see [Note: double backward]
            check_no_graph_grads(self.groups)
            for st in self.with_group:
                st.end_step()
            self.phase = StepPhase.IDLE
            self.hold.begin(self.groups, self._held_grad)
            return
        if self.manual:  # see [Note: manual finalization]
            for st in self.with_group:
                st.end_step()
            self.phase = StepPhase.IDLE
            self.hold.end()
            self.unfinalized = True
            if HUB.observers:
                HUB.step_phase("time between steps")
            return
        self.finalize(ended=True)

    def finalize(self, ended: bool = False, async_op: bool = False) -> Callable[[], None] | None:
        """Finish the backwards of the step (the final callback, or ``finalize_backward()``):
        reduce, per the current gradient-sync settings, what no post-backward reduced (unused
        inputs, parameters whose gradients came late, no-sync sums), finish every reduction,
        reshard per ``reshard_after_backward``, reset. Issues collectives: every rank calls it
        at the same point. ``ended``: a backward just ended (the final callback). ``async_op``:
        issue the reductions, return what does the rest (``GradientReductionHandle.wait``)."""
        ended = ended or self.unfinalized
        for st in self.with_group:
            late: list[int] = []
            for i, g in enumerate(st.groups):
                if has_unreduced_grads(g, st.grads[i]):  # reduce, or (no sync) accumulate
                    late.append(i)
            if late:
                ended = True
                with label("hook post_backward", st.groups[late[0]].path):
                    only = None if len(late) == len(st.groups) else late
                    self.post_backward(st, only, final=True)
        self.flush_parts()
        if async_op:
            self.awaiting = True
            return lambda: self._complete(ended)
        self._complete(ended)
        return None

    def _complete(self, ended: bool) -> None:
        """``finalize``'s second half: wait for the reductions in flight, land the
        gradients, reshard, end the step."""
        self.awaiting = False
        self.drain_reductions()
        if self.pending_d2h:  # offloaded grads copied asynchronously into pinned memory
            torch.accelerator.synchronize()
            self.pending_d2h = False
        for g in self.groups:
            if g.reduce.sync:
                g.drained()  # frozen parameters' last gradients were reduced, if any
            if g.gather.reshard_after_backward:
                g.reshard()
        for st in self.with_group:
            st.end_step()
        self.phase = StepPhase.IDLE
        self.hold.end()
        self.unfinalized = False
        if HUB.observers:
            HUB.step_phase("time between steps")
        if not ended:
            return
        for st in self.slots:
            for callback in st.on_backward_end:
                callback()

    def awaiting_refusal(self, call: str) -> None:
        """Raise if ``finalize_backward(async_op=True)``'s handle has not been waited: the
        gradients are still being reduced into the sharded parameters."""
        if self.awaiting:
            raise RuntimeError(
                f"fsdp2: {call} called while gradient reductions started by "
                "finalize_backward(async_op=True) are outstanding; call wait() on the "
                "GradientReductionHandle it returned first"
            )

    def _held_grad(self) -> None:
        """A gradient landed on a held group's parameter: a backward of the graph a
        create_graph backward built has begun (maybe reaching no other fsdp2 hook)."""
        if self.phase is not StepPhase.BACKWARD:
            self.begin_backward()

    def post_backward(self, st: Slot, only: list[int] | None = None, final: bool = False) -> None:
        """``st``'s backward is done: hand its groups' gradients (those of the groups
        ``only`` indexes, if given) to reduction (alone or in a bucket) or, without
        gradient sync, add them to their no-sync sums; then reshard. While a graph built
        by a create_graph backward may still add gradients, only the final callback does
        (``final``): see [Note: double backward]."""
        st.to(TrainingState.POST_BACKWARD, "post-backward")
        if not final and (self.create_graph or self.hold.active):
            return
        pairs = (
            zip(st.groups, st.grads, strict=True)
            if only is None
            else [(st.groups[i], st.grads[i]) for i in only]
        )
        if HUB.observers:
            pairs = list(pairs)
            u = [p.unsharded for g, _ in pairs for p in g.grad_params]
            HUB.gradients_taken([t.grad for t in u if t is not None and t.grad is not None])
        for g, grads in pairs:
            part = None
            if g.reduce.sync:
                part = take_grads(g, grads)
                g.drained()
            elif g.reduce.exact:
                push_exact(g, grads)
            elif g.reduce_dtype is not None:
                accumulate_in_reduce_dtype(g, grads)
            g.after_backward()
            if part is not None:
                self.add_part(part)


def gathers_in_backward(st: Slot) -> bool:
    """Whether one of ``st``'s groups is still to be gathered for this backward. A group
    with no trainable params whose inputs needed no grad has no backward at all."""
    if st.training_state is TrainingState.POST_BACKWARD:
        return False
    for g in st.groups:
        if g.gather.unshard_in_backward and (g.grad_params or st.post_backward_pending):
            return True
    return False
