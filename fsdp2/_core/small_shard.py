"""``reshard_after_forward=k``: between forward and backward keep the unsharded
parameters sharded over ``k`` consecutive ranks (a node, say), so that backward's
all-gather spans those ``k`` ranks only."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fsdp2._core import collectives as C
from fsdp2._core import debug as D
from fsdp2._core.mesh import post_forward_group

if TYPE_CHECKING:
    from fsdp2._core.group import ParamGroup


class SmallShard:
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
        if D.is_debug():
            what = f"{self.group.path} (its reshard_after_forward={self.size} copy)"
            D.check("all-gather", what, flat.numel() * self.size, flat.dtype, self.group_pg)
        return C.all_gather(flat, self.group_pg, self.size)

    def copy_out(self, output: torch.Tensor) -> None:
        C.copy_out(output, self.split_sizes, self.dsts)
