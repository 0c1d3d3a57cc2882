"""Tensor-subclass parameters: torch's FSDP2 all-gather extension protocol.

# [Note: all-gather extensions]
# A parameter whose (TP-)local tensor is a tensor subclass defining
#
#     fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)
#         -> (all_gather_inputs: tuple[Tensor, ...], metadata)
#     fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None)
#         -> (unsharded_tensor, tensors_to_free) | None
#
# (or the older ``fsdp_pre_all_gather(self, mesh)``) is an *extension* parameter
# (torchao float8 / int8 / NF4 weights). It keeps its own per-parameter storage
# instead of a slice of the group's flat buffer ([Note: flat storage] in param.py
# assumes plain data): its sharded ``nn.Parameter`` is a DTensor whose local tensor
# is the user's subclass, so the optimizer steps the subclass and the next
# ``fsdp_pre_all_gather`` sees the new values.
#
# Unshard: the hooks' inputs (any number, any dtypes) are packed as *bytes* behind
# the group's plain flat buffer into ONE uint8 all-gather (the plain part first, so it
# stays aligned and is copied out as before). Each input's all-gather output has
# its own persistent tensor of ``world * numel`` elements, rank-major; one
# ``split_with_sizes_copy`` fills them all. ``fsdp_post_all_gather`` builds the
# unsharded parameter from them on the first unshard and refills it through
# ``out=`` afterwards, so the unsharded parameter keeps its identity and the
# subclass may keep the output tensors. Resharding frees the outputs' storage and
# the ``tensors_to_free`` (resize to 0), unsharding reallocates them.
#
# A subclass may also define ``fsdp_should_release_all_gather_outputs_after_post_all_gather(self)
# -> bool`` (torch main's, pytorch PR 194114): ``True`` when its post-all-gather tensor does not
# alias the raw outputs, which are then freed right after ``fsdp_post_all_gather`` instead of
# at the reshard (the transformed tensor lives until the reshard as usual). Refused with an
# int ``reshard_after_forward``, whose smaller copy is built from those outputs.
#
# Uneven dim-0 shards: an input whose dim 0 is the rank's row count is padded with
# zero bytes to the padded row count (torch's FSDP2 asks the subclass to return
# padded inputs; both are accepted), so every rank contributes the same bytes.
#
# Anything else that is not a plain tensor (a dispatch or ``__torch_function__``
# subclass without the hooks) cannot be flattened without losing what the subclass
# does, so ``fully_shard`` rejects it with a TypeError, unless it defines the view hook
# (then it is used through its view alone: [Note: unsharded views] in views.py).
"""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from fsdp2._core.params.storage import alloc_storage as _alloc
from fsdp2._core.params.storage import free_storage as _free

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from fsdp2.api import MixedPrecisionPolicy


class ExtParam(Protocol):
    """What an extension reads of its parameter (param.py's ``FSDPParam``)."""

    fqn: str
    sharded: DTensor
    unsharded: torch.Tensor | None
    shape: torch.Size
    stride: tuple[int, ...]
    local_shape: tuple[int, ...]
    owners: list[tuple[nn.Module, str]]
    requires_grad: bool

    def wrap_unsharded(self, tensor: torch.Tensor) -> torch.Tensor: ...


_PLAIN_TORCH_FUNCTION = {
    torch.Tensor.__torch_function__.__func__,  # type: ignore[attr-defined]
    nn.Parameter.__torch_function__,
    torch._C._disabled_torch_function_impl,
}
_PLAIN_TORCH_DISPATCH = torch.Tensor.__torch_dispatch__
RELEASE = "fsdp_should_release_all_gather_outputs_after_post_all_gather"
VIEW = "fsdp_get_unsharded_view"  # see [Note: unsharded views] in views.py
ALIGN = 16  # bytes per rank of a packed all-gather input: keeps typed views of it legal


def _func(attr: Any) -> Any:
    return getattr(attr, "__func__", attr)


def is_plain(t: torch.Tensor) -> bool:
    """Whether ``t`` behaves as plain data: ``torch.Tensor``/``nn.Parameter`` or a
    subclass that overrides neither ``__torch_function__`` nor ``__torch_dispatch__``."""
    cls = type(t)
    if cls is torch.Tensor or cls is nn.Parameter or isinstance(t, FakeTensor):
        return True  # a FakeTensor stands for a plain tensor (fsdp2.estimate_memory)
    return (
        _func(cls.__torch_function__) in _PLAIN_TORCH_FUNCTION
        and cls.__torch_dispatch__ is _PLAIN_TORCH_DISPATCH
    )


def extension_of(local: torch.Tensor, fqn: str, *, patched: bool = False) -> Extension | None:
    """The extension state for a parameter whose local tensor is ``local``, or
    ``None`` for plain data. ``patched``: ``local`` is a local shard given hooks as instance
    attributes after ``fully_shard``; a plain one with only the view hook then becomes an
    extension parameter gathered as plain data (see [Note: unsharded views] in views.py).

    Raises:
        TypeError: ``local`` is a subclass fsdp2 cannot shard (no hooks, or only one).
    """
    has_pre = hasattr(local, "fsdp_pre_all_gather")
    has_post = hasattr(local, "fsdp_post_all_gather")
    if has_pre and has_post:
        return Extension(fqn, local)
    if hasattr(local, RELEASE):
        raise TypeError(
            f"parameter {fqn}: {type(local).__qualname__} defines {RELEASE}, which needs "
            "fsdp_pre_all_gather and fsdp_post_all_gather too (see docs/tensor_subclasses.md)"
        )
    name = type(local).__qualname__
    if has_pre or has_post:
        missing = "fsdp_post_all_gather" if has_pre else "fsdp_pre_all_gather"
        raise TypeError(
            f"parameter {fqn} is a {name} that defines only one of the all-gather extension "
            f"hooks; define {missing} too (see docs/tensor_subclasses.md)"
        )
    if is_plain(local):
        return Extension(fqn, None) if patched and hasattr(local, VIEW) else None
    if hasattr(local, VIEW):
        return Extension(fqn, local, gathers=False)
    raise TypeError(
        f"parameter {fqn} is a tensor subclass ({name}) without the FSDP all-gather "
        "extension hooks, so fsdp2 cannot shard it: its data is not plain storage that can "
        "be flattened without losing what the subclass does. Implement "
        "fsdp_pre_all_gather / fsdp_post_all_gather on it (see docs/tensor_subclasses.md), "
        "convert it to a plain tensor, or leave it out with "
        "fully_shard(..., ignored_params={...})"
    )


class Extension:
    """The all-gather state of one extension parameter (see [Note: all-gather extensions])."""

    __slots__ = (
        "fqn",
        "release",
        "new_api",
        "sizes",
        "dtypes",
        "numels",
        "outputs",
        "metadata",
        "to_free",
        "source",
        "plain",
        "gathers",
        "view_of",
    )

    def __init__(self, fqn: str, local: torch.Tensor | None, *, gathers: bool = True) -> None:
        self.fqn = fqn
        self.release: bool | None = None  # the subclass's release answer, asked once
        # ``local=None``: a plain parameter whose dtype differs from its group's flat
        # buffer (see [Note: other dtypes] in dtypes.py); fsdp2 plays the hooks itself.
        self.plain = local is None
        self.new_api = True
        self.sizes: list[torch.Size] | None = None  # per input, dim 0 padded
        self.dtypes: list[torch.dtype] = []
        self.numels: list[int] = []
        self.outputs: list[torch.Tensor] | None = None  # each world * numel, rank-major
        self.metadata: Any = None
        self.to_free: list[torch.Tensor] = []
        # (device, dtype) of the local shard the layout was built from
        self.source: tuple[torch.device, torch.dtype] | None = None
        # False: a subclass with the view hook only, used through its view alone
        self.gathers = gathers
        # the local shard the unsharded parameter views ([Note: unsharded views] in views.py)
        self.view_of: torch.Tensor | None = None
        if local is None or not gathers:
            return
        n = len(inspect.signature(local.fsdp_pre_all_gather).parameters)  # type: ignore[attr-defined]
        if n not in (1, 5):
            raise TypeError(
                f"parameter {fqn}: {type(local).__qualname__}.fsdp_pre_all_gather takes {n} "
                "arguments besides self; expected (mesh) or (mesh, outer_size, outer_stride, "
                "module, mp_policy)"
            )
        self.new_api = n == 5

    def releases(self, local: torch.Tensor) -> bool:
        """Whether the subclass asks for its raw all-gather outputs to be freed right after
        ``fsdp_post_all_gather`` (its ``fsdp_should_release_..._post_all_gather()``): asked
        once, at ``fully_shard``, and again after ``reset`` (a new local shard), as torch asks
        at initialization, not at every unshard."""
        if self.release is None:
            hook = None if self.plain else getattr(local, RELEASE, None)
            answer = False if hook is None else hook()
            if not isinstance(answer, bool):
                raise TypeError(f"{self.fqn}: {RELEASE}() must return a bool, got {answer!r}")
            self.release = answer
        return self.release

    def reset(self) -> None:
        """Forget the all-gather layout (after the local tensor moved or changed dtype)."""
        self.sizes, self.outputs, self.to_free, self.source = None, None, [], None
        self.release = None
        self.view_of = None

    def stale(self, local: torch.Tensor) -> bool:
        """Whether the layout was built from a local shard of another device or dtype
        (``to_empty``, ``.to``, ``assign=True`` replaced it)."""
        return self.source is not None and self.source != (local.device, local.dtype)

    def inputs(
        self,
        p: ExtParam,
        world: int,
        device: torch.device,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        owner: str,
    ) -> list[torch.Tensor]:
        """Run ``fsdp_pre_all_gather`` on ``p``'s local shard (sharded over ``world`` ranks of
        ``mesh``'s shard dim, gathered on ``device``); return its inputs as flat uint8 pieces
        (zero bytes appended where dim 0 needs padding)."""
        local = p.sharded._local_tensor
        if self.source is None:
            self.source = (local.device, local.dtype)
        if local.device != device:  # CPU offload: the hook runs on the device
            local = local.to(device, non_blocking=True)
        if self.plain:
            dtype = mp_policy.param_dtype
            if dtype is not None and local.is_floating_point() and local.dtype != dtype:
                local = local.to(dtype)  # mixed precision gathers in param_dtype, as torch
            inputs: tuple[torch.Tensor, ...] = (local,)
        else:
            pre = getattr(local, "fsdp_pre_all_gather")  # noqa: B009 - a subclass's hook
            if self.new_api:
                inputs, self.metadata = pre(mesh, p.shape, p.stride, p.owners[0][0], mp_policy)
            else:
                inputs, self.metadata = pre(mesh)
        rows, padded = p.local_shape[0], -(-p.shape[0] // world)
        pieces, sizes = [], []
        for t in inputs:
            if not isinstance(t, torch.Tensor) or not is_plain(t):
                raise TypeError(
                    f"{self.fqn}: fsdp_pre_all_gather must return plain tensors, got "
                    f"{type(t).__qualname__}"
                )
            size = t.shape
            if p.shape[0] % world:  # the same test on every rank: all raise or none
                if t.dim() == 0 or t.size(0) not in (rows, padded):
                    raise ValueError(
                        f"{self.fqn} is sharded unevenly ({p.shape[0]} rows over "
                        f"{world} ranks, {rows} here), but fsdp_pre_all_gather "
                        f"returned an input of shape {tuple(t.shape)}; uneven parameters "
                        f"need inputs with {rows} or {padded} rows on this rank"
                    )
                size = torch.Size((padded, *t.shape[1:]))
            data = t.contiguous().view(-1).view(torch.uint8)
            pieces.append(data)
            missing = (math.prod(size) - t.numel()) * t.element_size()
            if missing:
                pieces.append(data.new_zeros(missing))
            sizes.append(size)
        self._check_layout(sizes, [t.dtype for t in inputs], world, device, owner)
        return pieces

    def _check_layout(
        self,
        sizes: list[torch.Size],
        dtypes: list[torch.dtype],
        world: int,
        device: torch.device,
        owner: str,
    ) -> None:
        if self.sizes is None:
            self.sizes, self.dtypes = sizes, dtypes
            self.numels = [math.prod(s) for s in sizes]
            self.outputs = [
                torch.empty(world * n, dtype=d, device=device)
                for n, d in zip(self.numels, dtypes, strict=True)
            ]
            for o in self.outputs:
                _free(o, owner)
        elif sizes != self.sizes or dtypes != self.dtypes:
            raise RuntimeError(
                f"{self.fqn}: fsdp_pre_all_gather returned inputs of sizes "
                f"{[tuple(s) for s in sizes]} and dtypes {dtypes}, but earlier "
                f"{[tuple(s) for s in self.sizes]} and {self.dtypes}; the all-gather "
                "inputs of a parameter must keep their sizes and dtypes"
            )

    def byte_sizes(self) -> list[int]:
        return [n * d.itemsize for n, d in zip(self.numels, self.dtypes, strict=True)]

    def segments(self, world: int) -> list[torch.Tensor]:
        """The outputs as ``(world, numel)`` (rank-major) views, to be written: through
        ``.data``, so that an unsharded parameter viewing an output keeps its version counter
        (autograd may have saved it in forward; the flat parameters' copy does the same)."""
        assert self.outputs is not None
        return [o.data.view(world, n) for o, n in zip(self.outputs, self.numels, strict=True)]

    def alloc(self, owner: str) -> None:
        assert self.outputs is not None
        for t in self.outputs:
            _alloc(t, owner)

    def free(self, owner: str) -> None:
        for t in self.outputs or ():
            _free(t, owner)
        for t in self.to_free:
            _free(t, owner)

    def build(self, p: ExtParam, param_dtype: torch.dtype, owner: str) -> bool:
        """Run ``fsdp_post_all_gather`` on the filled outputs. Returns True when it made
        a new unsharded parameter (the first time), False when it refilled ``out``."""
        assert self.outputs is not None and self.sizes is not None
        pairs = zip(self.outputs, self.sizes, strict=True)
        outs = tuple(o.view(-1, *s[1:]) if len(s) else o for o, s in pairs)
        local = p.sharded._local_tensor
        if self.plain:  # the unsharded parameter views the (reallocated) output
            if p.unsharded is None:
                tensor = p.wrap_unsharded(torch.as_strided(outs[0], p.shape, p.stride, 0))
                p.unsharded = nn.Parameter(tensor, requires_grad=p.requires_grad)
                return True
            return False
        post = getattr(local, "fsdp_post_all_gather")  # noqa: B009 - a subclass's hook
        if p.unsharded is not None:
            for t in self.to_free:
                _alloc(t, owner)
            post(outs, self.metadata, param_dtype, out=p.unsharded)
            self._release_outputs(local, owner)
            return False
        result = post(outs, self.metadata, param_dtype)
        if not isinstance(result, tuple) or len(result) != 2:
            raise TypeError(
                f"{self.fqn}: fsdp_post_all_gather without out= must return "
                f"(unsharded_tensor, tensors_to_free), got {type(result).__name__}"
            )
        tensor, to_free = result
        if tensor.shape != p.shape:  # padded rows
            tensor = torch.as_strided(tensor, p.shape, p.stride, 0)
        self.to_free = list(to_free)
        p.unsharded = nn.Parameter(p.wrap_unsharded(tensor), p.requires_grad)
        self._release_outputs(local, owner)
        return True

    def _release_outputs(self, local: torch.Tensor, owner: str) -> None:
        if self.releases(local):
            for t in self.outputs or ():
                _free(t, owner)  # the next unshard reallocates them (alloc)
