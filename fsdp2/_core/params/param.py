"""One managed parameter: where its shard and its unsharded copy live.

# [Note: flat storage]
# A group keeps ONE flat sharded buffer per rank holding every parameter's
# dim-0 chunk, each padded to ``ceil(dim0 / world)`` rows, back to back. The
# sharded ``nn.Parameter(DTensor)`` of each parameter wraps a view of its
# (unpadded) chunk in that buffer, so the optimizer updates the buffer in place
# and the buffer *is* the all-gather input: no copy-in for fp32 training.
# The all-gather output is rank-major (rank 0's flat buffer, rank 1's, ...);
# one ``split_with_sizes_copy`` moves it into the unsharded buffers, one per
# parameter (``world * padded_chunk`` elements, so one can be freed alone:
# [Note: release] in group.py). Every unsharded parameter is a fixed view
# of its buffer, so its identity never changes: resharding frees the buffers'
# storage (resize to 0) and unsharding reallocates it. Reduce-scatter uses the same geometry in
# reverse: ``_chunk_cat`` packs the unsharded grads rank-major, and each rank's
# output has exactly the sharded buffer's layout, so the new gradients are
# views of it at the sharded parameters' offsets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp2._core.params.extension import Extension, extension_of
from fsdp2._core.params.storage import contiguous_stride as _contiguous_stride
from fsdp2._core.support.compat import GRAD_DTYPE
from fsdp2._core.support.mesh import MeshInfo, SPMDMesh, dp_tp_mesh, mesh_cache


def chunk_rows(dim_size: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """torch.chunk-style split of ``dim_size`` rows over ``world_size`` ranks:
    ``(padded_rows, start, rows)`` for ``rank``. Every rank holds a chunk of
    ``padded_rows = ceil(dim_size / world_size)``; trailing ranks may hold
    fewer real rows (down to zero), the rest is padding no user sees."""
    padded = -(-dim_size // world_size)
    start = min(rank * padded, dim_size)
    return padded, start, max(0, min(padded, dim_size - start))


class FSDPParam:
    """Geometry and the two faces (sharded, unsharded) of one parameter.

    ``offset`` and ``padded_numel`` place the parameter in its group's flat
    sharded buffer (see [Note: flat storage]); the unsharded copy sits at
    the start of its own unsharded buffer.
    """

    __slots__ = (
        "fqn",
        "owners",
        "shape",
        "requires_grad",
        "is_scalar",
        "shard_dim",
        "row_numel",
        "padded_numel",
        "local_shape",
        "local_stride",
        "local_numel",
        "row_start",
        "offset",
        "sharded",
        "unsharded",
        "spec",
        "tp",
        "global_shape",
        "ext",
        "stride",
        "placeholder",
        "grad_policy",
    )

    def __init__(
        self,
        fqn: str,
        owners: list[tuple[nn.Module, str]],
        param: nn.Parameter,
        info: MeshInfo,
        shard_dim: int = 0,
    ) -> None:
        self.fqn = fqn
        self.owners = owners
        # before anything rewrites the parameter ([Note: gradient dtypes] in dtypes.py)
        self.grad_policy = GradPolicy.of(param)
        # [Note: tensor parallel] A parameter that is already a DTensor (e.g.
        # from parallelize_module on a "tp" mesh) is sharded by FSDP through its
        # TP-local tensor: ``shape`` is the local shape that FSDP gathers, the
        # unsharded parameter is a DTensor on the TP mesh, and the sharded one a
        # DTensor on the concatenated (dp..., tp...) mesh.
        self.tp: TPLayout | None = None
        self.global_shape = param.shape
        self.requires_grad = param.requires_grad
        if isinstance(param, DTensor):
            self.tp = TPLayout.of(param, info, fqn)
            param = param._local_tensor  # type: ignore[assignment]
        elif info.spmd is not None:
            raise ValueError(
                f"parameter {fqn} is a plain tensor, but with dp_mesh_dims every parameter must "
                f"be a DTensor on the full mesh {info.spmd.mesh} (Replicate() on the data "
                "parallel dims), e.g. from distribute_tensor / distribute_module"
            )
        if not param.is_contiguous():
            raise NotImplementedError(
                f"parameter {fqn} is not contiguous (shape {tuple(param.shape)}, stride "
                f"{param.stride()}, e.g. channels_last); fsdp2 shards contiguous parameters "
                "only: make it contiguous before fully_shard, e.g. "
                "module.to(memory_format=torch.contiguous_format)"
            )
        self.shape = param.shape
        self.stride = _contiguous_stride(param.shape)  # of the (TP-local) unsharded param
        # Tensor subclasses with torch's all-gather hooks keep their own storage
        # (see [Note: all-gather extensions] in extension.py); others are rejected.
        self.ext: Extension | None = extension_of(param, fqn)
        if self.ext is not None and (param.dim() == 0 or shard_dim != 0):
            raise NotImplementedError(
                f"parameter {fqn} is a tensor subclass with all-gather hooks "
                f"({type(param).__qualname__}); fsdp2 shards those on dim 0 only, and not "
                "0-dim ones: return None from shard_placement_fn for it"
            )
        # 0-dim parameters are replicated (see [Note: scalars] in group.py).
        self.is_scalar = param.dim() == 0
        self.shard_dim = shard_dim
        if self.is_scalar:
            self.row_numel, padded, start, rows = 1, 1, 0, 1
            self.local_shape: tuple[int, ...] = ()
        elif shard_dim != 0:  # even split only (checked by fully_shard)
            # [Note: other shard dims] a Shard(d) parameter's local chunk is
            # contiguous in the flat buffer like any other; only the copy-out
            # and the gradient packing permute, see ParamGroup.
            chunk = param.shape[shard_dim] // info.shard_size
            self.local_shape = (*param.shape[:shard_dim], chunk, *param.shape[shard_dim + 1 :])
            self.row_numel, padded = math.prod(self.local_shape), 1
            start, rows = info.shard_rank * chunk, 1
        else:
            self.row_numel = math.prod(param.shape[1:])
            padded, start, rows = chunk_rows(param.shape[0], info.shard_size, info.shard_rank)
            self.local_shape = (rows, *param.shape[1:])
        self.padded_numel = padded * self.row_numel
        self.row_start = start
        self.local_numel = rows * self.row_numel
        self.local_stride = torch.empty(self.local_shape, device="meta").stride()
        self.offset = -1
        # The sharded parameter: a DTensor flagged as an nn.Parameter (``_dtensor_param``);
        # the original parameter until the group builds it.
        self.sharded: DTensor = param  # type: ignore[assignment]
        # A plain nn.Parameter, or (TP) an nn.Parameter DTensor on the TP mesh; None for
        # an extension parameter before its first all-gather.
        self.unsharded: torch.Tensor | None = param
        self.spec: DTensorSpec | None = None
        self.placeholder: torch.Tensor | None = None  # see grad_dtensor

    def local_chunk(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's unpadded chunk of ``full``."""
        if self.is_scalar:
            return full
        d = self.shard_dim
        return full.narrow(d, self.row_start, self.local_shape[d])

    def split_view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (full shape) as ``(world, *local_shape)``: chunk ``r`` along the
        shard dim at index ``r`` (a view for ``Shard(d)``, d > 0)."""
        d = self.shard_dim
        shape = self.shape
        world = shape[d] // self.local_shape[d]
        return t.view(*shape[:d], world, self.local_shape[d], *shape[d + 1 :]).movedim(d, 0)

    def local_view(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's local chunk inside a rank's flat (sharded-layout) buffer."""
        return flat.as_strided(
            self.local_shape, self.local_stride, flat.storage_offset() + self.offset
        )

    def make_sharded(self, flat: torch.Tensor, info: MeshInfo) -> DTensor:
        local = self.local_view(flat)
        placements = info.placements(None if self.is_scalar else self.shard_dim)
        mesh = info.mesh
        if self.tp is not None:
            mesh, placements = self.tp.sharded_layout(info, placements, self.shard_dim)
        spec = _spec(mesh, tuple(placements), self.global_shape, local.dtype)
        self.placeholder = mesh_cache(mesh).placeholder(local)
        self.sharded = _dtensor_param(local, spec, self.requires_grad, self.placeholder)
        self.spec = self.sharded._spec  # reused for every gradient: see land_grads
        return self.sharded

    def make_sharded_ext(
        self, t: torch.Tensor, info: MeshInfo, device: torch.device, pin: bool
    ) -> DTensor:
        """The sharded parameter of an extension parameter: a DTensor around this
        rank's chunk of ``t`` as a tensor of ``t``'s own subclass, in its own storage
        (built with the ops such subclasses implement for torch's FSDP2)."""
        full = t.detach()
        rows = self.local_shape[0]
        padded_shape = (-(-self.shape[0] // info.shard_size), *self.local_shape[1:])
        # chunk, new_zeros, narrow and copy_: the ops torch's FSDP2 uses, so the ones
        # these subclasses implement (NF4 slices only whole dims, e.g.).
        local = full.new_zeros(padded_shape)
        if self.local_numel:
            chunk = torch.chunk(full, info.shard_size)[info.shard_rank]
            local.narrow(0, 0, rows).copy_(chunk)
        if rows != padded_shape[0]:
            local = local.narrow(0, 0, rows)
        if not local.is_meta and local.device != device:
            local = local.to(device)
        if pin and not local.is_meta:
            local = local.pin_memory()
        placements = info.placements(0)
        mesh = info.mesh
        if self.tp is not None:
            mesh, placements = self.tp.sharded_layout(info, placements, 0)
        spec = _spec(mesh, tuple(placements), self.global_shape, local.dtype)
        self.placeholder = mesh_cache(mesh).placeholder(local)
        self.sharded = _dtensor_param(local, spec, self.requires_grad, self.placeholder)
        self.spec = self.sharded._spec
        return self.sharded

    def wrap_unsharded(self, view: torch.Tensor) -> torch.Tensor:
        """The tensor the unsharded parameter wraps: ``view`` itself, or for TP
        parameters a DTensor on the TP mesh around it."""
        if self.tp is None:
            return view
        return DTensor.from_local(
            view,
            self.tp.mesh,
            self.tp.placements,
            run_check=False,
            shape=self.global_shape,
            stride=_contiguous_stride(self.global_shape),
        )

    def grad_dtensor(self, local: torch.Tensor) -> DTensor:
        """A gradient for the sharded parameter, wrapping ``local`` (no checks, no copy)."""
        assert self.spec is not None, "grad_dtensor before the sharded parameter exists"
        spec = self.spec
        meta = spec.tensor_meta
        if meta is not None and meta.dtype != local.dtype:  # a grad_dtype of its own
            spec = _spec(spec.mesh, spec.placements, meta.shape, local.dtype)
        placeholder = self.placeholder  # from fully_shard: may be on meta since
        if placeholder is None or (placeholder.dtype, placeholder.device) != (
            local.dtype,
            local.device,
        ):
            placeholder = torch.empty(0, dtype=local.dtype, device=local.device)
            self.placeholder = placeholder
        return _wrap(local, spec, False, placeholder)

    @property
    def has_grad_hooks(self) -> bool:
        """Whether the sharded parameter has post-accumulate-grad hooks."""
        return bool(self.sharded._post_accumulate_grad_hooks)

    def run_grad_hooks(self) -> None:
        """Call the sharded parameter's post-accumulate-grad hooks with it, in the order
        they were registered: its reduced gradient has just landed on ``.grad``
        ([Note: post-accumulate-grad hooks])."""
        hooks = self.sharded._post_accumulate_grad_hooks
        for hook in tuple(hooks.values()) if hooks else ():
            hook(self.sharded)


# [Note: post-accumulate-grad hooks]
# Backward runs on the unsharded parameters, so autograd never accumulates a gradient into a
# sharded one and never calls the hooks users register on it with
# ``register_post_accumulate_grad_hook`` (optimizer-in-backward: torchtune's
# ``register_optim_in_bwd_hooks``; per-parameter clipping or logging). As torch's FSDP2
# (``foreach_reduce``), fsdp2 calls them itself, with the sharded parameter, each time a
# reduced gradient lands on its ``.grad`` (assigned, or added to the one there): parameter by
# parameter in the group's order, each right after its own gradient landed (``land_local_grads``
# here; ``land_pieces`` in piece_grad.py, where under replica sharding the hook sees the
# ``PieceGrad``: [Note: pieces as .grad]). So they run where the gradients land, when the
# reduction finishes: without gradient sync (``set_requires_gradient_sync(False)``) or, for
# HSDP, without the all-reduce nothing lands and no hook runs, until the reduction of a later
# synced backward (or ``synchronize_gradients``) lands the sum and runs them once. With CPU
# offload the device-to-host copy of a group with such a hook is synchronous, as torch's, so
# a hook never reads pinned memory still being written (``reduce.land_grads``).


def land_local_grads(params: Sequence[FSDPParam], locals_: Sequence[torch.Tensor]) -> None:
    """Land ``locals_`` (a rank's reduced local gradients of ``params``, in their gradient
    dtype, on their device) on the sharded parameters: each the ``.grad`` (``grad_dtensor``,
    no copy) or added to the one there, then that parameter's post-accumulate-grad hooks run
    ([Note: post-accumulate-grad hooks])."""
    hooked = any(p.has_grad_hooks for p in params)
    acc_dst, acc_src = [], []
    for p, local in zip(params, locals_, strict=True):
        g = p.sharded.grad
        if g is None:
            p.sharded.grad = p.grad_dtensor(local)
        else:
            assert isinstance(g, DTensor)
            if hooked:  # a hook may read it next: add now
                g._local_tensor.add_(local)
            else:
                acc_dst.append(g._local_tensor)
                acc_src.append(local)
        if hooked:
            p.run_grad_hooks()
    if acc_dst:
        torch._foreach_add_(acc_dst, acc_src)


class GradPolicy:
    """A parameter's ``Tensor.grad_dtype`` policy as ``fully_shard`` found it ([Note: gradient
    dtypes] in dtypes.py): ``explicit`` (set by the user: ``dtype``, ``None`` for any dtype)
    or the default (the gradient follows the parameter's dtype)."""

    __slots__ = ("explicit", "dtype", "pinned")

    def __init__(self, explicit: bool, dtype: torch.dtype | None) -> None:
        self.explicit = explicit
        self.dtype = dtype
        # a default whose tensor fsdp2 had to give ``grad_dtype = dtype`` (torch has no way
        # back to "default"): torch then reports an override fsdp2 made itself
        self.pinned = False

    @classmethod
    def of(cls, t: torch.Tensor) -> GradPolicy:
        if not GRAD_DTYPE or not t.dtype.is_floating_point or not explicit_override(t):
            return cls(False, None)
        return cls(True, t.grad_dtype)


def explicit_override(t: torch.Tensor) -> bool:
    """Whether ``t.grad_dtype`` was set explicitly (torch main's
    ``Tensor._has_grad_dtype_override``). torch 2.13 and 2.14 have no such flag: a value
    other than ``t.dtype`` is explicit; for an equal one ``t`` is given data of another dtype
    for a moment (``.data =``, no copy): a default follows it, an explicit one stays."""
    flag = getattr(t, "_has_grad_dtype_override", None)
    if flag is not None:
        return bool(flag)
    if t.grad_dtype != t.dtype:
        return True
    other = torch.float64 if t.dtype != torch.float64 else torch.float32
    data = t.data
    try:
        t.data = _stand_in(t, other)
    except Exception:  # noqa: BLE001 - a subclass that takes no other data: the value alone
        return False
    try:
        follows = t.grad_dtype == other
    finally:
        t.data = data
    return not follows


def _stand_in(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor of ``t``'s kind (plain or DTensor) in ``dtype``, for
    ``explicit_override`` (a DTensor's is built without a dispatch)."""
    if not isinstance(t, DTensor):
        return torch.empty(0, dtype=dtype, device=t.device)
    spec = _spec(t._spec.mesh, t._spec.placements, torch.Size((0,)), dtype)
    local = torch.empty(0, dtype=dtype, device=t._local_tensor.device)
    return DTensor(local, spec, requires_grad=False)


def _spec(
    mesh: DeviceMesh, placements: tuple[Placement, ...], shape: torch.Size, dtype: torch.dtype
) -> DTensorSpec:
    """A DTensor spec, shared by every parameter of the same layout on ``mesh``
    (building one per parameter dominates ``fully_shard``'s time otherwise)."""
    cache = mesh_cache(mesh).specs
    key = (placements, tuple(shape), dtype)
    spec = cache.get(key)
    if spec is None:
        meta = TensorMeta(shape, _contiguous_stride(shape), dtype)
        spec = cache[key] = DTensorSpec(mesh, placements, tensor_meta=meta)
    return spec


def _wrap(
    local: torch.Tensor,
    spec: DTensorSpec,
    requires_grad: bool,
    placeholder: torch.Tensor | None = None,
) -> DTensor:
    """``DTensor(local, spec)`` whose wrapper has storage offset 0.

    torch 2.13 gives the wrapper ``local``'s storage offset; ours are views into a flat
    buffer, and a wrapper with a non-zero offset pickles (``torch.save``, ``copy.deepcopy``)
    as a plain tensor through its invalid storage and fails. So the wrapper is built around
    an empty zero-offset ``placeholder`` of the same dtype and device (a new one unless
    given), then given ``local``.
    """
    if placeholder is None:
        placeholder = torch.empty(0, dtype=local.dtype, device=local.device)
    dt = DTensor(placeholder, spec, requires_grad=requires_grad)
    dt._local_tensor = local
    return dt


def _dtensor_param(
    local: torch.Tensor,
    spec: DTensorSpec,
    requires_grad: bool,
    placeholder: torch.Tensor | None = None,
) -> DTensor:
    """``nn.Parameter(DTensor.from_local(local, ...))`` without the autograd
    round trip and detach: for tensor subclasses ``nn.Parameter`` is the tensor
    itself flagged ``_is_param``."""
    dt = _wrap(local, spec, requires_grad, placeholder)
    dt._is_param = True  # what nn.Parameter.__new__ does for tensor subclasses
    return dt


class TPLayout:
    """Where a DTensor parameter lives before FSDP: its mesh and placements
    (see [Note: tensor parallel]). With ``dp_mesh_dims`` (``spmd`` set) the mesh
    is the full mesh and the placements are ``Replicate()`` on its data-parallel
    dims (see [Note: dp_mesh_dims] in mesh.py)."""

    __slots__ = ("mesh", "placements", "spmd")

    def __init__(
        self, mesh: DeviceMesh, placements: tuple[Placement, ...], spmd: SPMDMesh | None = None
    ) -> None:
        self.mesh = mesh
        self.placements = placements
        self.spmd = spmd

    @classmethod
    def of(cls, param: DTensor, info: MeshInfo, fqn: str) -> TPLayout:
        if info.spmd is not None:
            return cls._of_spmd(param, info.spmd, fqn)
        dp_tp_mesh(info.mesh, param, fqn)  # composes, not Partial (else ValueError)
        return cls(param.device_mesh, tuple(param.placements))

    @classmethod
    def _of_spmd(cls, param: DTensor, spmd: SPMDMesh, fqn: str) -> TPLayout:
        if param.device_mesh != spmd.mesh:
            raise ValueError(
                f"parameter {fqn} is a DTensor on mesh {param.device_mesh}, but with "
                f"dp_mesh_dims every parameter must be a DTensor on the mesh passed to "
                f"fully_shard, {spmd.mesh}"
            )
        placements = tuple(param.placements)
        names = spmd.mesh.mesh_dim_names
        assert names is not None
        for i in sorted(spmd.dp_dims):
            if not placements[i].is_replicate():
                raise ValueError(
                    f"parameter {fqn} has placement {placements[i]} on data-parallel mesh dim "
                    f"'{names[i]}' (placements {placements}); with dp_mesh_dims parameters "
                    "must be Replicate() on every data-parallel dim"
                )
        if any(p.is_partial() for p in placements):
            raise ValueError(f"parameter {fqn} has Partial placements {placements}")
        return cls(spmd.mesh, placements, spmd)

    def sharded_layout(
        self, info: MeshInfo, dp_placements: tuple[Placement, ...], shard_dim: int
    ) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        """The concatenated mesh and placements of the FSDP-sharded parameter.
        When TP also shards ``shard_dim``, FSDP's shard of the TP-local tensor is
        a strided shard of the global one."""
        if self.spmd is not None:
            return self.spmd.sharded_layout(self.placements, dp_placements, shard_dim)
        mesh = DeviceMesh._concatenate([info.mesh, self.mesh])
        split = 1
        for placement, size in zip(self.placements, self.mesh.shape, strict=True):
            if isinstance(placement, Shard) and placement.dim == shard_dim:
                split *= size
        inner = dp_placements[-1]
        if split > 1 and isinstance(inner, Shard):
            inner = _StridedShard(shard_dim, split_factor=split)
        return mesh, (*dp_placements[:-1], inner, *self.placements)

    def to_local_grad(self, grad: torch.Tensor, reduce_dtype: torch.dtype | None) -> torch.Tensor:
        """The TP-local gradient, redistributed to the parameter's placements
        first if autograd left it otherwise (e.g. Partial): in ``reduce_dtype`` if given,
        so a ``Partial`` gradient's all-reduce over the TP mesh sums in the policy's
        reduction dtype as the reduce-scatter does (pytorch issue 190626)."""
        if isinstance(grad, DTensor):
            if reduce_dtype is not None and grad.dtype != reduce_dtype:
                if any(pl.is_partial() for pl in grad.placements):
                    cast_grad = grad.to(reduce_dtype)
                    assert isinstance(cast_grad, DTensor)
                    grad = cast_grad
            want = self.placements
            if self.spmd is not None:
                # Data-parallel dims are FSDP's to reduce: keep the local values there.
                dp = self.spmd.dp_dims
                want = tuple(
                    g if i in dp else p
                    for i, (g, p) in enumerate(zip(grad.placements, want, strict=True))
                )
            if tuple(grad.placements) != want:
                grad = grad.redistribute(self.mesh, want)
            return grad._local_tensor
        return grad
