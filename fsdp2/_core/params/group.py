"""One parameter group: the params of one ``fully_shard`` call, gathered and
reduced together. Owns unshard / wait / reshard over its storage (``GroupLayout``,
layout.py) and the settings that drive them; its gradients are taken and reduced from
above (reduce.py, driven by the step layer).

# [Note: scalars]
# torch's FSDP2 rejects 0-dim parameters; we replicate them instead. In the flat
# layout a scalar takes one element per rank (its own copy), the all-gather
# brings every rank's copy and the unsharded parameter views the first; for
# reduction its gradient is written into every rank's slot, so the
# reduce-scatter sums it over ranks like an all-reduce. Each rank's slot is summed in
# its own order, so the sums may differ by a rounding: before landing, every rank takes
# shard rank 0's (``_agree_on_scalars`` in reduce.py: one small all-reduce per reduction
# of a group with 0-dim gradients, rank 0 adding its values and the others zeros, exact).
# Its DTensor placement is ``Replicate()`` and each rank holds the same averaged gradient,
# bit for bit.

# [Note: release]
# The root's group stays unsharded from forward through backward (so does any group with
# reshard_after_forward=False), but its backward may not read every parameter: an
# embedding's backward needs the indices only. So when backward begins (the graph is
# complete), each group still unsharded frees the unsharded buffer (each flat parameter has
# its own) of every trainable parameter that nothing holds but its Python object and its
# gradient accumulator: no autograd node saved it, no view or alias of its storage is
# alive (``Tensor._use_count`` and the storage's use count against what the group itself
# holds, measured when the buffers were built), and no Python object refers to it but the
# group's (``sys.getrefcount``, ``GroupLayout.only_ours``): saved-tensor hooks (activation
# offloading: torch hands the pack hook the parameter itself, an identity hook keeps it)
# and a ``ctx.w = w`` hold the Python object, which no use count sees; freed, it crashed
# the backward that read it. AccumulateGrad only writes ``.grad``, so
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

# [Note: stale unsharded]
# A group may stay unsharded across an optimizer step: the root after a forward whose
# backward never ran (an evaluation with grad on), after ``unshard()``, with
# ``set_reshard_after_backward(False)``. Its unsharded copy then holds the values before the
# step, and a forward that used it would train on stale weights, silently. So the group
# remembers a sum of version counters when it issues its all-gather (``_sharded_version``:
# the flat buffer's, which ops on ``to_local()`` bump, and each sharded DTensor's own, which
# ops on the DTensor bump: DTensor runs its local ops below autograd, where the local
# tensor's counter does not move), and a forward that starts while it is unsharded with a
# different sum reshards it first, so the forward gathers the new values (``stale``). The
# same values cost nothing: ``unshard()`` as a prefetch before the next forward, no-sync
# micro-steps with ``set_reshard_after_backward(False)``. Not seen: writes that bypass
# version counters (``p.data.copy_()``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._compile import _disable_dynamo

from fsdp2._core.comm.collectives import DividePlan, Into, all_gather, divide_plan
from fsdp2._core.comm.gloo import Received, is_gloo
from fsdp2._core.comm.transport import Pending, copy_out
from fsdp2._core.params.layout import GroupLayout
from fsdp2._core.params.param import FSDPParam
from fsdp2._core.params.small_shard import SmallShard
from fsdp2._core.params.storage import alloc_storage as _alloc
from fsdp2._core.params.storage import free_storage as _free
from fsdp2._core.support.labels import label
from fsdp2._core.support.mesh import MeshInfo
from fsdp2._core.support.settings import GatherSettings, ReduceSettings
from fsdp2._core.support.unsharded import track
from fsdp2.api import MixedPrecisionPolicy, OffloadPolicy

__all__ = ["ParamGroup", "Sharded"]


class Sharded(enum.Enum):
    SHARDED = enum.auto()  # sharded DTensors registered; unsharded storage freed
    UNSHARDED = enum.auto()  # unsharded params registered and valid
    SMALL = enum.auto()  # like SHARDED, plus a copy sharded over a smaller group
    # (reshard_after_forward=int) that the backward all-gather reads


class ParamGroup(GroupLayout):
    """The params of one ``fully_shard`` call and their collectives: unshard / wait /
    reshard over the storage of ``GroupLayout`` (layout.py), and the settings that drive
    them. Gradients are taken and reduced by reduce.py, from above.

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
        mesh_tag: str = "",
    ) -> None:
        # " (mesh efsdp)" when its fully_shard call has several groups: ends ``name``
        # and ``path``, so that messages and timeline lanes tell the groups apart
        self.mesh_tag = mesh_tag
        self.gather = GatherSettings(post_forward=reshard_after_forward)
        self.reduce = ReduceSettings()
        self.sharded_state = Sharded.SHARDED
        self._pending_ag: Pending | Received | None = None
        self._pending_ag_small = False
        self._gathered_at = 0  # _sharded_version() when the last all-gather was issued
        self.small: SmallShard | None = None  # reshard_after_forward=int, see update()
        self._restore_hooks: list[Any] = []  # see release_unread
        super().__init__(params, info, mp_policy, offload_policy, name)
        for p in self.ext_params:  # its answer checked (a bool) before any collective
            assert p.ext is not None
            if p.ext.releases(p.sharded._local_tensor):
                if not isinstance(reshard_after_forward, bool):
                    raise NotImplementedError(
                        f"{p.fqn}: its tensor subclass releases the all-gather outputs after "
                        "fsdp_post_all_gather, but reshard_after_forward="
                        f"{reshard_after_forward} builds its smaller copy from them; use "
                        "reshard_after_forward=True or False for this module"
                    )
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
            self.small = SmallShard(self.info, k)
        self.divide_plan = self._plan()

    def _plan(self) -> DividePlan:
        replicate = self.info.replicate_size if self.info.replicate_group is not None else 1
        dtype = self.mp_policy.reduce_dtype or self.grads_dtype or self.param_dtype
        r = self.reduce
        if r.exact:  # summed, then divided once at landing (see reduce.Reduction)
            return DividePlan(None, None, dist.ReduceOp.SUM, dist.ReduceOp.SUM)
        return divide_plan(self.world, replicate, dtype, r.divide_factor, r.force_sum)

    def retype(self, orig_dtype: torch.dtype) -> None:
        """The parameters' dtype changed (``module.to(dtype)``): derive the rest again."""
        self.set_dtypes(orig_dtype)
        self.divide_plan = self._plan()

    # ---- unshard / reshard -------------------------------------------------------

    def unshard(self) -> None:
        """Issue this group's all-gather if its params are not unsharded or coming.
        Returns at once; ``wait_for_unshard`` makes the params usable."""
        if self.sharded_state is Sharded.UNSHARDED or self._pending_ag is not None:
            return
        if self.ext_params:
            self.take_views()  # see [Note: unsharded views] in views.py
        if self.no_gather():  # the unsharded parameters view sharded storage: nothing to do
            self._pending_ag = _ALIASED
            return
        if self.sharded_state is Sharded.SMALL:
            small = self.small
            assert small is not None
            [self._pending_ag] = all_gather([small.take()], small.group_pg, small.size, self.path)
            self._pending_ag_small = True
            return
        into = None
        if self.world > 1 and not self.ext_params and not self._dim_copies:
            # may land in the rows (gloo; never asked elsewhere: world x parameters views)
            if self.gather.comm is None and is_gloo(self.info.shard_group, self.device):
                into = Into(self.split_sizes, self.row_dsts, self._alloc_unsharded)
        [pending] = all_gather(
            self._gather_inputs,
            self.info.shard_group,
            self.world,
            self.path,
            comm=self.gather.comm,
            into=into,
        )
        self.gather_issued(pending)

    def _alloc_unsharded(self) -> None:
        for b in self.unsharded_bufs:
            _alloc(b, self.path)

    def _gather_inputs(self) -> list[torch.Tensor]:
        flat = self.gather_input()
        return [self.pack_ext_inputs(flat) if self.ext_params else flat]

    def gather_input(self) -> torch.Tensor:
        """This rank's flat all-gather input (plain parameters)."""
        if self.parked and not self.residence.at_rest:  # back to the device to be gathered
            self.move_state(parked=False)  # see [Note: offload by phase] in residence.py
        flat = self.sharded_flat
        if flat.numel() and (flat.device != self.device or self.param_dtype != flat.dtype):
            # CPU offload (host-to-device) and/or param_dtype cast, in one op
            flat = flat.to(self.device, self.param_dtype, non_blocking=True)
        return flat

    def gather_issued(self, pending: Pending | Received) -> None:
        """This group's all-gather (alone, or its slice of a bucket's) is in flight."""
        self._pending_ag = pending
        self._pending_ag_small = False
        self._gathered_at = self._sharded_version()

    def _sharded_version(self) -> int:
        """A sum of version counters that grows with every in-place write to a sharded
        parameter (an optimizer step, ``copy_``, ``load_state_dict``): the DTensors' own
        (an op on a DTensor bumps the wrapper's counter, not its local tensor's) and the
        local storage's (ops on ``to_local()``, e.g. ``fsdp2.optim``)."""
        v: int = self.sharded_flat._version + self.flat_version_offset
        v += sum(t._version for t in self.sharded_params)
        for p in self.ext_params:
            v += p.sharded._local_tensor._version
        return v

    def stale(self) -> bool:
        """Whether the group is unsharded with values older than its sharded parameters
        (an optimizer step since its all-gather: [Note: stale unsharded])."""
        return (
            self.sharded_state is Sharded.UNSHARDED
            and not self.no_gather()  # views of the sharded values: never stale
            and self._sharded_version() != self._gathered_at
        )

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
            or self.aliased
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
        if pending is _ALIASED:
            self.sharded_state = Sharded.UNSHARDED
            self.register_unsharded()
            return
        if isinstance(pending, Received):  # landed in the buffers (allocated at issue)
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
                _alloc(b, self.path)
            if by_rows:
                for row, dsts in zip(rows, self.row_dsts, strict=True):
                    copy_out(row, self.split_sizes, dsts)
            elif self._pending_ag_small:
                assert self.small is not None
                for p in self.ext_params:
                    p.ext.alloc(self.path)  # type: ignore[union-attr]
                self.small.copy_out(rows[0])
                self.small.release(self.path)
            elif self.ext_params:
                self.copy_out_ext(rows[0])
            else:
                self.copy_out_plain(rows[0])
        del rows, pending
        if self.ext_params:
            self._build_ext_unsharded()
        self.sharded_state = Sharded.UNSHARDED
        self.register_unsharded()

    def _build_ext_unsharded(self) -> None:
        created = False
        for p in self.gathered:
            assert p.ext is not None
            created |= p.ext.build(p, self.param_dtype, self.path)
        if created:
            self.refresh_registrations()

    def reshard(self, *, to_small: bool = False) -> None:
        """Free the unsharded params and register the sharded ones. With
        ``to_small`` (reshard_after_forward=int) keep a copy sharded over the
        smaller group for the backward all-gather."""
        with label("reshard", self.path):
            self._reshard(to_small)

    def _reshard(self, to_small: bool) -> None:
        if self._pending_ag is not None:  # prefetched but unused
            pending, self._pending_ag = self._pending_ag, None
            if isinstance(pending, Received):
                pending.wait_works()  # the receives write into the buffers: then free them
                self._free_unsharded()
            else:
                pending.wait()
        if self.sharded_state is Sharded.SMALL and not to_small:
            # The small copy holds this step's values; never gather it next step.
            self.drop_small()
            return
        if self.sharded_state is not Sharded.UNSHARDED:
            return
        faces = None
        if to_small and self.small is not None:
            self.small.keep(self.unsharded_segments(), bool(self.ext_params), self.path)
            built = self.small.faces is None
            faces = self.small.fill_faces(self.flat_params, self.path)
            if built:
                track(self)  # the optimizer check knows the faces
            self.sharded_state = Sharded.SMALL
        else:
            self.sharded_state = Sharded.SHARDED
        self._free_unsharded()
        self.released = []
        self._drop_restore_hooks()
        for p in self.ext_params:
            p.ext.free(self.path)  # type: ignore[union-attr]
        self.register_sharded()
        if faces is not None:  # see [Note: the parameters between forward and backward]
            for p, face in zip(self.flat_params, faces, strict=True):
                if face is not None:
                    for m, n in p.owners:
                        m._parameters[n] = face  # type: ignore[assignment]  # a Parameter

    def _free_unsharded(self) -> None:
        """Free the unsharded buffers, unless ``set_keep_unsharded_storage(True)`` keeps them
        (their data pointers then stay the same from one unshard to the next)."""
        if not self.gather.keep_storage:
            for b in self.unsharded_bufs:
                _free(b, self.path)

    def drop_small(self) -> None:
        """Forget the ``reshard_after_forward=int`` copy (its step is over) and register
        the sharded parameters."""
        if self.small is not None:  # None if reshard_after_forward changed meanwhile
            self.small.release(self.path)
        self.sharded_state = Sharded.SHARDED
        self.register_sharded()

    def after_forward(self) -> None:
        """Reshard per ``reshard_after_forward`` at the end of a forward; with grad enabled,
        park the sharded state for the backward ([Note: offload by phase] in residence.py)."""
        if self.gather.post_forward is True:
            self.reshard()
        elif self.gather.post_forward is not False:
            self.reshard(to_small=True)
        if torch.is_grad_enabled():
            self.move_state(parked=True)

    # ---- what backward does not read (see [Note: release]) ----------------------

    def release_unread(self) -> None:
        """Free the unsharded buffer of every plain trainable parameter nothing in the
        autograd graph holds (it was used, but no node saved it: an embedding's weight).
        It is registered sharded until the group reshards, or gathered again if a module
        owning it runs forward meanwhile (an activation-checkpoint recompute): see
        [Note: release]."""
        if self.ext_params or self.aliased or self.sharded_state is not Sharded.UNSHARDED:
            return
        if not self.gather.reshard_after_backward or self.released or self.gather.keep_storage:
            return
        owned: dict[int, tuple[nn.Module, list[int]]] = {}
        for i, p in enumerate(self.flat_params):
            if not p.requires_grad or p.tp is not None or p.is_scalar or p.shard_dim != 0:
                continue
            if not self.only_ours(i):
                continue
            _free(self.unsharded_bufs[i], self.path)
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
        [pending] = all_gather(
            lambda: [self.gather_input()],
            self.info.shard_group,
            self.world,
            self.path,
            comm=self.gather.comm,
        )
        assert isinstance(pending, Pending)
        with label("all_gather wait", self.path):
            output = pending.wait()
        with label("copy_out", self.path):
            cols = output.split(self.split_sizes, dim=1)
            for i in idx:
                _alloc(self.unsharded_bufs[i], self.path)
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

    def after_backward(self) -> None:
        """Its gradients were taken: the sharded state back at rest (before they land),
        reshard per ``reshard_after_backward``."""
        self.move_state(parked=False)
        if self.gather.reshard_after_backward:
            self.reshard()
        elif self.sharded_state is Sharded.SMALL:
            self.drop_small()

    def drop_unsharded_grads(self) -> None:
        """Drop the unsharded parameters' gradients (recovery: ``reset_iter_state``)."""
        for p in self.grad_params:
            if p.unsharded is not None:
                p.unsharded.grad = None


# an aliased group's "all-gather" (see ``unshard``): nothing to wait for
_ALIASED = Pending(torch.empty(0), None)


def _restore_hook(group: ParamGroup, idx: list[int]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        group.restore_released(idx)

    # run eagerly (a collective and storage moves), as every engine hook
    return cast(Callable[..., None], _disable_dynamo(hook))
