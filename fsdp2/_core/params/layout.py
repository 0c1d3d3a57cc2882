"""A group's storage: the flat sharded buffer, the unsharded buffers and parameters, and
what module registrations point at ([Note: flat storage] in param.py). ``GroupLayout`` is the
base of the group (group.py), which gathers into it and frees it; relayout.py lays it out
again when parameters change under it.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp2._core.comm.gloo import is_gloo
from fsdp2._core.comm.transport import copy_out
from fsdp2._core.params.dtypes import apply_policy, group_dtype, install, promoted
from fsdp2._core.params.extension import ALIGN, VIEW, Extension
from fsdp2._core.params.faces import sync_requires_grad
from fsdp2._core.params.param import FSDPParam
from fsdp2._core.params.residence import Residence, move_sharded, point_at
from fsdp2._core.params.storage import free_storage as _free
from fsdp2._core.params.views import blocker, check_view_only, take_views
from fsdp2._core.support.labels import label
from fsdp2._core.support.mesh import MeshInfo, shard_mesh
from fsdp2._core.support.unsharded import track
from fsdp2.api import MixedPrecisionPolicy, OffloadPolicy

__all__ = ["GroupLayout", "group_dtype"]


class GroupLayout:
    """The storage of one group's parameters (see the module docstring)."""

    _row_dsts: list[list[torch.Tensor]] | None

    def __init__(
        self,
        params: list[FSDPParam],
        info: MeshInfo,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
        name: str,
    ) -> None:
        self.params = params
        self.info = info
        self.name = name
        self.path = name  # its module's path under the root, set at lazy init (for messages)
        self.mp_policy = mp_policy
        self.offload_policy = offload_policy
        self.residence = Residence(offload_policy)  # see [Note: offload by phase]
        self.parked = False  # the sharded state is where the forward left it, not at rest
        self.flat_version_offset = 0  # keeps the flat's version counting across moves
        self.device = info.device
        self.world = info.shard_size
        apply_policy(params, mp_policy, name)  # see [Note: gradient dtypes] in dtypes.py
        self.set_dtypes(group_dtype(params, name))
        # parameters frozen (requires_grad_(False)) since the group's last reduction: they
        # may hold gradients accumulated without sync, reduced with the next ones
        self.draining: list[FSDPParam] = []
        # some modules of the group converted (``_apply``), others not yet: the flat buffer
        # is laid out again once they agree (see [Note: conversion across modules])
        self.resync_pending = False
        self._init_storage()

    def set_dtypes(self, orig_dtype: torch.dtype) -> None:
        """The parameters' dtype is ``orig_dtype`` (at init, or after ``module.to(dtype)``)."""
        self.orig_dtype = orig_dtype
        self.param_dtype = self.mp_policy.param_dtype or orig_dtype
        reduce_dtype = self.mp_policy.reduce_dtype
        self.reduce_dtype = None if reduce_dtype == self.param_dtype else reduce_dtype

    # ---- init -----------------------------------------------------------------

    def _init_storage(self) -> None:
        # Plain parameters share the flat buffer; extension parameters keep their own
        # storage (see [Note: all-gather extensions] in extension.py), and so do plain
        # parameters of another dtype (see [Note: other dtypes] in dtypes.py).
        check_view_only(self.params, self.world, self.mp_policy, self._offloaded())
        for p in self.params:
            if p.ext is None and p.sharded.dtype != self.orig_dtype:
                if p.is_scalar or p.shard_dim != 0:
                    raise NotImplementedError(
                        f"parameter {p.fqn} ({p.sharded.dtype}) has a dtype other "
                        f"than its group's ({self.orig_dtype}); fsdp2 gathers such parameters "
                        "only when sharded on dim 0 (not 0-dim ones): shard it in its own "
                        "fully_shard call or cast it"
                    )
                p.ext = Extension(p.fqn, None)
        self.split_params()
        self.residence.check([p.fqn for p in self.ext_params], self.name)
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
        pin = self._pin() and self.device.type != "cpu" and flat.device.type == "cpu"
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
        # the extension parameters the next all-gather moves: all but those that use an
        # unsharded view (one shard rank only: take_views)
        self.gathered = self.ext_params

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
        # how many registrations hold each unsharded parameter (see only_ours)
        self._unsharded_reg_counts = Counter(id(t) for _, _, t in self._unsharded_regs)
        self.sharded_params = [p.sharded for p in self.params]
        track(self)  # see [Note: optimizers holding unsharded parameters]
        # trainable, and frozen since the last reduction (see faces.sync_requires_grad)
        self.grad_params = [p for p in self.params if p.requires_grad or p in self.draining]
        self.has_scalars = any(p.is_scalar for p in self.grad_params)  # see reduce.py
        # the gradients' promoted dtype: the reduction's without reduce_dtype; and their
        # dtype policies on new faces (see [Note: gradient dtypes] in dtypes.py)
        self.grads_dtype = promoted(self.grad_params, self.mp_policy, self.name)
        install(self.params, self.mp_policy)

    def drained(self) -> None:
        """The gradients of the parameters frozen since the last reduction were taken."""
        if self.draining:
            self.draining = []
            self.refresh_registrations()

    def shard_mesh(self) -> DeviceMesh:
        """The mesh the shard dim spans (what extension hooks receive)."""
        if self._shard_mesh is None:
            self._shard_mesh = shard_mesh(self.info)
        return self._shard_mesh

    def _pin(self) -> bool:
        """Whether the sharded state rests in pinned host memory (CPU offload)."""
        return self.residence.at_rest and self.residence.pin

    def _new_sharded_flat(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.residence.at_rest and device.type != "meta":
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
        self._holders = [holders(b) for b in self.unsharded_bufs]
        install(self.params, self.mp_policy)  # on the rebuilt unsharded parameters

    def _aliasable(self, device: torch.device) -> bool:
        """Whether the unsharded parameters can be views of the flat sharded buffer: one
        shard rank (each parameter whole in it, unpadded), no cast (mixed precision), no
        move (CPU offload), no extension parameters but ones that may use a view of their
        own (see [Note: replicated groups] in mesh.py, [Note: unsharded views] in
        views.py), and no moves between phases ([Note: offload by phase] in
        residence.py)."""
        flat = self.sharded_flat
        return (
            self.world == 1
            and all(
                hasattr(p.sharded._local_tensor, VIEW)
                and blocker(p, 1, self.mp_policy, self._offloaded()) is None
                for p in self.ext_params
            )
            and flat.dtype == self.param_dtype
            and flat.device == device
            and not self.residence.moves
        )

    def _offloaded(self) -> bool:
        return self.residence.at_rest or self.residence.after_forward

    def take_views(self) -> None:
        """Before an unshard: the extension parameters that can use an unsharded view get
        theirs, ``gathered`` the others ([Note: unsharded views] in views.py)."""
        if self.world == 1 and self.ext_params:
            self.gathered, changed = take_views(
                self.ext_params, self.shard_mesh(), self.device, self.mp_policy, self._offloaded()
            )
            if changed:
                self.refresh_registrations()

    def no_gather(self) -> bool:
        """Whether the group's unsharded parameters are all views of sharded storage (the
        flat buffer's or, per extension parameter, its own): nothing to gather or free."""
        return not self.gathered and (self.aliased or not self.flat_params)

    @property
    def row_dsts(self) -> list[list[torch.Tensor]]:
        """Rank ``r``'s rows of every flat parameter's unsharded buffer, for the gloo
        exchange that lands each rank's shard in place: ``world x parameters`` views, made
        with the buffers for gloo groups only (another backend never asks, and at 512 ranks
        they would cost seconds)."""
        assert self._row_dsts is not None, "row_dsts of a group that is not on gloo"
        return self._row_dsts

    def _build_unsharded(self, device: torch.device) -> None:
        self.aliased = self._aliasable(device)
        if self.aliased:
            self._build_aliased()
            return
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
        self._row_dsts = None  # see row_dsts: made while the buffers have their storage
        if is_gloo(self.info.shard_group, device):
            self._row_dsts = [[d[r] for d in self.copy_dsts] for r in range(w)]
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
            _free(b, self.path)

    def _build_aliased(self) -> None:
        """Unsharded parameters that view the flat sharded buffer (same objects every time):
        nothing to allocate, copy or free. Each is a new ``nn.Parameter`` over the view
        swapped into the old object, so it shares the buffer's version counter: an in-place
        write to the sharded parameters (an optimizer step) between a forward and its
        backward fails in backward as it would on the plain module, never silently."""
        self.unsharded_bufs = []
        self.split_sizes = [p.padded_numel for p in self.flat_params]
        self.copy_dsts = []
        self._row_dsts = []
        self._dim_copies = []
        flat = self.sharded_flat
        for p in self.flat_params:
            numel = 1 if p.is_scalar else p.shape.numel()
            view = flat.detach().narrow(0, p.offset, numel).view(p.shape)
            old = p.unsharded
            if p.tp is not None:
                new = nn.Parameter(p.wrap_unsharded(view), p.requires_grad)
                p.unsharded = new if old is None else _swap(old, new)
                continue
            assert old is not None  # plain flat parameters always have one
            new = nn.Parameter(view, old.requires_grad)
            _forget_fake(old, new)
            try:
                torch.utils.swap_tensors(old, new)
            except RuntimeError:  # e.g. a gradient accumulator holds it: keep its identity
                with torch.no_grad():
                    old.data = view

    def relayout(self, dtype: torch.dtype, device: torch.device) -> None:
        """Lay the flat parameters out again in a new flat buffer of ``dtype`` on
        ``device``, moving their current local tensors into it (parameter objects keep
        their identity), and rebuild the unsharded buffers."""
        parked, self.parked = self.parked, False
        if parked:  # moved for its phase: laid out at rest, the wrappers' device too
            device = self.device
        self._assign_offsets()
        new = self._new_sharded_flat(dtype, device)
        with torch.no_grad():
            for p in self.flat_params:
                view = p.local_view(new)
                if not new.is_meta and p.local_numel:
                    view.copy_(p.sharded._local_tensor)
                if parked:
                    point_at(p.sharded, view)
                p.sharded._local_tensor = view
                p.spec = p.sharded._spec
        self.sharded_flat = new
        self._init_unsharded(torch.device("meta") if new.is_meta else self.device)

    def move_state(self, parked: bool) -> None:
        """Put the sharded parameters and gradients ``parked`` (from a forward with grad to
        the group's backward) or at rest: [Note: offload by phase] in residence.py."""
        r, old = self.residence, self.sharded_flat
        if parked == self.parked or not r.moves or old.is_meta:
            return
        host = r.after_forward if parked else r.at_rest  # to a host rest: the host reads next
        with label("offload to host" if host else "offload to device", self.path):
            self.sharded_flat = move_sharded(
                old, self.flat_params, host, self.device, r.pin, host and not parked
            )
        self.flat_version_offset += old._version - self.sharded_flat._version
        self.parked = parked

    def only_ours(self, i: int) -> bool:
        """Whether nothing but this layout and (if any) its gradient accumulator holds flat
        parameter ``i``'s unsharded buffer and parameter: no view or alias of the storage is
        alive, no autograd node saved the tensor, and no Python object refers to it but
        ``FSDPParam.unsharded`` and the registrations (not a saved-tensor hook's packed
        value, nor a ``ctx`` attribute). See [Note: release] in group.py."""
        p = self.flat_params[i]
        if p.unsharded is None or holders(self.unsharded_bufs[i]) != self._holders[i]:
            return False
        # ``p.unsharded`` read each time, never kept in a local (one more reference)
        before = int(p.unsharded._use_count())  # type: ignore[attr-defined]
        edge = torch.autograd.graph.get_gradient_edge(p.unsharded)  # made now if none
        existed = int(p.unsharded._use_count()) == before  # type: ignore[attr-defined]
        del edge
        if before != 1 + int(existed):  # an autograd node or a view holds the tensor
            return False
        u = id(p.unsharded)
        ours = 1 + self._unsharded_reg_counts[u]
        ours += sum(id(m._parameters.get(n)) == u for m, n in p.owners)
        ours += _CPP_HOLD if before > 1 else 0
        # sys.getrefcount's own references, measured on an object only _PROBE holds
        return sys.getrefcount(p.unsharded) - sys.getrefcount(_PROBE.t) + 1 == ours

    def register_sharded(self) -> None:
        sync_requires_grad(self)  # the registered face may hold a flip: [Note: freezing]
        for d, n, t in self._sharded_regs:
            d[n] = t

    def register_unsharded(self) -> None:
        sync_requires_grad(self)
        for d, n, t in self._unsharded_regs:
            d[n] = t

    # ---- the all-gather's layout -------------------------------------------------

    def pack_ext_inputs(self, flat: torch.Tensor) -> torch.Tensor:
        """One rank's uint8 all-gather input: the plain flat buffer's bytes, then every
        extension parameter's inputs, padded to a multiple of ``ALIGN`` bytes."""
        pieces = [flat.view(torch.uint8)] if flat.numel() and not self.aliased else []
        mesh = self.shard_mesh()
        for p in self.gathered:
            assert p.ext is not None
            pieces.extend(p.ext.inputs(p, self.world, self.device, mesh, self.mp_policy, self.path))
        total = sum(t.numel() for t in pieces)
        if total % ALIGN or not pieces:
            pad = torch.zeros(ALIGN - total % ALIGN, dtype=torch.uint8, device=self.device)
            pieces.append(pad)
        return torch.cat(pieces)

    def copy_out_ext(self, output: torch.Tensor) -> None:
        """Scatter a rank-major uint8 all-gather output (``pack_ext_inputs``' layout) into
        the plain unsharded buffers and the extension outputs."""
        plain = 0 if self.aliased else self.shard_numel * self.param_dtype.itemsize
        if plain:
            self.copy_out_plain(output[:, :plain].view(self.param_dtype))
        sizes: list[int] = []
        dsts: list[torch.Tensor] = []
        for p in self.gathered:
            assert p.ext is not None
            p.ext.alloc(self.path)
            sizes.extend(p.ext.byte_sizes())
            dsts.extend(s.view(torch.uint8) for s in p.ext.segments(self.world))
        if sizes:  # none when every extension parameter uses a view
            out = output[:, plain : plain + sum(sizes)]
            torch.split_with_sizes_copy(out, sizes, dim=1, out=dsts)

    def copy_out_plain(self, output: torch.Tensor) -> None:
        """Scatter the rank-major ``(world, shard_numel)`` all-gather output of the
        flat buffer into the unsharded parameters."""
        if not self._dim_copies:
            copy_out(output, self.split_sizes, self.copy_dsts)
        else:
            self._copy_out_permuted(output)

    def unsharded_segments(self) -> list[torch.Tensor]:
        """Every unsharded byte of the group as ``(world, k)`` rank-major tensors
        (allocated only while unsharded). A plain group's is the same list object until its
        buffers are rebuilt (callers may cache what they derive from it)."""
        if not self.ext_params:
            return self.copy_dsts
        segs = list(self.copy_dsts)
        for p in self.gathered:
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


def holders(t: torch.Tensor) -> int:
    """How many tensors hold ``t``'s storage (its use count)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


class _Probe:
    __slots__ = ("t",)  # read like ``FSDPParam.unsharded`` (a slot)

    def __init__(self) -> None:
        self.t = object()


_PROBE = _Probe()


def _cpp_hold() -> int:
    """The references a tensor's object gains while C++ holds the tensor (its gradient
    accumulator, a view): 1 where C++ keeps the Python object alive (torch 2.13), else 0."""
    with torch.inference_mode(False):  # a view holds its base (not in inference mode)
        t = torch.empty(0)
        alone = sys.getrefcount(t)
        view = t.view(0)
        held = sys.getrefcount(t) - alone
        del view
    return held


_CPP_HOLD = _cpp_hold()


def _forget_fake(*ts: torch.Tensor) -> None:
    """Drop ``ts`` from their fake mode's memo (its weak references fail ``swap_tensors``)."""
    for t in ts:
        if isinstance(t, FakeTensor):
            memo = t.fake_mode.fake_tensor_converter.meta_converter.tensor_memo
            for key in [k for k, v in memo.items() if v is t]:
                del memo[key]


def _swap(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Give ``old`` the contents of ``new`` (the object keeps its identity)."""
    torch.utils.swap_tensors(old, new)
    return old
