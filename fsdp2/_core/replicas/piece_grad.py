"""The ``.grad`` of a parameter whose gradient is held in pieces over HSDP's replicas.

# [Note: pieces as .grad]
# With replica sharding ([Note: pieces] in pieces.py) replica rank ``r`` holds only piece
# ``r`` of each parameter's flattened local gradient. The standard tools read ``.grad``:
# ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` / ``get_total_norm``,
# ``GradScaler`` and ``ShardedGradScaler`` (``unscale_``, the inf checks), the frameworks'
# clipping (accelerate, the HF Trainer, Lightning, torchtitan), norm logging, ``p.grad is None``
# checks, ``zero_grad``. A ``.grad`` left ``None`` would let each of them read nothing and
# go on (a norm of 0, no clipping, an overflow not seen: silently wrong). So the piece is the
# ``.grad``: a ``PieceGrad``, a DTensor whose local tensor IS the piece (no copy, 1/R of the
# shard's gradient) on the parameter's mesh, sharded on every mesh dim (``Shard(0)`` where
# the parameter is replicated: every rank holds different elements). What those tools do
# is exact on it:
# * elementwise ops (``mul_`` by the clip coefficient, ``clamp_``, unscaling, ``zero_``,
#   ``abs``, ``isfinite``, casts, ``zeros_like``...) run on the local pieces: each element of
#   the whole gradient is on exactly one rank;
# * reductions of the whole tensor (``norm``, ``sum``, ``max``, ``_foreach_norm``...) give a
#   DTensor partial over every mesh dim, which DTensor reduces over all of them (one
#   collective, through the mesh's flattened dim that replica sharding creates);
# * ``_amp_foreach_non_finite_check_and_unscale_``: DTensor takes the max of the found-inf
#   flags over every rank of the mesh, so every rank skips the step together.
# Anything that would need the gradient in its real layout (a view or reshape, a reduction
# over some dims, an op with a tensor of another layout, ``redistribute``) raises, naming the
# parameter, instead of computing on a layout DTensor does not know; ``full_tensor()`` and
# ``redistribute()`` all-gather the pieces over the replicas first, so they are exact.
# ``to_local()`` is this rank's piece (flattened). On torch 2.13+ the checks run on the aten
# ops (``__torch_dispatch__``); before, DTensor's C++ dispatch never calls a subclass's, so
# they run on the torch functions that take a PieceGrad (``__torch_function__``, the same
# rules by the functions' aten names; ``compat.DTENSOR_SUBCLASS_DISPATCH``). The tensor
# stays in ``fp.sharded.grad``; ``piece_grad_of(fp)`` reads its local piece. The parameter's
# post-accumulate-grad hooks run with it once it landed ([Note: post-accumulate-grad hooks]
# in param.py), so they see this ``.grad`` too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from fsdp2._core.params.dtypes import landing_dtypes
from fsdp2._core.replicas.pieces import gather_rows, piece_range, whole_rows
from fsdp2._core.support.compat import DTENSOR_SUBCLASS_DISPATCH
from fsdp2._core.support.mesh import mesh_cache

if TYPE_CHECKING:
    from fsdp2._core.params.group import ParamGroup
    from fsdp2._core.params.param import FSDPParam

__all__ = [
    "PieceGrad",
    "flatten_mesh",
    "land_pieces",
    "piece_grad_of",
    "piece_spec",
    "set_piece_grad",
]

aten = torch.ops.aten

# Reductions of the whole tensor: partial over every rank, reduced by DTensor.
_WHOLE_REDUCTIONS = {
    aten.linalg_vector_norm.default,
    aten.norm.Scalar,
    aten.norm.ScalarOpt_dim,
    aten.sum.default,
    aten.max.default,
    aten.min.default,
    aten.amax.default,
    aten.amin.default,
    aten._foreach_norm.Scalar,
    aten._foreach_max.default,
}
# Ops that keep each element where it is (and so the layout), beyond the pointwise ones.
_LOCAL = {
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.zero_.default,
    aten.fill_.Scalar,
    aten.copy_.default,
    aten.empty_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.rand_like.default,
    aten.randn_like.default,
}
_AMP_UNSCALE = aten._amp_foreach_non_finite_check_and_unscale_.default


def _torch_function(cls: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    """``PieceGrad.__torch_function__`` on torch < 2.13 (``_check_function``'s rules, then
    the function on the pieces as DTensors). A function of its own so that a test on a
    newer torch can install it (tests/core/replicas/test_replica_grads.py)."""
    kwargs = kwargs or {}
    owner = _check_function(func, args, kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
    return tree_map(lambda t: _as_piece(t, owner), out)


class PieceGrad(DTensor):
    """The gradient of ``fp`` (an HSDP parameter whose gradient is sharded over the
    replicas by ``fsdp2.replica_optim``): this rank's piece, as a DTensor the standard tools
    read exactly ([Note: pieces as .grad])."""

    _fsdp2_owner: tuple[ParamGroup, FSDPParam]

    @classmethod
    def of(cls, local: torch.Tensor, owner: tuple[ParamGroup, FSDPParam]) -> PieceGrad:
        spec = piece_spec(owner[1], local.dtype)
        out = cls(local, spec, requires_grad=False)
        out._fsdp2_owner = owner
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"PieceGrad(of {_name(self._fsdp2_owner)}, this rank's piece of "
            f"{self._local_tensor.numel()} elements: {self._local_tensor})"
        )

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        owner = _check(func, args, kwargs)
        out = func(*tree_map(_as_dtensor, args), **tree_map(_as_dtensor, kwargs))
        if _mutates_first(func):
            return args[0]
        return tree_map(lambda t: _as_piece(t, owner), out)

    if not DTENSOR_SUBCLASS_DISPATCH:  # torch < 2.13: the ops never reach the method above
        __torch_function__ = classmethod(_torch_function)

    def full_tensor(self, *, grad_placements: Any = None) -> torch.Tensor:
        """The whole gradient, every rank (all-gathers the pieces over the replicas, then
        as ``DTensor.full_tensor``; a collective)."""
        return self.whole().full_tensor()

    def redistribute(self, *args: Any, **kwargs: Any) -> DTensor:
        """``DTensor.redistribute`` from the parameter's layout (the pieces all-gathered
        over the replicas first; a collective)."""
        return self.whole().redistribute(*args, **kwargs)

    def whole(self) -> DTensor:
        """The gradient in the parameter's layout (sharded like the parameter): the pieces
        all-gathered over the replicas (a collective, every rank of the mesh)."""
        group, fp = self._fsdp2_owner
        local = self._local_tensor
        what = f"the gradient of {_name(self._fsdp2_owner)}"
        rows = gather_rows(group, [local], [fp.local_numel], what).wait()
        assert rows is not None
        whole = whole_rows(rows.to(local.device), [fp.local_numel])[0]
        return fp.grad_dtensor(whole.reshape(fp.local_shape).clone())

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError(
            f"the gradient of {_name(self._fsdp2_owner)} is held in pieces over HSDP's "
            "replicas (fsdp2.replica_optim): pickle its .whole() (the parameter's layout) or "
            ".full_tensor() instead"
        )


def _as_dtensor(t: Any) -> Any:
    if isinstance(t, PieceGrad):
        return DTensor(t._local_tensor, t._spec, requires_grad=False)
    return t


def _as_piece(t: Any, owner: tuple[ParamGroup, FSDPParam] | None) -> Any:
    if owner is None or type(t) is not DTensor:
        return t
    spec = t._spec
    if spec != piece_spec(owner[1], t.dtype):
        return t  # a reduction's partial result, a replicated scalar
    out = PieceGrad(t._local_tensor, spec, requires_grad=False)
    out._fsdp2_owner = owner
    return out


def _mutates_first(func: Any) -> bool:
    """An in-place op returning its first argument (``mul_``), not a list op (``None``)."""
    schema = func._schema
    if not schema.arguments or len(schema.returns) != 1:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write and schema.returns[0].alias_info is not None


def _scalar(t: Any) -> bool:
    if not isinstance(t, torch.Tensor):
        return True
    if isinstance(t, DTensor) and not isinstance(t, PieceGrad):
        return t.numel() == 1 and all(p.is_replicate() for p in t.placements)
    return not isinstance(t, DTensor) and t.dim() == 0


def _check(func: Any, args: Any, kwargs: Any) -> tuple[ParamGroup, FSDPParam] | None:
    """Raise unless ``func`` keeps every element of the pieces where it is or reduces them
    whole; returns the owner of the pieces it reads."""
    if func is _AMP_UNSCALE:  # each gradient checked and unscaled on its own
        return _check_per_index(func, [args[0]])
    if func.__name__.startswith("_foreach"):  # per index: each entry is one op of its own
        return _check_per_index(func, [a for a in (*args, *kwargs.values()) if _is_list(a)])
    if func in _WHOLE_REDUCTIONS and _reduces_some_dims(func, args, kwargs):
        pieces = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, PieceGrad)]
        _refuse(pieces[0], func, "a reduction over some of its dims")
    local = func in _LOCAL or func in _WHOLE_REDUCTIONS or torch.Tag.pointwise in func.tags
    return _check_one(func, tree_flatten((args, kwargs))[0], local)


def _is_list(a: Any) -> bool:
    return isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a)


def _check_per_index(func: Any, lists: list[Any]) -> tuple[ParamGroup, FSDPParam] | None:
    owner = None
    for entry in zip(*lists, strict=False):
        owner = _check_one(func, entry, True) or owner
    return owner


def _check_one(func: Any, tensors: Any, local: bool) -> tuple[ParamGroup, FSDPParam] | None:
    pieces = [t for t in tensors if isinstance(t, PieceGrad)]
    if not pieces:
        return None
    first = pieces[0]
    if not local:
        _refuse(first, func, "an op that needs the gradient in its layout")
    for t in tensors:
        if isinstance(t, PieceGrad):
            if t._fsdp2_owner[1] is not first._fsdp2_owner[1]:
                _refuse(first, func, f"an op with the gradient of {_name(t._fsdp2_owner)}")
        elif not _scalar(t):
            _refuse(first, func, "an op with a tensor of another layout")
    return first._fsdp2_owner


# torch < 2.13 ([Note: pieces as .grad]): the same rules, on the torch functions that take a
# PieceGrad (methods, operators, ``torch.*``), named as aten names them.
_FUNCTION_LOCAL = {
    "__get__", "__repr__", "__format__", "size", "dim", "numel", "nelement", "element_size",
    "is_floating_point", "is_complex", "stride", "storage_offset", "requires_grad_", "detach",
    "detach_", "clone", "to", "float", "double", "half", "bfloat16", "contiguous", "zero_",
    "fill_", "copy_", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
    "randn_like", "_amp_foreach_non_finite_check_and_unscale_", "full_tensor", "whole",
    "to_local", "redistribute", "__reduce_ex__", "item", "tolist", "__bool__", "__float__",
}  # fmt: skip
_FUNCTION_WHOLE = {
    "norm", "vector_norm", "linalg_vector_norm", "sum", "max", "min", "amax", "amin", "any",
    "all", "_foreach_norm", "_foreach_max",
}  # fmt: skip
_LAYOUT_PROPERTIES = {"T", "mT", "H", "mH", "real", "imag"}  # views in another layout
_DUNDER = {"truediv": "div", "floordiv": "floor_divide", "invert": "bitwise_not"}


def _aten_name(name: str) -> str:
    """``__rmul__`` -> ``mul``, ``__iadd__`` -> ``add_``, ``mul_`` -> ``mul_``."""
    if not (name.startswith("__") and name.endswith("__")):
        return name
    core = name[2:-2]
    for prefix, suffix in (("i", "_"), ("r", "")):  # in place, reflected
        base = _DUNDER.get(core[1:], core[1:])
        if core.startswith(prefix) and hasattr(torch.ops.aten, base + suffix):
            return base + suffix
    return _DUNDER.get(core, core)


def _pointwise(name: str) -> bool:
    packet = getattr(torch.ops.aten, _aten_name(name), None)
    if packet is None:
        return False
    return any(
        torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads()
    ) or name.startswith("_foreach")


def _check_function(func: Any, args: Any, kwargs: Any) -> tuple[ParamGroup, FSDPParam] | None:
    """``_check`` for torch < 2.13, on a torch function rather than an aten op."""
    name = getattr(func, "__name__", "")
    tensors = tree_flatten((args, kwargs))[0]
    pieces = [t for t in tensors if isinstance(t, PieceGrad)]
    if not pieces:
        return None
    first = pieces[0]
    if name == "__get__":
        prop = getattr(getattr(func, "__self__", None), "__name__", "")
        if prop in _LAYOUT_PROPERTIES:
            _refuse(first, func, f"the view {prop}")
        return first._fsdp2_owner
    whole = name in _FUNCTION_WHOLE
    if whole and _dims_given(name, args, kwargs):
        _refuse(first, func, "a reduction over some of its dims")
    if name.startswith("_foreach") or name == "_amp_foreach_non_finite_check_and_unscale_":
        lists = [a for a in (*args, *kwargs.values()) if _is_list(a)]
        for entry in zip(*lists[:1] if name.startswith("_amp") else lists, strict=False):
            _check_one(func, entry, True)
        return first._fsdp2_owner
    local = name in _FUNCTION_LOCAL or whole or _pointwise(name)
    return _check_one(func, tensors, local)


def _dims_given(name: str, args: Any, kwargs: Any) -> bool:
    dim = kwargs.get("dim")
    at = 2 if name in ("norm", "vector_norm", "linalg_vector_norm") else 1
    if dim is None and len(args) > at and isinstance(args[at], (int, tuple, list)):
        dim = args[at]
    if dim is None:
        return False
    dims = [dim] if isinstance(dim, int) else list(dim)
    ndim = int(args[0].dim())
    return 0 < len(dims) < ndim or (name in ("max", "min") and len(dims) > 0)


def _reduces_some_dims(func: Any, args: Any, kwargs: Any) -> bool:
    dim = kwargs.get("dim")
    if dim is None and func in (aten.linalg_vector_norm.default, aten.norm.ScalarOpt_dim):
        dim = args[2] if len(args) > 2 else None
    if dim is None and func in (aten.amax.default, aten.amin.default):
        dim = args[1] if len(args) > 1 else None
    if dim is None:
        return False
    dims = [dim] if isinstance(dim, int) else list(dim)
    return 0 < len(dims) < int(args[0].dim())


def _name(owner: tuple[ParamGroup, FSDPParam]) -> str:
    """The parameter's name under the root (its module's path once the root ran)."""
    group, fp = owner
    path = group.path.removesuffix(group.mesh_tag)
    return fp.fqn if path == group.name or path.startswith("the root") else f"{path}.{fp.fqn}"


def _refuse(piece: PieceGrad, func: Any, what: str) -> None:
    fqn = _name(piece._fsdp2_owner)
    raise RuntimeError(
        f"{func.__name__} on the gradient of {fqn}: fsdp2.replica_optim holds it in pieces "
        f"over HSDP's replicas (its local tensor is this rank's piece of the flattened "
        f"shard), and this is {what}. Elementwise ops and whole-tensor reductions (norms, "
        "clipping, GradScaler) work on it as it is; for anything else take the whole "
        "gradient, in the parameter's layout: p.grad.whole() (or .full_tensor()), a "
        "collective every rank calls"
    )


def flatten_mesh(fp: FSDPParam) -> None:
    """Give ``fp``'s mesh a flattened dim of all its dims (when its dims are named), so
    that DTensor reduces a ``PieceGrad``'s partial results over every rank in one
    collective (two in a row, and torch's warning about them, otherwise). Collective:
    ``fsdp2.replica_optim`` calls it on every rank when it starts replica sharding."""
    assert fp.spec is not None
    mesh = fp.spec.mesh
    if mesh.ndim == 1 or not mesh.mesh_dim_names:
        return
    cache = mesh_cache(mesh)
    if cache.flat is None:
        with _disable_current_modes():  # fsdp2.estimate_memory's fake tensors: real ranks
            cache.flat = mesh._flatten()


def piece_spec(fp: FSDPParam, dtype: torch.dtype) -> DTensorSpec:
    """The spec of ``fp``'s ``PieceGrad`` (of ``dtype``): its shape and strides, on its
    parameter's mesh, sharded on every mesh dim (the replicate dims too: every rank holds
    different elements), as ``Shard(0)`` where the parameter is replicated
    ([Note: pieces as .grad])."""
    assert fp.spec is not None
    mesh = fp.spec.mesh
    placements = tuple(Shard(0) if p.is_replicate() else p for p in fp.spec.placements)
    key = ("piece", placements, tuple(fp.spec.shape), dtype)
    cache = mesh_cache(mesh).specs
    spec = cache.get(key)
    if spec is None:
        meta = TensorMeta(fp.spec.shape, fp.spec.stride, dtype)
        spec = cache[key] = DTensorSpec(mesh, placements, tensor_meta=meta)
    return spec


def land_pieces(group: ParamGroup, params: list[FSDPParam], output: torch.Tensor) -> int:
    """Land this replica rank's pieces of ``params``' gradients (``output``: one slot of
    ``c`` elements per parameter, back to back) as their ``PieceGrad``, accumulating into
    existing ones, each parameter's post-accumulate-grad hooks run once its piece landed;
    returns the elements consumed."""
    pg = group.info.replicate_group
    assert pg is not None
    replicas, rank = group.info.replicate_size, pg.rank()
    flat = group.sharded_flat
    offset = 0
    for p, dtype in zip(params, landing_dtypes(params, output.dtype), strict=True):
        start, length, c = piece_range(p.local_numel, replicas, rank)
        g = output.narrow(0, offset, length)
        offset += c
        if g.device != flat.device or g.dtype != dtype:  # [Note: gradient dtypes]
            g = g.to(device=flat.device, dtype=dtype)
        held = p.sharded.grad
        if isinstance(held, PieceGrad):
            held._local_tensor.add_(g)
        else:
            if held is not None:  # set by hand (or DCP's state init) in the parameter's layout
                local = held._local_tensor if isinstance(held, DTensor) else p.local_chunk(held)
                g = g + local.reshape(-1).narrow(0, start, length).to(g.dtype)
            set_piece_grad(group, p, g)
        p.run_grad_hooks()  # with the PieceGrad: [Note: post-accumulate-grad hooks] in param.py
    return offset


def piece_grad_of(fp: FSDPParam) -> torch.Tensor | None:
    """This replica rank's piece of ``fp``'s flattened local gradient, the local tensor of
    its ``PieceGrad``; ``None`` if it has none."""
    g = fp.sharded.grad
    return g._local_tensor if isinstance(g, PieceGrad) else None


def set_piece_grad(group: ParamGroup, fp: FSDPParam, piece: torch.Tensor | None) -> None:
    """Make ``piece`` (this rank's piece of ``fp``'s gradient) ``fp``'s ``.grad``; ``None``
    clears it."""
    fp.sharded.grad = None if piece is None else PieceGrad.of(piece, (group, fp))
