"""What ``fsdp2.replica_optim``'s optimizer keeps per parameter, and its state and
clipping over the pieces ([Note: pieces] in pieces.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor, Shard

from fsdp2._core.comm.collectives import all_reduce
from fsdp2._core.replicas.piece_grad import PieceGrad, piece_grad_of, set_piece_grad
from fsdp2._core.replicas.pieces import gather_rows, piece_range, whole_rows

__all__ = ["Slot", "clip_slots", "like", "piece_of", "whole_state"]


class Slot:
    """One parameter of the optimizer and the tensor its inner optimizer steps."""

    __slots__ = ("param", "group", "fp", "piece", "start", "length")

    def __init__(self, param: torch.Tensor, owner: tuple[Any, Any] | None) -> None:
        self.param = param
        self.group: Any = None  # the ParamGroup and FSDPParam, for fully_shard's parameters
        self.fp: Any = None
        if owner is not None:
            self.group, self.fp = owner
        self.start = self.length = 0
        self.piece = self._make_piece()

    @property
    def split(self) -> bool:
        """Held in pieces over the replicas ([Note: pieces] in fsdp2/_core/replicas/pieces.py)."""
        return self.group is not None and self.group.info.replicate_group is not None

    def _make_piece(self) -> torch.Tensor:
        p = self.param
        if not isinstance(p, DTensor):
            return p
        local = p._local_tensor
        if not self.split:
            return local
        info = self.group.info
        self.start, self.length, _ = piece_range(
            self.fp.local_numel, info.replicate_size, info.replicate_group.rank()
        )
        return local.view(-1).narrow(0, self.start, self.length)

    def stale(self) -> bool:
        """The parameter's storage moved (``model.to``, a relayout): rebuild the piece."""
        if not isinstance(self.param, DTensor):
            return False
        local = self.param._local_tensor
        if not self.split:
            return self.piece is not local
        if isinstance(local, FakeTensor):  # no data pointers (fsdp2.estimate_memory): storages
            return (
                self.piece.untyped_storage()._cdata != local.untyped_storage()._cdata
                or self.piece.storage_offset() != local.storage_offset() + self.start
            )
        return (
            self.piece.dtype != local.dtype
            or self.piece.device != local.device
            or self.piece.data_ptr() != local.data_ptr() + self.start * local.element_size()
        )

    def grad(self) -> torch.Tensor | None:
        """The gradient of the piece: the landed piece (the parameter's ``PieceGrad``), or
        the piece of a gradient set on the parameter in its own layout
        (``torch.distributed.checkpoint``'s state initialization, a user's)."""
        p, g = self.param, self.param.grad
        if not self.split:
            if isinstance(g, DTensor):
                if g.placements != p.placements:  # type: ignore[attr-defined]
                    raise ValueError(
                        f"ReplicaShardedOptimizer: the gradient of {self.name} has placements "
                        f"{g.placements}, the parameter {p.placements}"  # type: ignore[attr-defined]
                    )
                return g._local_tensor
            return g
        if g is None or isinstance(g, PieceGrad):
            return piece_grad_of(self.fp)
        local = g._local_tensor if isinstance(g, DTensor) else self.fp.local_chunk(g)
        piece = local.reshape(-1).narrow(0, self.start, self.length)
        return piece.to(self.piece.dtype, copy=True)

    def hold_as_pieces(self) -> None:
        """A gradient set on the parameter in its own layout becomes its piece, held as its
        ``PieceGrad`` (so clipping scales what the step reads)."""
        g = self.param.grad
        if self.split and g is not None and not isinstance(g, PieceGrad):
            set_piece_grad(self.group, self.fp, self.grad())

    @property
    def name(self) -> str:
        return (
            self.fp.fqn
            if self.fp is not None
            else f"a parameter of shape {tuple(self.param.shape)}"
        )


def like(value: Any, piece: torch.Tensor) -> bool:
    """A state tensor with one value per element of ``piece`` (not a scalar like ``step``)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == piece.shape


def whole_state(slots: list[Slot], state: dict[Any, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """Every state tensor in its parameter's layout: pieces all-gathered over the replicas
    (one all-gather per HSDP group and dtype), local shards wrapped as DTensors like their
    parameter."""
    whole: dict[Any, dict[str, Any]] = {}
    gathers: dict[tuple[int, torch.dtype], list[tuple[Slot, str, torch.Tensor]]] = {}
    for slot in slots:
        st = state.get(slot.param)
        if not st:
            continue
        whole[slot.param] = dict(st)
        for key, v in st.items():
            if not like(v, slot.piece):
                continue
            if slot.split:
                gathers.setdefault((id(slot.group), v.dtype), []).append((slot, key, v))
            elif isinstance(slot.param, DTensor):
                whole[slot.param][key] = _as_param_layout(slot.param, v)
    for entries in gathers.values():
        for (slot, key, _), local in zip(entries, _gather_state(entries), strict=True):
            p = slot.param
            assert isinstance(p, DTensor)
            whole[p][key] = _as_param_layout(p, local.view(slot.fp.local_shape))
    return whole


def _gather_state(entries: list[tuple[Slot, str, torch.Tensor]]) -> list[torch.Tensor]:
    """All-gather state pieces (of one HSDP group) over its replicas: each one's whole
    flattened local shard, in ONE all-gather."""
    group = entries[0][0].group
    numels = [slot.fp.local_numel for slot, _, _ in entries]
    pieces = [piece for _, _, piece in entries]
    rows = gather_rows(group, pieces, numels, f"optimizer state of {group.path}").wait()
    rows = rows.to(pieces[0].device)
    return [whole.clone() for whole in whole_rows(rows, numels)]


def _as_param_layout(p: DTensor, local: torch.Tensor) -> DTensor:
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def piece_of(slot: Slot, key: str, value: Any) -> Any:
    """The piece (or local shard) of a loaded state value of the parameter's shape."""
    p = slot.param
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 0 or value.shape != p.shape:  # ``step``: a copy, never shared with the
        return value.clone()  # source (another live optimizer's state_dict() holds its own)
    if isinstance(value, DTensor):
        assert isinstance(p, DTensor)
        if value.placements != p.placements or value.device_mesh != p.device_mesh:
            value = value.redistribute(p.device_mesh, p.placements)
        local = value._local_tensor
    elif isinstance(p, DTensor):
        local = slot.fp.local_chunk(value) if slot.fp is not None else value
    else:
        local = value
    if slot.split:
        local = local.reshape(-1).narrow(0, slot.start, slot.length)
    return local.to(slot.piece.device, copy=True)


def clip_slots(
    slots: Iterable[Slot],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    foreach: bool | None,
) -> torch.Tensor:
    """The total gradient norm over every rank's pieces, and the clipping."""
    norm_type = float(norm_type)
    inf = norm_type == float("inf")
    by_groups: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for slot in slots:
        slot.hold_as_pieces()
        g = slot.grad()
        if g is None:
            continue
        by_groups.setdefault(_norm_groups(slot), []).append(g)
    device = next((g.device for gs in by_groups.values() for g in gs), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float32, device=device)
    for groups, grads in by_groups.items():
        norms = torch._foreach_norm(grads, norm_type)
        local = torch.stack([n.float() for n in norms])
        part = local.max() if inf else local.pow(norm_type).sum()
        for pg in groups:
            op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
            all_reduce(part, pg, "gradient norm", op=op).wait()
        total = torch.maximum(total, part) if inf else total + part
    if not inf:
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite")
    grads = [g for gs in by_groups.values() for g in gs]
    if grads:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total


def _norm_groups(slot: Slot) -> tuple[Any, ...]:
    """The process groups a parameter's gradient is split over on this rank's side."""
    p = slot.param
    if slot.fp is not None:
        info = slot.group.info
        groups = []
        if info.shard_size > 1 and not slot.fp.is_scalar:
            groups.append(info.shard_group)
        if slot.split:
            groups.append(info.replicate_group)
        tp = slot.fp.tp
        if tp is not None:
            groups += [
                tp.mesh.get_group(i) for i, pl in enumerate(tp.placements) if isinstance(pl, Shard)
            ]
        return tuple(groups)
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        return tuple(
            mesh.get_group(i) for i, pl in enumerate(p.placements) if isinstance(pl, Shard)
        )
    return ()
