"""One parameter group: the params of one ``fully_shard`` call, gathered and
reduced together. Owns unshard / wait / reshard and gradient reduction.

# [Note: scalars]
# torch's FSDP2 rejects 0-dim parameters; we replicate them instead. In the flat
# layout a scalar takes one element per rank (its own copy), the all-gather
# brings every rank's copy and the unsharded parameter views the first; for
# reduction its gradient is written into every rank's slot, so the
# reduce-scatter sums it over ranks like an all-reduce. Its DTensor placement
# is ``Replicate()`` and each rank holds the same averaged gradient.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import _collectives as C
from . import _extension as X
from ._extension import extension_of
from ._mesh import MeshInfo, post_forward_group, shard_mesh
from ._param import FSDPParam
from ._storage import alloc_storage as _alloc
from ._storage import free_storage as _free
from .api import AllGather, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, ReduceScatter

if TYPE_CHECKING:
    from ._state import StepContext


class Sharded(enum.Enum):
    SHARDED = enum.auto()  # sharded DTensors registered; unsharded storage freed
    UNSHARDED = enum.auto()  # unsharded params registered and valid
    SMALL = enum.auto()  # like SHARDED, plus a copy sharded over a smaller group
    # (reshard_after_forward=int) that the backward all-gather reads


class ParamGroup:
    """The params of one ``fully_shard`` call and their collectives.

    All per-parameter work on the hot path is either one flat op or a loop
    over precomputed tuples (see [Note: flat storage] in _param.py).
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
        self.mp_policy = mp_policy
        self.offload_policy = offload_policy
        self.orig_dtype = _group_dtype(params, name)
        self.param_dtype = mp_policy.param_dtype or self.orig_dtype
        reduce_dtype = mp_policy.reduce_dtype
        self.reduce_dtype = (
            None if reduce_dtype is None or reduce_dtype == self.param_dtype else reduce_dtype
        )
        self.device = info.device
        self.world = info.shard_size
        self.sharded_state = Sharded.SHARDED
        self._pending_ag: C.Pending | None = None
        self._pending_ag_small = False
        # runtime switches (FSDPModule setters)
        self.reduce_grads = True
        self.all_reduce_grads = True
        self.reshard_after_backward = True
        self.unshard_in_backward = True
        self.reduce_unused = False  # set_reduce_scatter_unused_params
        self.max_inflight = 1  # set_reduce_scatter_max_input_buffers
        self.divide_factor: float | None = None  # set_gradient_divide_factor
        self.force_sum = False  # set_force_sum_reduction_for_comms
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.ag_comm: AllGather | None = None  # set_custom_all_gather
        self.rs_comm: ReduceScatter | None = None  # set_custom_reduce_scatter
        self.rs_group: dist.ProcessGroup | None = None  # set_separate_reduce_scatter_group
        self.partial_reduce: torch.Tensor | None = None  # HSDP without all-reduce
        self._acc_grads: dict[int, torch.Tensor] = {}  # no-sync sums in reduce_dtype
        self.post_forward: bool | int = reshard_after_forward
        # per-step bookkeeping, reset by reset_step()
        self.post_backward_pending = 0  # registered post-backward nodes still to fire
        self.untracked_calls = 0  # forward calls whose inputs needed no grad (no node)
        self.backward_done = False
        self.fwd_next: list[ParamGroup] = []  # implicit forward prefetch (last step's order)
        self.bwd_next: list[ParamGroup] = []  # implicit backward prefetch
        self.fwd_prefetch: list[ParamGroup] | None = None  # explicit lists override
        self.bwd_prefetch: list[ParamGroup] | None = None
        self.ctx: StepContext | None = None
        self._small: _SmallShard | None = None
        self._resync_pending = False  # adopt_registered waits for a whole group
        self._init_storage()
        self.set_post_forward(reshard_after_forward)

    # ---- init -----------------------------------------------------------------

    def _init_storage(self) -> None:
        # Plain parameters share the flat buffer; extension parameters keep their own
        # storage (see [Note: all-gather extensions] in _extension.py), and so do plain
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
        self.flat_params = [p for p in self.params if p.ext is None]
        self.ext_params = [p for p in self.params if p.ext is not None]
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
        offload = isinstance(self.offload_policy, CPUOffloadPolicy)
        pin = offload and self.offload_policy.pin_memory and self.device.type != "cpu"
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
        self._sharded_regs = [
            (m._parameters, n, p.sharded) for p in self.params for m, n in p.owners
        ]
        self._build_unsharded_regs()
        self._grad_params = [p for p in self.params if p.requires_grad]
        self.register_sharded()

    def _assign_offsets(self) -> None:
        """Place the flat parameters back to back in the flat sharded buffer."""
        offset = 0
        for p in self.flat_params:
            p.offset = offset
            offset += p.padded_numel
        self.shard_numel = offset

    def _build_unsharded_regs(self) -> None:
        # Extension parameters have no unsharded parameter before their first all-gather.
        self._unsharded_regs = [
            (m._parameters, n, p.unsharded)
            for p in self.params
            if p.unsharded is not None
            for m, n in p.owners
        ]

    def shard_mesh(self) -> DeviceMesh:
        """The mesh the shard dim spans (what extension hooks receive)."""
        if self._shard_mesh is None:
            self._shard_mesh = shard_mesh(self.info)
        return self._shard_mesh

    def _new_sharded_flat(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        offload = isinstance(self.offload_policy, CPUOffloadPolicy)
        if offload and not device.type == "meta":
            device = torch.device("cpu")
        # Padding must be zeros: it is all-gathered and reduced like real data.
        flat = torch.zeros(self.shard_numel, dtype=dtype, device=device)
        if offload and self.offload_policy.pin_memory and self.device.type != "cpu":
            flat = flat.pin_memory()
        return flat

    def _init_unsharded(self, device: torch.device) -> None:
        """(Re)build the flat unsharded buffer and point the unsharded params
        (same objects every time) at their views; see [Note: flat storage]."""
        w = self.world
        un = torch.empty(w * self.shard_numel, dtype=self.param_dtype, device=device)
        self.unsharded_flat = un
        data = un.data  # writes through .data do not bump the params' version counter
        self.split_sizes = [p.padded_numel for p in self.flat_params]
        self.copy_dsts = [
            data.narrow(0, w * p.offset, w * p.padded_numel).view(w, p.padded_numel)
            for p in self.flat_params
        ]
        # Shard(d > 0) params: the copy-out writes a permuted view instead.
        self._dim_copies = [
            (i, p.split_view(data.narrow(0, w * p.offset, w * p.padded_numel)), p.local_shape)
            for i, p in enumerate(self.flat_params)
            if p.shard_dim != 0
        ]
        with torch.no_grad():
            for p in self.flat_params:
                numel = 1 if p.is_scalar else p.shape.numel()
                view = un.narrow(0, w * p.offset, numel).view(p.shape)
                old = p.unsharded
                if p.tp is not None:
                    same = isinstance(old, DTensor) and old.device == view.device
                    if same and old.dtype == view.dtype:
                        old._local_tensor = view
                    else:
                        new = nn.Parameter(p.wrap_unsharded(view), p.requires_grad)
                        p.unsharded = new if old is None else _swap(old, new)
                elif old.device == view.device and old.dtype == view.dtype:
                    old.data = view
                else:  # e.g. meta -> cpu: .data cannot change the tensor type
                    torch.utils.swap_tensors(old, nn.Parameter(view, old.requires_grad))
        _free(un)
        if self._small is not None:
            self._small = _SmallShard(self, self._small.size)

    def adopt_registered(self) -> None:
        """Take parameters registered in place of the group's sharded ones as the new
        sharded parameters, and move their values into the flat buffer.

        Runs after ``load_state_dict(assign=True)`` (a post-hook per owner module) and
        at lazy init (a parameter replaced after ``fully_shard``, e.g.
        ``module.weight = nn.Parameter(...)`` after ``to_empty``). The new parameter
        must be a DTensor with the sharded parameter's placements and local shape
        (ValueError otherwise, naming it). The flat buffer is
        rebuilt once none of the group's parameters is half-loaded (some still on
        meta while others are not), so loading module by module works.
        """
        changed = False
        for p in self.params:
            m, n = p.owners[0]
            cur = m._parameters.get(n)
            if cur is None or cur is p.sharded or cur is p.unsharded:
                continue
            cur = self._as_sharded(p, cur)
            p.sharded = cur
            for m2, n2 in p.owners:
                m2._parameters[n2] = cur
            if cur.requires_grad != p.requires_grad:
                p.requires_grad = cur.requires_grad
                if p.unsharded is not None:
                    p.unsharded.requires_grad_(cur.requires_grad)
                self._grad_params = [q for q in self.params if q.requires_grad]
            changed = True
        if changed:
            self._sharded_regs = [
                (m._parameters, n, p.sharded) for p in self.params for m, n in p.owners
            ]
            self._resync_pending = True
        if self._resync_pending:
            on_meta = {p.sharded.is_meta for p in self.params}
            if len(on_meta) == 1:  # not half-loaded
                self._resync_pending = False
                self.resync_after_apply()

    def _as_sharded(self, p: FSDPParam, cur: torch.Tensor) -> nn.Parameter:
        """``cur``, registered where ``p``'s sharded parameter was, checked (and for a
        full plain tensor, sharded) to serve as ``p``'s new sharded parameter."""
        want = tuple(p.sharded.placements)
        if not isinstance(cur, DTensor):
            # Not adopted by sharding it into a new object: an optimizer built in between
            # would hold the plain tensor, which would then silently not train.
            raise ValueError(
                f"parameter {p.fqn} was replaced after fully_shard by a plain "
                f"{type(cur).__name__} of shape {tuple(cur.shape)}; a sharded model needs a "
                f"DTensor there (placements {want}), e.g. nn.Parameter(distribute_tensor(t, "
                "old.device_mesh, old.placements)), or copy the values into the existing "
                "parameter: with torch.no_grad(): old.copy_(distribute_tensor(t, "
                "old.device_mesh, old.placements))"
            )
        if tuple(cur.placements) != want or cur._local_tensor.shape != p.sharded.to_local().shape:
            raise ValueError(
                f"parameter {p.fqn} was replaced (load_state_dict(assign=True) or "
                f"assignment) by a DTensor with placements {tuple(cur.placements)} and local "
                f"shape {tuple(cur._local_tensor.shape)}; fsdp2 needs placements {want} and "
                f"local shape {tuple(p.sharded.to_local().shape)} (or a full tensor)"
            )
        if p.ext is not None and type(cur._local_tensor) is not type(p.sharded._local_tensor):
            raise ValueError(
                f"load_state_dict(assign=True) put a DTensor of "
                f"{type(cur._local_tensor).__qualname__} at {p.fqn}, which is a "
                f"{type(p.sharded._local_tensor).__qualname__} parameter; assigning "
                "would drop the tensor subclass. Load without assign=True (values are "
                "copied into the subclass) or assign values of the same subclass"
            )
        if not isinstance(cur, nn.Parameter) and not getattr(cur, "_is_param", False):
            cur = nn.Parameter(cur, cur.requires_grad)  # type: ignore[assignment]
        return cur  # type: ignore[return-value]

    def resync_after_apply(self) -> None:
        """After ``nn.Module._apply`` (``to_empty``, ``.to(device or dtype)``)
        swapped the sharded params' local tensors, move them back into a flat
        buffer (of the new device/dtype) so [Note: flat storage] holds again.
        Parameter objects keep their identity."""
        self._resync_ext()
        if not self.flat_params:
            return
        locals_ = [p.sharded._local_tensor for p in self.flat_params]
        flat = self.sharded_flat
        ptr = flat.untyped_storage().data_ptr()
        if all(
            t.dtype == flat.dtype
            and t.device == flat.device
            and (t.is_meta or t.untyped_storage().data_ptr() == ptr)
            for t in locals_
        ):
            return
        dtype, device = locals_[0].dtype, locals_[0].device
        if any(t.dtype != dtype for t in locals_):
            raise ValueError(f"fully_shard({self.name}): conversion left mixed dtypes")
        self.orig_dtype = dtype
        self.param_dtype = self.mp_policy.param_dtype or dtype
        self._rebuild_flat(dtype, device)

    def _rebuild_flat(self, dtype: torch.dtype, device: torch.device) -> None:
        """Lay the flat parameters out again in a new flat buffer of ``dtype`` on
        ``device``, moving their current local tensors into it (parameter objects keep
        their identity), and rebuild the unsharded buffer."""
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

    def hooks_patched(self) -> bool:
        """Whether a flat parameter's local tensor was given all-gather hooks."""
        return any(
            hasattr(p.sharded._local_tensor, "fsdp_pre_all_gather") for p in self.flat_params
        )

    def adopt_patched_hooks(self) -> None:
        """Plain parameters whose local tensor was given the all-gather hooks after
        ``fully_shard`` (as instance attributes, e.g. after ``to_empty``) become
        extension parameters: their local tensor objects (which carry the hooks) get
        storage of their own and the flat buffer is rebuilt without them. Runs at
        lazy init and, while the group is sharded, when a step's forward begins
        (``hooks_patched`` is the cheap test)."""
        patched = [
            p for p in self.flat_params if hasattr(p.sharded._local_tensor, "fsdp_pre_all_gather")
        ]
        if not patched:
            return
        for p in patched:
            local = p.sharded._local_tensor
            if p.is_scalar or p.shard_dim != 0:
                raise NotImplementedError(
                    f"parameter {p.fqn} was given all-gather hooks, but fsdp2 applies them "
                    "only to parameters sharded on dim 0 (not 0-dim ones)"
                )
            p.ext = extension_of(local, p.fqn)
            with torch.no_grad():
                local.data = local.detach().clone()  # the object keeps its hooks
            p.unsharded = None
            p.offset = -1
        self.flat_params = [p for p in self.params if p.ext is None]
        self.ext_params = [p for p in self.params if p.ext is not None]
        self._rebuild_flat(self.sharded_flat.dtype, self.sharded_flat.device)
        self._build_unsharded_regs()

    def _resync_ext(self) -> None:
        """Extension parameters whose local tensor changed (``to_empty``, ``.to``,
        ``assign=True``) get a fresh all-gather layout and unsharded parameter."""
        changed = False
        for p in self.ext_params:
            assert p.ext is not None
            p.spec = p.sharded._spec
            if not p.ext.stale(p.sharded._local_tensor):
                continue
            p.ext.free()
            p.ext.reset()
            p.unsharded = None
            changed = True
        if changed:
            self._build_unsharded_regs()
        dtypes = {p.sharded.dtype for p in self.params}
        if not self.flat_params and len(dtypes) == 1:
            self.orig_dtype = dtypes.pop()
            self.param_dtype = self.mp_policy.param_dtype or self.orig_dtype

    def set_post_forward(self, value: bool | int) -> None:
        """Apply a normalized ``reshard_after_forward`` (a bool, or an int strictly
        between 1 and the shard world size; see ``normalize_reshard_after_forward``)."""
        self.post_forward = value
        self._small = None if isinstance(value, bool) else _SmallShard(self, value)

    def register_sharded(self) -> None:
        for d, n, t in self._sharded_regs:
            d[n] = t

    def register_unsharded(self) -> None:
        for d, n, t in self._unsharded_regs:
            d[n] = t

    # ---- unshard / reshard -------------------------------------------------------

    def unshard(self) -> None:
        """Issue this group's all-gather if its params are not unsharded or coming.
        Returns at once; ``wait_for_unshard`` makes the params usable."""
        if self.sharded_state is Sharded.UNSHARDED or self._pending_ag is not None:
            return
        if self.sharded_state is Sharded.SMALL:
            assert self._small is not None
            self._pending_ag = self._small.all_gather()
            self._pending_ag_small = True
            return
        flat = self.sharded_flat
        if flat.numel() and (flat.device != self.device or self.param_dtype != flat.dtype):
            # CPU offload (host-to-device) and/or param_dtype cast, in one op
            flat = flat.to(self.device, self.param_dtype, non_blocking=True)
        if self.ext_params:
            flat = X.pack_inputs(self, flat)
        self._pending_ag = C.all_gather(flat, self.info.shard_group, self.world, self.ag_comm)
        self._pending_ag_small = False

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
        output = pending.wait()
        _alloc(self.unsharded_flat)
        if self._pending_ag_small:
            assert self._small is not None
            for p in self.ext_params:
                p.ext.alloc()  # type: ignore[union-attr]
            self._small.copy_out(output)
        elif self.ext_params:
            X.copy_out(self, output)
        else:
            self.copy_out_plain(output)
        del output, pending
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
            self._build_unsharded_regs()

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
        if self._pending_ag is not None:  # prefetched but unused
            self._pending_ag.wait()
            self._pending_ag = None
        if self.sharded_state is Sharded.SMALL and not to_small:
            # The small copy holds this step's values; never gather it next step.
            self._drop_small()
            return
        if self.sharded_state is not Sharded.UNSHARDED:
            return
        if to_small and self._small is not None:
            self._small.keep()
            self.sharded_state = Sharded.SMALL
        else:
            self.sharded_state = Sharded.SHARDED
        _free(self.unsharded_flat)
        for p in self.ext_params:
            p.ext.free()  # type: ignore[union-attr]
        self.register_sharded()

    def _drop_small(self) -> None:
        assert self._small is not None
        self._small.flat = None
        self.sharded_state = Sharded.SHARDED

    def after_forward(self) -> None:
        """Reshard per ``reshard_after_forward`` at the end of a training forward."""
        if self.post_forward is True:
            self.reshard()
        elif self.post_forward is not False:
            self.reshard(to_small=True)

    # ---- gradients --------------------------------------------------------------

    def post_backward(self) -> None:
        """Reduce the gradients computed so far (one reduce-scatter) and reshard."""
        self.backward_done = True
        if self.reduce_grads:
            self._reduce()
        elif self.reduce_dtype is not None:
            self._accumulate_in_reduce_dtype()
        if self.reshard_after_backward:
            self.reshard()
        elif self.sharded_state is Sharded.SMALL:
            self._drop_small()

    def has_unreduced_grads(self) -> bool:
        return bool(self._acc_grads) or any(
            p.unsharded is not None and p.unsharded.grad is not None for p in self._grad_params
        )

    def _accumulate_in_reduce_dtype(self) -> None:
        """Without gradient sync, keep the running sum in ``reduce_dtype`` (so
        low-precision compute does not accumulate in low precision)."""
        acc = self._acc_grads
        for p in self._grad_params:
            u = p.unsharded
            g = None if u is None else u.grad
            if g is None:
                continue
            u.grad = None
            prev = acc.get(id(p))
            acc[id(p)] = g.to(self.reduce_dtype) if prev is None else prev.add_(g)

    def _take_grads(self) -> tuple[list[FSDPParam], list[torch.Tensor]]:
        params, grads = [], []
        acc = self._acc_grads
        for p in self._grad_params:
            u = p.unsharded
            g = None if u is None else u.grad
            if acc:
                prev = acc.pop(id(p), None)
                if prev is not None:
                    g = prev if g is None else prev.add_(g)
            if g is None:
                if not self.reduce_unused:
                    continue
                g = torch.zeros(p.shape, dtype=self.param_dtype, device=self.device)
            elif u is not None:
                u.grad = None
            params.append(p)
            if p.tp is not None:
                g = p.tp.to_local_grad(g)
            if p.is_scalar:
                g = g.expand(self.world)
            elif p.shard_dim != 0:
                g = p.split_view(g).reshape(self.world, -1)
            grads.append(g)
        return params, grads

    def _reduce(self) -> None:
        params, grads = self._take_grads()
        if not params:
            return
        dtype = self.reduce_dtype or self.param_dtype
        packed = C.pack_for_reduce_scatter(grads, self.world, dtype, self.rs_comm)
        del grads
        plan = C.divide_plan(
            self.world,
            self.info.replicate_size if self.info.replicate_group is not None else 1,
            dtype,
            self.divide_factor,
            self.force_sum,
        )
        if plan.pre is not None:
            packed.div_(plan.pre)
        group = self.rs_group or self.info.shard_group
        pending = C.reduce_scatter(packed, group, plan.rs_op, self.rs_comm)
        assert self.ctx is not None
        self.ctx.add_reduction(_Reduction(self, params, pending, plan))

    def land_grads(self, params: list[FSDPParam], output: torch.Tensor) -> None:
        """Turn a rank's reduce-scatter output into the sharded params' ``.grad``
        (views of ``output``), accumulating into existing gradients."""
        flat = self.sharded_flat
        if output.device != flat.device:  # CPU offload: device-to-host
            host = torch.empty(output.shape, dtype=self.orig_dtype, pin_memory=flat.is_pinned())
            host.copy_(output, non_blocking=flat.is_pinned())
            output = host
            if flat.is_pinned():
                assert self.ctx is not None
                self.ctx.pending_d2h = True  # synchronized by the final callback
        elif output.dtype != self.orig_dtype:
            output = output.to(self.orig_dtype)
        offset = output.storage_offset()
        acc_dst, acc_src = [], []
        for p in params:
            local = output.as_strided(p.local_shape, p.local_stride, offset)
            offset += p.padded_numel
            sp = p.sharded
            g = sp.grad
            if g is None:
                sp.grad = p.grad_dtensor(local)
            else:
                acc_dst.append(g._local_tensor)
                acc_src.append(local)
        if acc_dst:
            torch._foreach_add_(acc_dst, acc_src)

    # ---- per-step state ---------------------------------------------------------

    def reset_step(self) -> None:
        self.post_backward_pending = 0
        self.untracked_calls = 0
        self.backward_done = False

    def discard_grads(self) -> None:
        """Drop unreduced gradients (unsharded, no-sync sums, HSDP partials)."""
        for p in self._grad_params:
            if p.unsharded is not None:
                p.unsharded.grad = None
        self._acc_grads.clear()
        self.partial_reduce = None


class _Reduction:
    """One group's gradient reduction in flight: reduce-scatter, then (HSDP)
    all-reduce, then the gradients land."""

    __slots__ = ("group", "params", "pending", "plan", "stage")

    def __init__(
        self, group: ParamGroup, params: list[FSDPParam], pending: C.Pending, plan: C.DividePlan
    ) -> None:
        self.group = group
        self.params = params
        self.pending = pending
        self.plan = plan
        self.stage = "reduce_scatter"

    def advance(self) -> bool:
        """Wait for the current stage and start the next; True once finished."""
        g = self.group
        output = self.pending.wait()
        if self.stage == "reduce_scatter" and g.info.replicate_group is not None:
            if not g.all_reduce_grads:
                # HSDP accumulation: keep the shard-reduced sum, all-reduce it later.
                g.partial_reduce = (
                    output if g.partial_reduce is None else g.partial_reduce.add_(output)
                )
                return True
            if g.partial_reduce is not None:
                output.add_(g.partial_reduce)
                g.partial_reduce = None
            self.stage = "all_reduce"
            self.pending = C.all_reduce(output, g.info.replicate_group, self.plan.ar_op)
            return False
        if g.all_reduce_hook is not None:
            g.all_reduce_hook(output)
        if self.plan.post is not None:
            output.div_(self.plan.post)
        g.land_grads(self.params, output)
        return True


class _SmallShard:
    """A copy of the unsharded params sharded over ``size`` consecutive ranks,
    kept between forward and backward for ``reshard_after_forward=size``.

    Rank ``j`` of the small group keeps block ``j`` of every rank-major unsharded
    segment (each parameter's padded unsharded rows; an extension parameter's
    all-gather outputs): a segment holds ``world`` equal blocks, a multiple of
    ``size``, so the blocks tile it exactly. Groups with extension parameters keep
    bytes (their segments differ in dtype).
    """

    def __init__(self, group: ParamGroup, size: int) -> None:
        self.group = group
        self.group_pg, self.rank = post_forward_group(group.info, size)
        self.size = size
        self.flat: torch.Tensor | None = None
        self.split_sizes: list[int] = []
        self.dsts: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []

    def keep(self) -> None:
        """Keep this rank's blocks (the group must be unsharded)."""
        # Plain groups: the layout is fixed until _init_unsharded makes a new _SmallShard.
        # Extension outputs appear at the first all-gather (and after a reset): rebuild.
        if not self.dsts or self.group.ext_params:
            segs = self.group.unsharded_segments()
            if self.group.ext_params:
                segs = [s.view(torch.uint8) for s in segs]
            self.dsts = [s.view(self.size, s.numel() // self.size) for s in segs]
            self.split_sizes = [d.size(1) for d in self.dsts]
            self.sources = [d[self.rank] for d in self.dsts]
        self.flat = torch.cat(self.sources)

    def all_gather(self) -> C.Pending:
        flat, self.flat = self.flat, None
        assert flat is not None
        return C.all_gather(flat, self.group_pg, self.size)

    def copy_out(self, output: torch.Tensor) -> None:
        C.copy_out(output, self.split_sizes, self.dsts)


def _swap(old: nn.Parameter, new: nn.Parameter) -> nn.Parameter:
    """Give ``old`` the contents of ``new`` (the object keeps its identity)."""
    torch.utils.swap_tensors(old, new)
    return old


def _group_dtype(params: list[FSDPParam], name: str) -> torch.dtype:
    """The dtype of a group's flat buffer: its trainable parameters' (one dtype for all of
    them: their gradients are reduced together), else its most common one.

    [Note: other dtypes]
    A frozen parameter of another dtype (a frozen float8 or bf16 weight next to fp32
    trainable ones) keeps its own storage and is gathered as bytes in the group's one
    all-gather, like an extension parameter whose hooks fsdp2 plays itself: the input
    is its local shard (cast to ``param_dtype`` under mixed precision if it is floating,
    as torch's FSDP2 does), the unsharded parameter views the output.
    """
    trainable = {p.sharded.dtype for p in params if p.requires_grad}
    if len(trainable) > 1:
        listing = ", ".join(f"{p.fqn}: {p.sharded.dtype}" for p in params if p.requires_grad)
        raise ValueError(
            f"fully_shard({name}) needs one dtype for the trainable parameters it groups "
            f"(their gradients are reduced together), got {listing}. Cast the module "
            "(module.to(dtype)) or shard the differing submodules in their own fully_shard "
            "calls. Frozen parameters (requires_grad=False) may have other dtypes."
        )
    if trainable:
        return trainable.pop()
    counts: dict[torch.dtype, int] = {}
    for p in params:
        counts[p.sharded.dtype] = counts.get(p.sharded.dtype, 0) + 1
    return max(counts, key=lambda d: counts[d])
