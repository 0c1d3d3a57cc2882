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
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _collectives as C
from ._mesh import MeshInfo, post_forward_group
from ._param import FSDPParam
from .api import MixedPrecisionPolicy, OffloadPolicy

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
        dtypes = {p.sharded.dtype for p in params}
        if len(dtypes) > 1:
            listing = ", ".join(f"{p.fqn}: {p.sharded.dtype}" for p in params)
            raise ValueError(
                f"fully_shard({name}) needs one dtype for all the parameters it groups, got "
                f"{listing}. Cast the module (module.to(dtype)) or shard the differing "
                "submodules in their own fully_shard calls."
            )
        self.orig_dtype = dtypes.pop()
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
        self.post_forward: bool | int = reshard_after_forward
        # per-step bookkeeping, reset by reset_step()
        self.post_backward_pending = 0  # registered post-backward nodes still to fire
        self.backward_done = False
        self.fwd_next: list[ParamGroup] = []  # implicit forward prefetch (last step's order)
        self.bwd_next: list[ParamGroup] = []  # implicit backward prefetch
        self.fwd_prefetch: list[ParamGroup] | None = None  # explicit lists override
        self.bwd_prefetch: list[ParamGroup] | None = None
        self.ctx: StepContext | None = None
        self._init_storage()
        self._small: _SmallShard | None = None
        self.set_post_forward(reshard_after_forward)

    # ---- init -----------------------------------------------------------------

    def _init_storage(self) -> None:
        offset = 0
        for p in self.params:
            p.offset = offset
            offset += p.padded_numel
        self.shard_numel = offset
        device = self.device
        originals = [p.sharded for p in self.params]
        is_meta = any(t.is_meta for t in originals)
        flat_device = torch.device("meta") if is_meta else device
        # Padding must be zeros: it is all-gathered and reduced like real data.
        flat = torch.zeros(offset, dtype=self.orig_dtype, device=flat_device)
        with torch.no_grad():
            for p, t in zip(self.params, originals):
                if not is_meta and p.local_numel:
                    p.local_view(flat).copy_(p.local_chunk(t.detach()))
        self.sharded_flat = flat
        for p in self.params:
            p.make_sharded(flat, self.info)
        # Unsharded flat buffer, parameter-major (see [Note: flat storage]).
        w = self.world
        un = torch.empty(w * offset, dtype=self.param_dtype, device=flat_device)
        self.unsharded_flat = un
        data = un.data  # writes through .data do not bump the params' version counter
        self.split_sizes = [p.padded_numel for p in self.params]
        self.copy_dsts = [
            data.narrow(0, w * p.offset, w * p.padded_numel).view(w, p.padded_numel)
            for p in self.params
        ]
        for p, t in zip(self.params, originals):
            numel = 1 if p.is_scalar else t.numel()
            view = un.narrow(0, w * p.offset, numel).view(p.shape)
            p.unsharded = nn.Parameter(view, requires_grad=p.requires_grad)
        _free(un)
        self.has_scalars = any(p.is_scalar for p in self.params)
        self._sharded_regs = [
            (m._parameters, n, p.sharded) for p in self.params for m, n in p.owners
        ]
        self._unsharded_regs = [
            (m._parameters, n, p.unsharded) for p in self.params for m, n in p.owners
        ]
        self._unsharded = [p.unsharded for p in self.params]
        self._grad_params = [p for p in self.params if p.requires_grad]
        self.register_sharded()

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
        if flat.device != self.device:  # CPU offload: host-to-device first
            flat = flat.to(self.device, non_blocking=True)
        if self.param_dtype != self.orig_dtype:
            flat = flat.to(self.param_dtype)
        self._pending_ag = C.all_gather(flat, self.info.shard_group, self.world)
        self._pending_ag_small = False

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
            self._small.copy_out(output)
        else:
            C.copy_out(output, self.split_sizes, self.copy_dsts)
        del output, pending
        self.sharded_state = Sharded.UNSHARDED
        self.register_unsharded()

    def reshard(self, *, to_small: bool = False) -> None:
        """Free the unsharded params and register the sharded ones. With
        ``to_small`` (reshard_after_forward=int) keep a copy sharded over the
        smaller group for the backward all-gather."""
        if self._pending_ag is not None:  # prefetched but unused
            self._pending_ag.wait()
            self._pending_ag = None
        if self.sharded_state is not Sharded.UNSHARDED:
            return
        if to_small and self._small is not None:
            self._small.keep()
            self.sharded_state = Sharded.SMALL
        else:
            self.sharded_state = Sharded.SHARDED
        _free(self.unsharded_flat)
        self.register_sharded()

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
        if self.reshard_after_backward:
            self.reshard()
        elif self.sharded_state is Sharded.SMALL:
            self.sharded_state = Sharded.SHARDED

    def has_unreduced_grads(self) -> bool:
        return any(p.unsharded.grad is not None for p in self._grad_params)

    def _reduce(self) -> None:
        params = [p for p in self._grad_params if p.unsharded.grad is not None]
        if not params:
            return
        grads = []
        for p in params:
            g = p.unsharded.grad
            p.unsharded.grad = None
            grads.append(g.expand(self.world) if p.is_scalar else g)
        dtype = self.reduce_dtype or self.param_dtype
        packed = C.pack_for_reduce_scatter(grads, self.world, dtype)
        del grads
        op = dist.ReduceOp.AVG
        pending = C.reduce_scatter(packed, self.info.shard_group, op)
        assert self.ctx is not None
        self.ctx.add_reduction(_Reduction(self, params, pending, op))

    def land_grads(self, params: list[FSDPParam], output: torch.Tensor) -> None:
        """Turn a rank's reduce-scatter output into the sharded params' ``.grad``
        (views of ``output``), accumulating into existing gradients."""
        if output.dtype != self.orig_dtype or output.device != self.sharded_flat.device:
            output = output.to(device=self.sharded_flat.device, dtype=self.orig_dtype)
        full = len(params) == len(self._grad_params)
        offset = 0
        base = output.storage_offset()
        acc_dst, acc_src = [], []
        for p in params:
            off = p.offset if full else offset
            offset += p.padded_numel
            local = output.as_strided(p.local_shape, p.local_stride, base + off)
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
        self.backward_done = False


class _Reduction:
    """One group's gradient reduction in flight: reduce-scatter, then (HSDP)
    all-reduce, then the gradients land."""

    __slots__ = ("group", "params", "pending", "op", "all_reduced")

    def __init__(self, group: ParamGroup, params: list[FSDPParam], pending: C.Pending, op):
        self.group = group
        self.params = params
        self.pending = pending
        self.op = op
        g = group
        self.all_reduced = g.info.replicate_group is None or not g.all_reduce_grads

    def advance(self) -> bool:
        """Wait for the current stage and start the next; True once the grads landed."""
        output = self.pending.wait()
        if not self.all_reduced:
            self.all_reduced = True
            rep = self.group.info.replicate_group
            assert rep is not None
            self.pending = C.all_reduce(output, rep, self.op)
            return False
        self.group.land_grads(self.params, output)
        return True


class _SmallShard:
    """A copy of the unsharded params sharded over ``size`` consecutive ranks,
    kept between forward and backward for ``reshard_after_forward=size``.

    Rank ``j`` of the small group keeps block ``j`` of each parameter's padded
    unsharded rows; padded rows are a multiple of the shard world, hence of
    ``size``, so the blocks tile the flat unsharded buffer exactly.
    """

    def __init__(self, group: ParamGroup, size: int) -> None:
        self.group_pg, self.rank = post_forward_group(group.info, size)
        self.size = size
        w = group.world
        un = group.unsharded_flat.data
        _alloc(group.unsharded_flat)
        per = [w // size * p.padded_numel for p in group.params]
        self.split_sizes = per
        self.sources = [
            un.narrow(0, w * p.offset + self.rank * n, n) for p, n in zip(group.params, per)
        ]
        self.dsts = [
            un.narrow(0, w * p.offset, w * p.padded_numel).view(size, n)
            for p, n in zip(group.params, per)
        ]
        if group.sharded_state is not Sharded.UNSHARDED:
            _free(group.unsharded_flat)
        self.numel = sum(per)
        self.flat: torch.Tensor | None = None
        self.dtype = group.param_dtype
        self.device = group.device

    def keep(self) -> None:
        flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        torch.cat(self.sources, out=flat)
        self.flat = flat

    def all_gather(self) -> C.Pending:
        flat, self.flat = self.flat, None
        assert flat is not None
        return C.all_gather(flat, self.group_pg, self.size)

    def copy_out(self, output: torch.Tensor) -> None:
        C.copy_out(output, self.split_sizes, self.dsts)


def _free(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    if storage.nbytes() and t.device.type != "meta":
        storage.resize_(0)


def _alloc(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if storage.nbytes() != nbytes and t.device.type != "meta":
        storage.resize_(nbytes)
