"""``reshard_after_forward=k``: between forward and backward keep the unsharded
parameters sharded over ``k`` consecutive ranks (a node, say), so that backward's
all-gather spans those ``k`` ranks only."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp2._core.mesh import MeshInfo, post_forward_group
from fsdp2._core.transport import copy_out

__all__ = ["SmallShard"]


class SmallShard:
    """A copy of a group's unsharded params sharded over ``size`` consecutive ranks,
    kept between forward and backward for ``reshard_after_forward=size``.

    Rank ``j`` of the small group keeps block ``j`` of every rank-major unsharded
    segment (each parameter's padded unsharded rows; an extension parameter's
    all-gather outputs): a segment holds ``world`` equal blocks, a multiple of
    ``size``, so the blocks tile it exactly. Groups with extension parameters keep
    bytes (their segments differ in dtype).
    """

    def __init__(self, info: MeshInfo, size: int) -> None:
        self.group_pg: dist.ProcessGroup
        self.group_pg, self.rank = post_forward_group(info, size)
        self.size = size
        self.flat: torch.Tensor | None = None
        self.split_sizes: list[int] = []
        self.dsts: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []  # this rank's block of each segment
        self._segments: list[torch.Tensor] | None = None  # what dsts were derived from

    def keep(self, segments: list[torch.Tensor], as_bytes: bool) -> None:
        """Keep this rank's blocks of the unsharded ``segments`` (``(world, k)`` each,
        allocated; ``as_bytes``: viewed as uint8). The views are derived again only when
        ``segments`` is another list than last time (a plain group passes the same list
        until its buffers are rebuilt; one with extension parameters a new one each time,
        as their outputs appear at the first all-gather)."""
        if segments is not self._segments:  # a new layout: derive the views again
            self._segments = segments
            if as_bytes:
                segments = [s.view(torch.uint8) for s in segments]
            self.dsts = [s.view(self.size, s.numel() // self.size) for s in segments]
            self.split_sizes = [d.size(1) for d in self.dsts]
            self.sources = [d[self.rank] for d in self.dsts]
        self.flat = torch.cat(self.sources)

    def take(self) -> torch.Tensor:
        """The kept blocks (this rank's all-gather input), given up."""
        flat, self.flat = self.flat, None
        assert flat is not None
        return flat

    def copy_out(self, output: torch.Tensor) -> None:
        """Scatter the small group's ``(size, k)`` all-gather output into the segments."""
        copy_out(output, self.split_sizes, self.dsts)
