"""One managed parameter: where its shard and its unsharded copy live.

# [Note: flat storage]
# A group keeps ONE flat sharded buffer per rank holding every parameter's
# dim-0 chunk, each padded to ``ceil(dim0 / world)`` rows, back to back. The
# sharded ``nn.Parameter(DTensor)`` of each parameter wraps a view of its
# (unpadded) chunk in that buffer, so the optimizer updates the buffer in place
# and the buffer *is* the all-gather input: no copy-in for fp32 training.
# The all-gather output is rank-major (rank 0's flat buffer, rank 1's, ...);
# one ``split_with_sizes_copy`` moves it into the flat unsharded buffer, which
# is parameter-major: each parameter's ``world * padded_chunk`` elements back
# to back. Every unsharded parameter is a fixed view of that buffer, so its
# identity never changes: resharding frees the buffer's storage (resize to 0)
# and unsharding reallocates it. Reduce-scatter uses the same geometry in
# reverse: ``_chunk_cat`` packs the unsharded grads rank-major, and each rank's
# output has exactly the sharded buffer's layout, so the new gradients are
# views of it at the sharded parameters' offsets.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ._mesh import MeshInfo


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
    ``world * offset`` in the flat unsharded buffer.
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
        self.shape = param.shape
        self.requires_grad = param.requires_grad
        # 0-dim parameters are replicated (see [Note: scalars] in _param_group.py).
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
        self.sharded: nn.Parameter = param  # replaced by the group
        self.unsharded: nn.Parameter = param
        self.spec = None

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

    def make_sharded(self, flat: torch.Tensor, info: MeshInfo) -> nn.Parameter:
        local = self.local_view(flat)
        placements = info.placements(None if self.is_scalar else self.shard_dim)
        dt = DTensor.from_local(
            local,
            info.mesh,
            placements,
            run_check=False,
            shape=self.shape,
            stride=torch.empty(self.shape, device="meta").stride(),
        )
        self.sharded = nn.Parameter(dt, requires_grad=self.requires_grad)
        self.spec = self.sharded._spec  # reused for every gradient: see land_grads
        return self.sharded

    def grad_dtensor(self, local: torch.Tensor) -> DTensor:
        """A gradient for the sharded parameter, wrapping ``local`` (no checks, no copy)."""
        return DTensor(local, self.spec, requires_grad=False)
