"""One parameter group: the params of one ``fully_shard`` call, gathered and
reduced together. Owns unshard / wait / reshard and gradient reduction.

# [Note: scalars]
# torch's FSDP2 rejects 0-dim parameters; we replicate them instead. In the flat
# layout a scalar takes one element per rank (its own copy), the all-gather
# brings every rank's copy and the unsharded parameter views the first; for
# reduction its gradient is written into every rank's slot, so the
# reduce-scatter sums it over ranks like an all-reduce. Its DTensor placement
# is ``Replicate()`` and each rank holds the same averaged gradient.

# [Note: release]
# The root's group stays unsharded from forward through backward (so does any group with
# reshard_after_forward=False), but its backward may not read every parameter: an
# embedding's backward needs the indices only. So when backward begins (the graph is
# complete), each group still unsharded frees the unsharded buffer (each flat parameter has
# its own) of every trainable parameter that nothing holds but its Python object and its
# gradient accumulator: no autograd node saved it, no view or alias of its storage is
# alive (``Tensor._use_count`` and the storage's use count against what the group itself
# holds, measured when the buffers were built). AccumulateGrad only writes ``.grad``, so
# the gradient still arrives. Meanwhile the module holds the sharded parameter, as after
# any reshard. A forward of a module owning a released parameter (an activation-checkpoint
# recompute) gathers it again first: a forward pre-hook on each owner, registered when the
# parameter is released and removed when it is back or the group reshards, so no hook is
# there while forward runs (``torch.compile`` traces the model as without it). A read that
# bypasses the owning module's call (a functional use of ``module.weight`` inside a
# recomputed function) sees the sharded DTensor and raises ("mixed torch.Tensor and
# DTensor"), never freed memory. ``set_reshard_after_backward(False)`` keeps everything
# (the group does not reshard after backward, so nothing is released). On the benchmark
# Llama it frees the 16 MiB token embedding before the logits' backward
# (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp2._core import collectives as C
from fsdp2._core import debug as D
from fsdp2._core import extension as X
from fsdp2._core import reduce as R
from fsdp2._core import relayout as L
from fsdp2._core.labels import label
from fsdp2._core.mesh import MeshInfo, shard_mesh
from fsdp2._core.param import FSDPParam
from fsdp2._core.relayout import group_dtype
from fsdp2._core.settings import GatherSettings, ReduceSettings
from fsdp2._core.small_shard import SmallShard
from fsdp2._core.storage import alloc_storage as _alloc
from fsdp2._core.storage import free_storage as _free
from fsdp2.api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy


class Sharded(enum.Enum):
    SHARDED = enum.auto()  # sharded DTensors registered; unsharded storage freed
    UNSHARDED = enum.auto()  # unsharded params registered and valid
    SMALL = enum.auto()  # like SHARDED, plus a copy sharded over a smaller group
    # (reshard_after_forward=int) that the backward all-gather reads


class ParamGroup:
    """The params of one ``fully_shard`` call and their collectives.

    All per-parameter work on the hot path is either one flat op or a loop
    over precomputed tuples (see [Note: flat storage] in param.py).
    """

    def __init__(
        self,
        params: list[FSDPParam],
        info: MeshInfo,
        *,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
        reshard_after_forward: bool | int,
        name: str,
    ) -> None:
        self.params = params
        self.info = info
        self.name = name
        self.path = name  # its module's path under the root, set at lazy init (for messages)
        self.mp_policy = mp_policy
        self.offload_policy = offload_policy
        self.device = info.device
        self.world = info.shard_size
        self.gather = GatherSettings(post_forward=reshard_after_forward)
        self.reduce = ReduceSettings()
        self.set_dtypes(group_dtype(params, name))
        self.sharded_state = Sharded.SHARDED
        self._pending_ag: C.Pending | C.Received | None = None
        self._pending_ag_small = False
        self.small: SmallShard | None = None  # reshard_after_forward=int, see update()
        # Gradient state that outlives a step.
        self.partial_reduce: torch.Tensor | None = None  # HSDP without all-reduce
        self.acc_grads: dict[int, torch.Tensor] = {}  # no-sync sums in reduce_dtype
        self.resync_pending = False  # adopt_registered waits for a whole group
        self._restore_hooks: list[Any] = []  # see release_unread
        self._init_storage()
        self.update()

    # ---- settings --------------------------------------------------------------

    def update(
        self, gather: dict[str, Any] | None = None, reduce: dict[str, Any] | None = None
    ) -> None:
        """Replace settings (field name -> value) and recompute what derives from them;
        the one path ``FSDPModule``'s setters take."""
        if gather:
            self.gather = dataclasses.replace(self.gather, **gather)
        if reduce:
            self.reduce = dataclasses.replace(self.reduce, **reduce)
        k = self.gather.post_forward
        if isinstance(k, bool):
            self.small = None
        elif self.small is None or self.small.size != k:
            self.small = SmallShard(self, k)
        self.divide_plan = self._plan()

    def _plan(self) -> C.DividePlan:
        replicate = self.info.replicate_size if self.info.replicate_group is not None else 1
        dtype = self.reduce_dtype or self.param_dtype
        r = self.reduce
        return C.divide_plan(self.world, replicate, dtype, r.divide_factor, r.force_sum)

    def set_dtypes(self, orig_dtype: torch.dtype) -> None:
        """The parameters' dtype changed (``module.to(dtype)``): derive the rest again."""
        self.orig_dtype = orig_dtype
        self.param_dtype = self.mp_policy.param_dtype or orig_dtype
        reduce_dtype = self.mp_policy.reduce_dtype
        self.reduce_dtype = None if reduce_dtype == self.param_dtype else reduce_dtype
        self.divide_plan = self._plan()

    # ---- init -----------------------------------------------------------------

    def _init_storage(self) -> None:
        # Plain parameters share the flat buffer; extension parameters keep their own
        # storage (see [Note: all-gather extensions] in extension.py), and so do plain
        # frozen parameters of another dtype (see [Note: other dtypes]).
        for p in self.params:
            if p.ext is None and p.sharded.dtype != self.orig_dtype:
                if p.is_scalar or p.shard_dim != 0:
                    raise NotImplementedError(
                        f"parameter {p.fqn} ({p.sharded.dtype}) is frozen with a dtype other "
                        f"than its group's ({self.orig_dtype}); fsdp2 gathers such parameters "
                        "only when sharded on dim 0 (not 0-dim ones): shard it in its own "
                        "fully_shard call or cast it"
                    )
                p.ext = X.Extension(p.fqn, None)
        self.split_params()
        self._shard_mesh: DeviceMesh | None = None
        self._assign_offsets()
        originals = [p.sharded for p in self.params]
        on_meta = originals[0].is_meta
        flat = self._new_sharded_flat(
            self.orig_dtype, torch.device("meta") if on_meta else self.device
        )
        with torch.no_grad():
            for p, t in zip(self.params, originals, strict=True):
                if p.ext is None and not flat.is_meta and p.local_numel:
                    p.local_view(flat).copy_(p.local_chunk(t.detach()))
        self.sharded_flat = flat
        pin = self._pin() and self.device.type != "cpu"
        with torch.no_grad():
            for p, t in zip(self.params, originals, strict=True):
                if p.ext is None:
                    p.make_sharded(flat, self.info)
                else:
                    p.make_sharded_ext(t, self.info, flat.device, pin)
        for p, t in zip(self.params, originals, strict=True):
            plain = p.tp is None and p.ext is None
            p.unsharded = nn.Parameter(t.detach(), p.requires_grad) if plain else None
        self._init_unsharded(flat.device if flat.is_meta else self.device)
        self.refresh_registrations()
        self.register_sharded()

    def _assign_offsets(self) -> None:
        """Place the flat parameters back to back in the flat sharded buffer."""
        offset = 0
        for p in self.flat_params:
            p.offset = offset
            offset += p.padded_numel
        self.shard_numel = offset

    def split_params(self) -> None:
        """Sort the parameters: plain ones share the flat buffer, extension ones keep
        their own storage."""
        self.flat_params = [p for p in self.params if p.ext is None]
        self.ext_params = [p for p in self.params if p.ext is not None]

    def refresh_registrations(self) -> None:
        """Recompute what ``register_sharded`` / ``register_unsharded`` write and which
        parameters get gradients (after parameter objects changed)."""
        Regs = list[tuple[dict[str, Any], str, torch.Tensor]]  # (module._parameters, name, t)
        self._sharded_regs: Regs = [
            (m._parameters, n, p.sharded) for p in self.params for m, n in p.owners
        ]
        # Extension parameters have no unsharded parameter before their first all-gather.
        self._unsharded_regs: Regs = [
            (m._parameters, n, p.unsharded)
            for p in self.params
            if p.unsharded is not None
            for m, n in p.owners
        ]
        self.grad_params = [p for p in self.params if p.requires_grad]

    def shard_mesh(self) -> DeviceMesh:
        """The mesh the shard dim spans (what extension hooks receive)."""
        if self._shard_mesh is None:
            self._shard_mesh = shard_mesh(self.info)
        return self._shard_mesh

    def _pin(self) -> bool:
        """Whether the sharded state lives in pinned host memory (CPU offload)."""
        policy = self.offload_policy
        return isinstance(policy, CPUOffloadPolicy) and policy.pin_memory

    def _new_sharded_flat(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if isinstance(self.offload_policy, CPUOffloadPolicy) and device.type != "meta":
            device = torch.device("cpu")
        # Padding must be zeros: it is all-gathered and reduced like real data.
        flat = torch.zeros(self.shard_numel, dtype=dtype, device=device)
        if self._pin() and self.device.type != "cpu":
            flat = flat.pin_memory()
        return flat

    def _init_unsharded(self, device: torch.device) -> None:
        """(Re)build the unsharded buffers, one per flat parameter, and point the
        unsharded params (same objects every time) at them; see [Note: flat storage]."""
        self._build_unsharded(device)
        self.released: list[int] = []  # flat params whose buffer was released early
        # what holds each buffer now (ours only; measured once the builder's locals are gone)
        self._holders = [_holders(b) for b in self.unsharded_bufs]
        if self.small is not None:
            self.small = SmallShard(self, self.small.size)

    def _build_unsharded(self, device: torch.device) -> None:
        w = self.world
        bufs = [
            torch.empty(w * p.padded_numel, dtype=self.param_dtype, device=device)
            for p in self.flat_params
        ]
        self.unsharded_bufs = bufs
        self.split_sizes = [p.padded_numel for p in self.flat_params]
        # writes through .data do not bump the params' version counter
        self.copy_dsts = [
            b.data.view(w, p.padded_numel) for b, p in zip(bufs, self.flat_params, strict=True)
        ]
        self.row_dsts = [[d[r] for d in self.copy_dsts] for r in range(w)]  # rank r's rows
        # Shard(d > 0) params: the copy-out writes a permuted view instead.
        self._dim_copies = [
            (i, p.split_view(bufs[i].data), p.local_shape)
            for i, p in enumerate(self.flat_params)
            if p.shard_dim != 0
        ]
        with torch.no_grad():
            for p, b in zip(self.flat_params, bufs, strict=True):
                numel = 1 if p.is_scalar else p.shape.numel()
                view = b.narrow(0, 0, numel).view(p.shape)
                old = p.unsharded
                if p.tp is not None:
                    if isinstance(old, DTensor) and (old.device, old.dtype) == (
                        view.device,
                        view.dtype,
                    ):
                        old._local_tensor = view
                    else:
                        new = nn.Parameter(p.wrap_unsharded(view), p.requires_grad)
                        p.unsharded = new if old is None else _swap(old, new)
                    continue
                assert old is not None  # plain flat parameters always have one
                if old.device == view.device and old.dtype == view.dtype:
                    old.data = view
                else:  # e.g. meta -> cpu: .data cannot change the tensor type
                    new = nn.Parameter(view, old.requires_grad)
                    _forget_fake(old, new)
                    torch.utils.swap_tensors(old, new)
        for b in bufs:
            _free(b)

    def relayout(self, dtype: torch.dtype, device: torch.device) -> None:
        """Lay the flat parameters out again in a new flat buffer of ``dtype`` on
        ``device``, moving their current local tensors into it (parameter objects keep
        their identity), and rebuild the unsharded buffers."""
        self._assign_offsets()
        new = self._new_sharded_flat(dtype, device)
        with torch.no_grad():
            for p in self.flat_params:
                view = p.local_view(new)
                if not new.is_meta and p.local_numel:
                    view.copy_(p.sharded._local_tensor)
                p.sharded._local_tensor = view
                p.spec = p.sharded._spec
        self.sharded_flat = new
        self._init_unsharded(torch.device("meta") if new.is_meta else self.device)

    def register_sharded(self) -> None:
        for d, n, t in self._sharded_regs:
            d[n] = t

    def register_unsharded(self) -> None:
        for d, n, t in self._unsharded_regs:
            d[n] = t

    # ---- layout changes after fully_shard (see relayout.py) ----------------------

    def adopt_registered(self) -> None:
        L.adopt_registered(self)

    def resync_after_apply(self) -> None:
        L.resync_after_apply(self)

    def adopt_patched_hooks(self) -> None:
        if L.hooks_patched(self):
            L.adopt_patched_hooks(self)

    # ---- unshard / reshard -------------------------------------------------------

    def unshard(self) -> None:
        """Issue this group's all-gather if its params are not unsharded or coming.
        Returns at once; ``wait_for_unshard`` makes the params usable."""
        if self.sharded_state is Sharded.UNSHARDED or self._pending_ag is not None:
            return
        if self.sharded_state is Sharded.SMALL:
            assert self.small is not None
            self._pending_ag = self.small.all_gather()
            self._pending_ag_small = True
            return
        with label("copy_in", self.path):
            flat = self.gather_input()
            if self.ext_params:
                flat = X.pack_inputs(self, flat)
        pg = self.info.shard_group
        D.check("all-gather", self.path, flat.numel() * self.world, flat.dtype, pg)
        with label("all_gather issue", self.path):
            if self._gathers_into_rows(flat, pg):  # see [Note: gloo straight in and out]
                for b in self.unsharded_bufs:
                    _alloc(b)
                pending: C.Pending | C.Received = C.all_gather_into(
                    flat, self.split_sizes, self.row_dsts, pg
                )
            else:
                pending = C.all_gather(flat, pg, self.world, self.gather.comm)
            self.gather_issued(pending)

    def _gathers_into_rows(self, flat: torch.Tensor, pg: Any) -> bool:
        """Whether the all-gather may land straight in the unsharded parameters' rows."""
        plain = not self.ext_params and not self._dim_copies and self.gather.comm is None
        return plain and self.world > 1 and C._by_exchange(flat, pg)

    def gather_input(self) -> torch.Tensor:
        """This rank's flat all-gather input (plain parameters)."""
        flat = self.sharded_flat
        if flat.numel() and (flat.device != self.device or self.param_dtype != flat.dtype):
            # CPU offload (host-to-device) and/or param_dtype cast, in one op
            flat = flat.to(self.device, self.param_dtype, non_blocking=True)
        return flat

    def gather_issued(self, pending: C.Pending | C.Received) -> None:
        """This group's all-gather (alone, or its slice of a bucket's) is in flight."""
        self._pending_ag = pending
        self._pending_ag_small = False

    def needs_gather(self) -> bool:
        """Neither unsharded nor being gathered."""
        return self.sharded_state is not Sharded.UNSHARDED and self._pending_ag is None

    def gather_key(self) -> tuple[Any, ...] | None:
        """Groups with equal keys may share one all-gather (``None``: never bucketed);
        only while they need one (``needs_gather``)."""
        g = self.gather
        if (
            g.bucket_bytes is None
            or g.comm is not None
            or self.ext_params
            or self.sharded_state is not Sharded.SHARDED
        ):
            return None
        return (self.info.shard_group, self.world, self.param_dtype, self.device)

    def gather_bytes(self) -> int:
        """Bytes of the unsharded parameters (the all-gather output)."""
        return self.world * self.shard_numel * self.param_dtype.itemsize

    def has_pending_unshard(self) -> bool:
        """Whether an all-gather was issued and not waited yet."""
        return self._pending_ag is not None

    def wait_if_pending(self) -> None:
        """Finish an all-gather already issued; never starts one."""
        if self._pending_ag is not None:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Make the unsharded params valid and registered, waiting on (or issuing)
        the all-gather."""
        if self.sharded_state is Sharded.UNSHARDED:
            return
        if self._pending_ag is None:
            self.unshard()
        pending, self._pending_ag = self._pending_ag, None
        assert pending is not None
        if isinstance(pending, C.Received):  # landed in the buffers (allocated at issue)
            with label("all_gather wait", self.path):
                pending.wait_works()
            with label("copy_out", self.path):
                pending.fill()
            self.sharded_state = Sharded.UNSHARDED
            self.register_unsharded()
            return
        # on gloo this rank's row is still only in its shard: plain groups copy each row
        # out from where it is (see Pending.wait_rows)
        by_rows = pending.own_row >= 0 and not (
            self._pending_ag_small or self.ext_params or self._dim_copies
        )
        with label("all_gather wait", self.path):
            rows = pending.wait_rows() if by_rows else [pending.wait()]
        with label("copy_out", self.path):
            for b in self.unsharded_bufs:
                _alloc(b)
            if by_rows:
                for row, dsts in zip(rows, self.row_dsts, strict=True):
                    C.copy_out(row, self.split_sizes, dsts)
            elif self._pending_ag_small:
                assert self.small is not None
                for p in self.ext_params:
                    p.ext.alloc()  # type: ignore[union-attr]
                self.small.copy_out(rows[0])
            elif self.ext_params:
                X.copy_out(self, rows[0])
            else:
                self.copy_out_plain(rows[0])
        del rows, pending
        if self.ext_params:
            self._build_ext_unsharded()
        self.sharded_state = Sharded.UNSHARDED
        self.register_unsharded()

    def copy_out_plain(self, output: torch.Tensor) -> None:
        """Scatter the rank-major ``(world, shard_numel)`` all-gather output of the
        flat buffer into the unsharded parameters."""
        if not self._dim_copies:
            C.copy_out(output, self.split_sizes, self.copy_dsts)
        else:
            self._copy_out_permuted(output)

    def _build_ext_unsharded(self) -> None:
        created = False
        for p in self.ext_params:
            assert p.ext is not None
            created |= p.ext.build(p, self.param_dtype)
        if created:
            self.refresh_registrations()

    def unsharded_segments(self) -> list[torch.Tensor]:
        """Every unsharded byte of the group as ``(world, k)`` rank-major tensors
        (allocated only while unsharded)."""
        segs = list(self.copy_dsts)
        for p in self.ext_params:
            assert p.ext is not None
            segs.extend(p.ext.segments(self.world))
        return segs

    def _copy_out_permuted(self, output: torch.Tensor) -> None:
        chunks = output.split(self.split_sizes, dim=1)
        special = {i: (dst, shape) for i, dst, shape in self._dim_copies}
        for i, (chunk, dst) in enumerate(zip(chunks, self.copy_dsts, strict=True)):
            if i in special:
                dst, shape = special[i]
                dst.copy_(chunk.view(chunk.size(0), *shape))
            else:
                dst.copy_(chunk)

    def reshard(self, *, to_small: bool = False) -> None:
        """Free the unsharded params and register the sharded ones. With
        ``to_small`` (reshard_after_forward=int) keep a copy sharded over the
        smaller group for the backward all-gather."""
        with label("reshard", self.path):
            self._reshard(to_small)

    def _reshard(self, to_small: bool) -> None:
        if self._pending_ag is not None:  # prefetched but unused
            pending, self._pending_ag = self._pending_ag, None
            if isinstance(pending, C.Received):
                pending.wait_works()  # the receives write into the buffers: then free them
                for b in self.unsharded_bufs:
                    _free(b)
            else:
                pending.wait()
        if self.sharded_state is Sharded.SMALL and not to_small:
            # The small copy holds this step's values; never gather it next step.
            self._drop_small()
            return
        if self.sharded_state is not Sharded.UNSHARDED:
            return
        if to_small and self.small is not None:
            self.small.keep()
            self.sharded_state = Sharded.SMALL
        else:
            self.sharded_state = Sharded.SHARDED
        for b in self.unsharded_bufs:
            _free(b)
        self.released = []
        self._drop_restore_hooks()
        for p in self.ext_params:
            p.ext.free()  # type: ignore[union-attr]
        self.register_sharded()

    def _drop_small(self) -> None:
        if self.small is not None:  # None if reshard_after_forward changed meanwhile
            self.small.flat = None
        self.sharded_state = Sharded.SHARDED

    def after_forward(self) -> None:
        """Reshard per ``reshard_after_forward`` at the end of a training forward."""
        if self.gather.post_forward is True:
            self.reshard()
        elif self.gather.post_forward is not False:
            self.reshard(to_small=True)

    # ---- what backward does not read (see [Note: release]) ----------------------

    def release_unread(self) -> None:
        """Free the unsharded buffer of every plain trainable parameter nothing in the
        autograd graph holds (it was used, but no node saved it: an embedding's weight).
        It is registered sharded until the group reshards, or gathered again if a module
        owning it runs forward meanwhile (an activation-checkpoint recompute): see
        [Note: release]."""
        if self.ext_params or self.sharded_state is not Sharded.UNSHARDED:
            return
        if not self.gather.reshard_after_backward or self.released:
            return
        owned: dict[int, tuple[nn.Module, list[int]]] = {}
        for i, p in enumerate(self.flat_params):
            if not p.requires_grad or p.tp is not None or p.is_scalar or p.shard_dim != 0:
                continue
            b = self.unsharded_bufs[i]
            if _holders(b) != self._holders[i] or not _only_accumulator(p.unsharded):
                continue
            _free(b)
            for m, n in p.owners:
                m._parameters[n] = p.sharded  # type: ignore[assignment]  # a DTensor Parameter
                owned.setdefault(id(m), (m, []))[1].append(i)
            self.released.append(i)
        self._restore_hooks = [
            m.register_forward_pre_hook(_restore_hook(self, idx)) for m, idx in owned.values()
        ]

    def restore_released(self, idx: list[int]) -> None:
        """Gather the released parameters ``idx`` (flat indices) again and register them
        unsharded."""
        idx = [i for i in idx if i in self.released]
        if not idx:
            return
        pg = self.info.shard_group
        flat = self.gather_input()
        D.check("all-gather", self.path, flat.numel() * self.world, flat.dtype, pg)
        with label("all_gather issue", self.path):
            pending = C.all_gather(flat, pg, self.world, self.gather.comm)
        with label("all_gather wait", self.path):
            output = pending.wait()
        with label("copy_out", self.path):
            cols = output.split(self.split_sizes, dim=1)
            for i in idx:
                _alloc(self.unsharded_bufs[i])
                self.copy_dsts[i].copy_(cols[i])
                p = self.flat_params[i]
                for m, n in p.owners:
                    m._parameters[n] = p.unsharded  # type: ignore[assignment]
        self.released = [i for i in self.released if i not in idx]
        if not self.released:
            self._drop_restore_hooks()

    def _drop_restore_hooks(self) -> None:
        for h in self._restore_hooks:
            h.remove()
        self._restore_hooks = []

    # ---- gradients --------------------------------------------------------------

    def post_backward(self) -> R.Part | None:
        """Take the gradients computed so far for reduction (the caller issues the
        reduce-scatter, alone or bucketed, and advances it) and reshard."""
        part = None
        if self.reduce.sync:
            part = R.take_grads(self)
        elif self.reduce_dtype is not None:
            R.accumulate_in_reduce_dtype(self)
        if self.gather.reshard_after_backward:
            self.reshard()
        elif self.sharded_state is Sharded.SMALL:
            self._drop_small()
        return part

    def has_unreduced_grads(self) -> bool:
        return R.has_unreduced_grads(self)

    # ---- recovery ---------------------------------------------------------

    def discard_grads(self) -> None:
        """Drop unreduced gradients (unsharded, no-sync sums, HSDP partials)."""
        for p in self.grad_params:
            if p.unsharded is not None:
                p.unsharded.grad = None
        self.acc_grads.clear()
        self.partial_reduce = None


def _restore_hook(group: ParamGroup, idx: list[int]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        group.restore_released(idx)

    # run eagerly (a collective and storage moves), as every engine hook
    return cast(Callable[..., None], torch.compiler.disable(hook))


def _holders(t: torch.Tensor) -> int:
    """How many tensors hold ``t``'s storage (its use count)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def _only_accumulator(t: torch.Tensor | None) -> bool:
    """Whether nothing but its Python object and (if any) its gradient accumulator holds
    the tensor ``t``: no autograd node saved it, no view of it is alive."""
    if t is None:
        return False
    before = int(t._use_count())  # type: ignore[attr-defined]
    edge = torch.autograd.graph.get_gradient_edge(t)  # made now if there was none
    existed = int(t._use_count()) == before  # type: ignore[attr-defined]  # a new one holds t
    del edge
    return before == 1 + int(existed)


def _forget_fake(*ts: torch.Tensor) -> None:
    """Drop ``ts`` from their fake mode's conversion memo, whose weak references would make
    ``swap_tensors`` refuse them (fsdp2.estimate_memory's simulated step)."""
    for t in ts:
        if isinstance(t, FakeTensor):
            memo = t.fake_mode.fake_tensor_converter.meta_converter.tensor_memo
            for key in [k for k, v in memo.items() if v is t]:
                del memo[key]


def _swap(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Give ``old`` the contents of ``new`` (the object keeps its identity)."""
    torch.utils.swap_tensors(old, new)
    return old
