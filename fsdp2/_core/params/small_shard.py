"""``reshard_after_forward=k``: between forward and backward keep the unsharded
parameters sharded over ``k`` consecutive ranks (a node, say), so that backward's
all-gather spans those ``k`` ranks only; and register them, meanwhile, as torch's FSDP2
does: DTensors on the 2D mesh of those blocks (``post_forward_mesh``).

# [Note: the parameters between forward and backward]
# torch documents what is registered after forward: the sharded parameters for
# ``reshard_after_forward=True``, the unsharded ones for ``False``, and "the parameters
# resharded to the smaller mesh" for an int. Those are the *faces* here: for each plain
# parameter a DTensor ``(Replicate(), Shard(d))`` on the blocks' mesh whose local tensor is
# this rank's ``torch.chunk`` of the parameter over the ``k`` ranks of its block. Where that
# chunk is exactly the front of this rank's kept block (dim 0, the block's rows starting at
# the chunk's), the face views the kept copy; elsewhere (uneven rows, other shard dims,
# groups that keep bytes) it is a copy taken from the unsharded parameter as the group
# reshards. Faces are built once per layout and keep their identity from step to step (so
# the optimizer check tracks them: an optimizer built from them fails at ``step()``, see
# [Note: optimizers holding unsharded parameters] in unsharded.py); their storage lives only
# while the group is in that state. Tensor-parallel and extension parameters keep their
# sharded parameter registered (torch's FSDP2 raises for the former).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp2._core.comm.transport import copy_out
from fsdp2._core.params.param import FSDPParam, _dtensor_param, _spec
from fsdp2._core.params.storage import alloc_storage, free_storage
from fsdp2._core.support.mesh import MeshInfo, mesh_cache, post_forward_mesh

__all__ = ["SmallShard"]


class SmallShard:
    """A copy of a group's unsharded params sharded over ``size`` consecutive ranks,
    kept between forward and backward for ``reshard_after_forward=size``, and the faces
    registered meanwhile ([Note: the parameters between forward and backward]).

    Rank ``j`` of the small group keeps block ``j`` of every rank-major unsharded
    segment (each parameter's padded unsharded rows; an extension parameter's
    all-gather outputs): a segment holds ``world`` equal blocks, a multiple of
    ``size``, so the blocks tile it exactly. Groups with extension parameters keep
    bytes (their segments differ in dtype).
    """

    def __init__(self, info: MeshInfo, size: int) -> None:
        self.mesh = post_forward_mesh(info, size)
        self.group_pg: dist.ProcessGroup = self.mesh.get_group(1)
        self.rank = self.mesh.get_local_rank(1)
        self.size = size
        self.world = info.shard_size
        self.flat: torch.Tensor | None = None  # the kept blocks, until taken
        self._buf: torch.Tensor | None = None  # their storage, freed when done
        self.split_sizes: list[int] = []
        self.dsts: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []  # this rank's block of each segment
        self._segments: list[torch.Tensor] | None = None  # what dsts were derived from
        self._as_bytes = False
        # one per flat parameter: its face (None: its sharded parameter stays registered)
        # and, for a copied face, the unsharded slice it copies
        self.faces: list[DTensor | None] | None = None
        self._copied: list[tuple[DTensor, FSDPParam]] = []

    def keep(self, segments: list[torch.Tensor], as_bytes: bool, path: str) -> None:
        """Keep this rank's blocks of the unsharded ``segments`` (``(world, k)`` each,
        allocated; ``as_bytes``: viewed as uint8). The views are derived again only when
        ``segments`` is another list than last time (a plain group passes the same list
        until its buffers are rebuilt; one with extension parameters a new one each time,
        as their outputs appear at the first all-gather)."""
        if segments is not self._segments:  # a new layout: derive the views again
            self._segments = segments
            self._as_bytes = as_bytes
            if as_bytes:
                segments = [s.view(torch.uint8) for s in segments]
            self.dsts = [s.view(self.size, s.numel() // self.size) for s in segments]
            self.split_sizes = [d.size(1) for d in self.dsts]
            self.sources = [d[self.rank] for d in self.dsts]
            self._buf = None
            self.faces = None
        if not self.sources:
            self.flat = torch.empty(0)
            return
        if self._buf is None:
            src = self.sources[0]
            self._buf = torch.empty(sum(self.split_sizes), dtype=src.dtype, device=src.device)
        else:
            alloc_storage(self._buf, path)
        torch.cat(self.sources, out=self._buf)
        self.flat = self._buf

    def take(self) -> torch.Tensor:
        """The kept blocks (this rank's all-gather input), given up; ``release`` frees
        them once the all-gather is done."""
        flat, self.flat = self.flat, None
        assert flat is not None
        return flat

    def release(self, path: str) -> None:
        """Free the kept blocks and the copied faces (the group left that state)."""
        self.flat = None
        if self._buf is not None:
            free_storage(self._buf, path)
        for face, _ in self._copied:
            free_storage(face._local_tensor, path)

    def copy_out(self, output: torch.Tensor) -> None:
        """Scatter the small group's ``(size, k)`` all-gather output into the segments."""
        copy_out(output, self.split_sizes, self.dsts)

    # ---- faces ---------------------------------------------------------------------

    def fill_faces(self, flat_params: list[FSDPParam], path: str) -> list[DTensor | None]:
        """The faces of ``flat_params`` (the group's plain parameters, in segment order),
        built on first use of a layout; the copied ones filled from the unsharded
        parameters, which must still be valid. Call right after ``keep``."""
        if self.faces is None:
            self.faces, self._copied = [], []
            for i, p in enumerate(flat_params):
                face, copied = self._face(p, i)
                self.faces.append(face)
                if face is not None and copied:
                    self._copied.append((face, p))
        with torch.no_grad():
            for face, p in self._copied:
                local = face._local_tensor
                alloc_storage(local, path)
                d = p.shard_dim
                start = self.rank * -(-p.shape[d] // self.size)
                assert p.unsharded is not None
                local.copy_(p.unsharded.narrow(d, start, local.size(d)))
        for face, p in zip(self.faces, flat_params, strict=True):
            if face is not None and face.requires_grad is not p.requires_grad:
                face.requires_grad_(p.requires_grad)
        return self.faces

    def _face(self, p: FSDPParam, i: int) -> tuple[DTensor | None, bool]:
        """``p``'s face, and whether it is a copy (not a view of the kept blocks)."""
        if p.tp is not None or p.is_scalar or p.unsharded is None:
            return None, False
        shape = p.shape
        d = p.shard_dim
        chunk = -(-shape[d] // self.size)
        start = self.rank * chunk
        size = max(0, min(chunk, shape[d] - start))
        local_shape = (*shape[:d], size, *shape[d + 1 :])
        dtype = p.unsharded.dtype
        row_numel = shape[1:].numel() if d == 0 else 0
        block_rows = self.split_sizes[i] // row_numel if row_numel and not self._as_bytes else 0
        assert self._buf is not None
        if d == 0 and block_rows and start == self.rank * block_rows and size <= block_rows:
            off = sum(self.split_sizes[:i])
            local = self._buf.narrow(0, off, size * row_numel).view(local_shape)
            copied = False
        else:
            local = torch.empty(local_shape, dtype=dtype, device=self._buf.device)
            copied = True
        spec = _spec(self.mesh, (Replicate(), Shard(d)), shape, dtype)
        placeholder = mesh_cache(self.mesh).placeholder(local)
        return _dtensor_param(local, spec, p.requires_grad, placeholder), copied
