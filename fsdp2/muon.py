"""Muon over sharded parameters: each matrix orthogonalized whole, on one rank.

``torch.optim.Muon`` orthogonalizes every 2-D update with a Newton-Schulz iteration, an
operation on the whole matrix. Stepping ``fully_shard``'s sharded parameters it does not
compute that (on DTensors, every product of the iteration runs as sharded DTensor ops, with
collectives in each iteration and partial products summed in bfloat16; on local shards, it
would orthogonalize each shard). ``Muon`` here gives the numbers ``torch.optim.Muon`` gives
on an unsharded replica with the same (averaged) gradients, bit for bit:

1. The momentum update, elementwise, runs on each rank's local shard; the state
   ``momentum_buffer`` is a DTensor sharded like its parameter (so ``state_dict()``,
   ``get_optimizer_state_dict`` and ``torch.distributed.checkpoint`` work as for any optimizer,
   also across world sizes).
2. Each matrix gets one *owner* among the ranks that shard it, chosen greedily by the
   Newton-Schulz cost (``m * n * min(m, n)``), the same on every rank. The ranks send their
   shards of the update (in bfloat16, the precision the iteration runs in) to the owner,
   which puts the full matrix together, orthogonalizes it and sends every rank its shard of
   the result back.
3. Each rank applies weight decay and its shard of the orthogonalized update, scaled by the
   adjusted learning rate, to its local shard.

The communication goes by buckets of about ``bucket_bytes`` of full matrices, in two
``all_to_all_single`` calls per bucket (shards to the owners, results back) over the process
group of the mesh dim that shards the parameters; the next bucket's first exchange is issued
before this bucket's Newton-Schulz runs, so they overlap. Plain (unsharded) tensors,
replicated DTensors and meshes of one rank take the same path without collectives.

Memory: an owner holds its matrices of one bucket in full (bfloat16) while it
orthogonalizes them, plus the flat send and receive buffers of at most two buckets.

Known limits: tensor parallelism combined with FSDP (placements with several ``Shard``s,
``_StridedShard``) is refused with ``NotImplementedError``; every rank of a shard group must
step with the same parameters having gradients (true under ``fully_shard``).

Importing ``fsdp2`` also installs a global optimizer step pre-hook that stops a matrix-wise
optimizer (one of ``fsdp2.optim.MATRIX_WISE_OPTIMIZERS``: ``torch.optim.Muon`` and its
subclasses) from stepping ``fully_shard``'s sharded parameters: its first step raises
``RuntimeError`` naming the parameter before it changes anything.
"""

from __future__ import annotations

import fnmatch
import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, overload

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import ParamsT, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_EPS",
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_NS_STEPS",
    "Muon",
    "install_matrix_wise_guard",
    "muon_param_groups",
]

# Keller Jordan's quintic Newton-Schulz coefficients and torch.optim.Muon's defaults.
DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
DEFAULT_EPS = 1e-7
DEFAULT_NS_STEPS = 5
#: Full matrices (in bfloat16) per communication bucket, by default.
DEFAULT_BUCKET_BYTES = 64 << 20

_OWNER_ATTR = "_fsdp2_managed_by"  # set on every sharded parameter by fully_shard
_CHECKED_ATTR = "_fsdp2_matrix_wise_checked"  # per optimizer: the param_groups sizes checked


class Muon(torch.optim.Optimizer):
    r"""``torch.optim.Muon`` for sharded parameters: the same update, each matrix whole.

    Same arguments and defaults as ``torch.optim.Muon`` (torch 2.13), and the same numbers
    as it computes on an unsharded copy of the parameters with the same gradients: per
    2-D parameter :math:`\theta` (shape ``(m, n)``) with gradient :math:`g`,

    * :math:`B \leftarrow \mathrm{lerp}(B, g, 1 - \mu)` (the state ``momentum_buffer``);
    * :math:`U = \mathrm{lerp}(g, B, \mu)` with ``nesterov``, else :math:`B`;
    * :math:`O = \mathrm{NS}(U)`: ``ns_steps`` quintic Newton-Schulz iterations with
      ``ns_coefficients`` in bfloat16 on the full matrix (transposed when ``m > n``), after
      dividing by its Frobenius norm clamped to ``eps``;
    * :math:`\theta \leftarrow \theta (1 - \gamma\lambda) - \gamma' O` with
      :math:`\gamma' = \gamma \sqrt{\max(1, m/n)}` (``adjust_lr_fn`` ``None`` or
      ``"original"``), :math:`0.2\,\gamma \sqrt{\max(m, n)}` (``"match_rms_adamw"``).

    The parameters may be ``fully_shard``'s sharded parameters (DTensors), other DTensors
    with a supported layout, or plain tensors, in any mix. Each matrix's Newton-Schulz runs
    once, on one rank (its owner) among those that shard it: see the module docstring for
    the algorithm and ``bucket_bytes``. The state is a DTensor ``momentum_buffer`` sharded
    like its parameter (a plain tensor for a plain parameter).

    Args:
        params: 2-D parameters or parameter groups (``ValueError`` for any other shape).
            For the other parameters (embeddings, the output head, norms, biases) use AdamW:
            ``muon_param_groups`` splits a model's parameters.
        lr: learning rate :math:`\gamma` (a float or a one-element tensor).
        weight_decay: decoupled weight decay :math:`\lambda`.
        momentum: momentum factor :math:`\mu`.
        nesterov: use Nesterov momentum.
        ns_coefficients: the coefficients ``(a, b, c)`` of the Newton-Schulz polynomial.
        eps: the floor of the norm the update is divided by before the iteration.
        ns_steps: Newton-Schulz iterations (fewer than 100).
        adjust_lr_fn: ``None``/``"original"`` or ``"match_rms_adamw"`` (see above).
        bucket_bytes: how many bytes of full matrices (bfloat16, 2 bytes an element) one
            communication bucket holds at most (a larger matrix gets a bucket of its own).
            Larger buckets mean fewer collectives; smaller ones, less memory for the full
            matrices at once and an earlier start of the overlap.

    Supported layouts (checked when the parameters are added; ``NotImplementedError`` names
    the parameter otherwise): plain tensors and DTensors whose placements are all
    ``Replicate()`` but at most one ``Shard(d)`` (``torch.chunk``'s split of dim ``d``, as
    ``fully_shard`` makes them: ``(Shard(0),)``, ``(Shard(1),)`` from a
    ``shard_placement_fn``, HSDP's ``(Replicate(), Shard(0))``; per-parameter meshes too). A
    sharded parameter communicates over the group of its ``Shard`` mesh dim only: HSDP's
    replicas repeat the same work each. A replicated DTensor's matrix is orthogonalized on
    every rank. Known limits for now: several ``Shard`` placements (tensor parallelism
    combined with FSDP, e.g. ``(Shard(0), Shard(1))``), ``_StridedShard`` and ``Partial``
    are not supported.

    Every rank of a parameter's shard group must step with the same parameters having
    gradients (``grad`` not ``None``); ``fully_shard`` makes it so, since it reduces the
    gradients over those ranks: a parameter without a gradient is skipped on every rank.
    A rank outside a DTensor parameter's mesh skips it. Every rank must call ``step()``
    (it communicates) with the same parameter groups.

    ``step(closure)`` calls ``closure`` once with gradients enabled, before the update, and
    returns its result. (One difference from ``torch.optim.Muon`` 2.13: with bfloat16
    parameters and ``nesterov=False`` torch's divides the momentum buffer by its norm in
    place, the Newton-Schulz input aliasing it; here the buffer keeps the formula's value.)
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        self.bucket_bytes = bucket_bytes
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group``, refusing (and not adding) a group with
        a parameter that is not 2-D (``ValueError``) or whose DTensor layout ``Muon`` does not
        support (``NotImplementedError``), or with invalid Newton-Schulz settings."""
        index = len(self.param_groups)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_ns_settings(group["ns_coefficients"], group["ns_steps"])
            for i, p in enumerate(group["params"]):
                where = f"param_groups[{index}]['params'][{i}]"
                if p.ndim != 2:
                    raise ValueError(
                        "Muon only supports 2D parameters whereas we found a parameter with "
                        f"size: {p.size()} ({where})"
                    )
                _shard_placement(p, where)
        except (ValueError, NotImplementedError):
            self.param_groups.pop()
            raise

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One Muon step over every parameter with a gradient (collective: every rank of
        the parameters' shard groups must call it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        routes = self._collect()
        buckets = [b for route in routes for b in _buckets(route, self.bucket_bytes)]
        _run(buckets)
        return loss

    def _collect(self) -> list[_Route]:
        """The matrices to update, by route (process group). Checks every parameter, its
        gradient and state before creating any state."""
        routes: dict[Any, _Route] = {}
        new_state: list[tuple[torch.Tensor, _Matrix]] = []
        for gi, group in enumerate(self.param_groups):
            _check_ns_settings(group["ns_coefficients"], group["ns_steps"])
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                where = f"param_groups[{gi}]['params'][{pi}]"
                if torch.is_complex(p):
                    raise RuntimeError(f"Muon does not support complex parameters ({where})")
                if p.grad.is_sparse:
                    raise RuntimeError(f"Muon does not support sparse gradients ({where})")
                layout = _layout(p, where)
                if layout is None:  # this rank is outside the parameter's mesh
                    continue
                key, pg, world, rank, dim = layout
                local = _local(p, p, where)
                rows, cols = p.shape
                sizes = _chunk_sizes(p.shape[dim], world)
                want = (sizes[rank], cols) if dim == 0 else (rows, sizes[rank])
                if tuple(local.shape) != want:
                    raise RuntimeError(
                        f"Muon: the local shard of {where} (shape {tuple(p.shape)}, placements "
                        f"{_placements(p)}) has shape {tuple(local.shape)}, not torch.chunk's "
                        f"{want} for rank {rank} of {world}"
                    )
                state = self.state.get(p)
                buf = state.get("momentum_buffer") if state else None
                matrix = _Matrix(
                    local=local,
                    grad=_local(p, p.grad, f"the grad of {where}"),
                    buf=None if buf is None else _local(p, buf, f"the momentum_buffer of {where}"),
                    group=group,
                    rows=rows,
                    cols=cols,
                    dim=dim,
                    sizes=sizes,
                )
                if buf is None:
                    new_state.append((p, matrix))
                route = routes.get(key)
                if route is None:
                    device = local.device if pg is None else _mesh_device(p)
                    route = routes[key] = _Route(pg, world, rank, device)
                route.matrices.append(matrix)
        for p, matrix in new_state:
            assert p.grad is not None
            buf = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            self.state[p]["momentum_buffer"] = buf
            matrix.buf = _local(p, buf, "a new momentum_buffer")
        return list(routes.values())


# ---------------------------------------------------------------------------------------------
# Layouts


def _placements(p: torch.Tensor) -> tuple[Any, ...]:
    return tuple(p.placements) if isinstance(p, DTensor) else ()


def _shard_placement(p: torch.Tensor, where: str) -> int | None:
    """The mesh dim of ``p``'s one ``Shard`` placement (``None``: not sharded); raises
    ``NotImplementedError`` for layouts ``Muon`` does not support."""
    if not isinstance(p, DTensor):
        return None
    found = None
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is Shard and found is None:
            found = mesh_dim
            continue
        raise NotImplementedError(
            f"fsdp2.optim.Muon: {where} (shape {tuple(p.shape)}) has placements "
            f"{tuple(p.placements)}; Muon supports Replicate() and at most one Shard(d) "
            "placement (FSDP or HSDP sharding). Tensor parallelism combined with FSDP (several "
            "Shard placements), _StridedShard and Partial are not supported yet."
        )
    return found


def _layout(p: torch.Tensor, where: str) -> tuple[Any, Any, int, int, int] | None:
    """``(route key, process group or None, world, rank, tensor dim)`` of ``p``'s shards;
    ``None`` when this rank is outside ``p``'s mesh."""
    mesh_dim = _shard_placement(p, where)
    if not isinstance(p, DTensor):
        return (("local", p.device), None, 1, 0, 0)
    mesh = p.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    if mesh_dim is None or mesh.size(mesh_dim) == 1:
        dim = 0 if mesh_dim is None else p.placements[mesh_dim].dim % 2  # type: ignore[attr-defined]
        return (("local", p._local_tensor.device), None, 1, 0, dim)
    pg = mesh.get_group(mesh_dim)
    dim = p.placements[mesh_dim].dim % 2  # type: ignore[attr-defined]
    return (pg, pg, mesh.size(mesh_dim), coordinate[mesh_dim], dim)


def _mesh_device(p: DTensor) -> torch.device:
    device_type = p.device_mesh.device_type
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type, None)
    if module is None or not hasattr(module, "current_device"):
        return torch.device(device_type)
    return torch.device(device_type, int(module.current_device()))


def _chunk_sizes(n: int, world: int) -> tuple[int, ...]:
    """Each rank's extent of a dim of size ``n`` split by ``torch.chunk`` over ``world``."""
    per_rank = -(-n // world)
    return tuple(max(0, min(per_rank, n - r * per_rank)) for r in range(world))


def _local(p: torch.Tensor, value: Any, what: str) -> torch.Tensor:
    """``value`` (the parameter itself, its gradient or its state) as a plain local tensor,
    checked to be laid out like ``p``."""
    if not isinstance(p, DTensor):
        if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
            raise ValueError(f"fsdp2.optim.Muon: {what} is a {type(value).__name__}, not a tensor")
        if value.shape != p.shape:
            raise ValueError(
                f"fsdp2.optim.Muon: {what} has shape {tuple(value.shape)}, the parameter "
                f"{tuple(p.shape)}"
            )
        return value
    if not isinstance(value, DTensor):
        raise ValueError(
            f"fsdp2.optim.Muon: {what} (a parameter of shape {tuple(p.shape)}) is a "
            f"{type(value).__name__}, not a DTensor sharded like the parameter. Load optimizer "
            "state with torch.distributed.checkpoint or a sharded state dict."
        )
    if value is not p and value._spec is not p._spec:
        if (
            value.placements != p.placements
            or value.device_mesh != p.device_mesh
            or value.shape != p.shape
        ):
            raise ValueError(
                f"fsdp2.optim.Muon: {what} has placements {tuple(value.placements)} and shape "
                f"{tuple(value.shape)}; the parameter's are {tuple(p.placements)} and "
                f"{tuple(p.shape)}"
            )
    local: torch.Tensor = value._local_tensor
    return local


# ---------------------------------------------------------------------------------------------
# The step


@dataclass(eq=False)
class _Matrix:
    """One parameter's part of a step: its local tensors and full shape."""

    local: torch.Tensor  # the local shard of the parameter
    grad: torch.Tensor  # ... of its gradient
    buf: torch.Tensor | None  # ... of its momentum buffer (set before the exchanges)
    group: dict[str, Any]  # its param group
    rows: int
    cols: int
    dim: int  # the tensor dim sharded (0 when not sharded)
    sizes: tuple[int, ...]  # each rank's extent along ``dim``
    owner: int = 0

    def piece_shape(self, rank: int) -> tuple[int, int]:
        extent = self.sizes[rank]
        return (extent, self.cols) if self.dim == 0 else (self.rows, extent)

    def piece_numel(self, rank: int) -> int:
        return self.sizes[rank] * (self.cols if self.dim == 0 else self.rows)

    @property
    def cost(self) -> int:
        return self.rows * self.cols * min(self.rows, self.cols)


@dataclass(eq=False)
class _Route:
    """The matrices sharded over one process group (``None``: not sharded, no collectives),
    in parameter order."""

    pg: Any
    world: int
    rank: int  # this rank's index in ``pg``
    device: torch.device  # where the full matrices are orthogonalized
    matrices: list[_Matrix] = field(default_factory=list)


@dataclass(eq=False)
class _Bucket:
    """Matrices of one route exchanged together; ``order`` is the wire order (by owner, then
    parameter order), ``owned`` this rank's matrices."""

    route: _Route
    order: list[_Matrix]
    owned: list[_Matrix]
    to_owners: list[int]  # numel this rank sends to each rank (its shards of their matrices)
    from_ranks: list[int]  # numel this rank receives from each rank (shards of its matrices)


def _buckets(route: _Route, bucket_bytes: int) -> list[_Bucket]:
    """Split ``route``'s matrices into buckets (consecutive, at most ``bucket_bytes`` of
    bfloat16 full matrices unless one alone is larger) and pick the owners: within each
    bucket, largest Newton-Schulz cost first, each to the rank with the least cost so far
    (lowest rank on ties). Deterministic: the same on every rank."""
    groups: list[list[_Matrix]] = []
    size = 0
    for m in route.matrices:
        nbytes = 2 * m.rows * m.cols
        if not groups or size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(m)
        size += nbytes
    loads = [(0, r) for r in range(route.world)]  # a heap of (cost so far, rank)
    out = []
    for ms in groups:
        for i in sorted(range(len(ms)), key=lambda i: (-ms[i].cost, i)):
            load, rank = heapq.heappop(loads)
            ms[i].owner = rank
            heapq.heappush(loads, (load + ms[i].cost, rank))
        me = route.rank
        order = sorted(ms, key=lambda m: m.owner)  # stable: parameter order within an owner
        owned = [m for m in ms if m.owner == me]
        to_owners = [0] * route.world
        for m in ms:
            to_owners[m.owner] += m.piece_numel(me)
        from_ranks = [sum(m.piece_numel(r) for m in owned) for r in range(route.world)]
        out.append(_Bucket(route, order, owned, to_owners, from_ranks))
    return out


class _Exchange:
    """An ``all_to_all_single`` in flight (or, without a process group, its input)."""

    def __init__(
        self, route: _Route, flat: torch.Tensor, send: list[int], receive: list[int]
    ) -> None:
        self.work: Any = None
        if route.pg is None:
            self.out = flat
            return
        self.inp = flat  # kept alive until the collective finished
        self.out = flat.new_empty(sum(receive))
        self.work = dist.all_to_all_single(
            self.out,
            flat,
            output_split_sizes=receive,
            input_split_sizes=send,
            group=route.pg,
            async_op=True,
        )

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.out


def _run(buckets: list[_Bucket]) -> None:
    """Momentum, exchanges, Newton-Schulz and the update, bucket by bucket: the next
    bucket's shards go out before this bucket's Newton-Schulz runs."""
    if not buckets:
        return
    to_owners = _send_to_owners(buckets[0])
    returning: deque[tuple[_Bucket, _Exchange]] = deque()
    for i, bucket in enumerate(buckets):
        received = to_owners.wait()
        if i + 1 < len(buckets):
            to_owners = _send_to_owners(buckets[i + 1])
        returning.append((bucket, _orthogonalize(bucket, received)))
        if len(returning) > 1:
            _apply(*returning.popleft())
    while returning:
        _apply(*returning.popleft())


def _send_to_owners(bucket: _Bucket) -> _Exchange:
    """Update the momentum of the bucket's shards and send each shard's update (bfloat16)
    to its matrix's owner."""
    pieces = []
    for m in bucket.order:
        assert m.buf is not None
        momentum = m.group["momentum"]
        m.buf.lerp_(m.grad, 1 - momentum)
        update = m.grad.lerp(m.buf, momentum) if m.group["nesterov"] else m.buf
        pieces.append(update.bfloat16().reshape(-1))
    route = bucket.route
    flat = _concat(pieces, route.device)
    return _Exchange(route, flat, bucket.to_owners, bucket.from_ranks)


def _orthogonalize(bucket: _Bucket, received: torch.Tensor) -> _Exchange:
    """Put this rank's matrices together from the shards received, orthogonalize them and
    send every rank its shards of the results."""
    route = bucket.route
    offsets = [0]
    for n in bucket.from_ranks[:-1]:
        offsets.append(offsets[-1] + n)
    back: list[list[torch.Tensor]] = [[] for _ in range(route.world)]
    for m in bucket.owned:
        pieces = []
        for r in range(route.world):
            n = m.piece_numel(r)
            pieces.append(received[offsets[r] : offsets[r] + n].view(m.piece_shape(r)))
            offsets[r] += n
        full = pieces[0] if route.world == 1 else torch.cat(pieces, dim=m.dim)
        g = m.group
        ortho = _newton_schulz(full, g["ns_coefficients"], g["ns_steps"], g["eps"])
        for r, piece in enumerate(torch.split(ortho, list(m.sizes), dim=m.dim)):
            back[r].append(piece.reshape(-1))
    flat = _concat([p for per_rank in back for p in per_rank], route.device)
    return _Exchange(route, flat, bucket.from_ranks, bucket.to_owners)


def _apply(bucket: _Bucket, exchange: _Exchange) -> None:
    """Weight decay and this rank's shards of the orthogonalized updates."""
    received = exchange.wait()
    offset = 0
    for m in bucket.order:
        n = m.local.numel()
        update = received[offset : offset + n].view(m.local.shape).to(m.local.device)
        offset += n
        g = m.group
        lr = _scalar(g["lr"])
        m.local.mul_(1 - lr * g["weight_decay"])
        m.local.add_(update, alpha=-_adjust_lr(lr, g["adjust_lr_fn"], m.rows, m.cols))


def _concat(pieces: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not pieces:
        return torch.empty(0, dtype=torch.bfloat16, device=device)
    return torch.cat(pieces).to(device)


def _scalar(x: Any) -> Any:
    """A hyperparameter as ``torch.optim.Muon`` uses it (a tensor squeezed to 0-d)."""
    return x.squeeze() if isinstance(x, torch.Tensor) and x.dim() != 0 else x


def _adjust_lr(lr: Any, adjust_lr_fn: str | None, rows: int, cols: int) -> Any:
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    return lr


def _check_ns_settings(coefficients: Any, steps: int) -> None:
    if steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")


def _newton_schulz(
    update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalization of a full 2-D update, in bfloat16 (may
    overwrite ``update`` when it is bfloat16 already)."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b * A + c * A @ A
        x = torch.addmm(x, poly, x, beta=a)  # a * X + (b * A + c * A @ A) @ X
    return x.T if tall else x


# ---------------------------------------------------------------------------------------------
# Splitting a model's parameters between Muon and AdamW


def muon_param_groups(
    model: nn.Module,
    *,
    muon: Mapping[str, Any] | None = None,
    adamw: Mapping[str, Any] | None = None,
    head_names: Iterable[str] = ("output", "lm_head", "head"),
    muon_names: Iterable[str] = (),
    adamw_names: Iterable[str] = (),
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split ``model``'s parameters between Muon and AdamW, as Moonlight and Keller Jordan's
    Muon do: Muon for the hidden layers' matrices, AdamW for everything else::

        muon_groups, adamw_groups = fsdp2.optim.muon_param_groups(
            model, muon={"lr": 0.02}, adamw={"lr": 3e-4, "weight_decay": 0.01}
        )
        optimizers = [fsdp2.optim.Muon(muon_groups), torch.optim.AdamW(adamw_groups)]

    A parameter goes to AdamW when it is not 2-D (biases, norm weights, convolutions'
    kernels), belongs to an ``nn.Embedding`` or ``nn.EmbeddingBag``, or belongs to the output
    head; every other parameter goes to Muon. The head is every module whose qualified name,
    or its last component, is one of ``head_names``; when no module has such a name, the
    last ``nn.Linear`` of ``model.modules()`` is taken for the head. A parameter registered
    on several modules (tied weights) goes to AdamW if any of them says so.

    Args:
        model: the model (sharded or not: ``fully_shard`` keeps the names).
        muon: hyperparameters for the Muon group (``lr``, ``weight_decay``, ...); the
            optimizer's defaults where not given.
        adamw: the same for the AdamW group.
        head_names: module names taken for the output head.
        muon_names: ``fnmatch`` patterns of parameter names (as ``named_parameters()``
            gives them, e.g. ``"layers.*.attn.qkv.weight"``) forced to Muon; such a
            parameter must be 2-D (``ValueError``).
        adamw_names: patterns of parameter names forced to AdamW (checked after
            ``muon_names``).

    Returns:
        ``(muon_groups, adamw_groups)``: one parameter group each, ``{"params": [...],
        **muon}`` and ``{"params": [...], **adamw}``, in ``model.parameters()`` order, every
        parameter (frozen ones included) in exactly one. Either ``params`` list may be
        empty.
    """
    muon_kw, adamw_kw = dict(muon or {}), dict(adamw or {})
    if "params" in muon_kw or "params" in adamw_kw:
        raise ValueError("muon_param_groups: muon= and adamw= hold hyperparameters, not params")
    heads = set(head_names)
    force_muon, force_adamw = list(muon_names), list(adamw_names)
    modules = list(model.named_modules(remove_duplicate=False))
    head_modules = {
        id(m) for name, m in modules if name in heads or name.rpartition(".")[2] in heads
    }
    if not head_modules:
        linears = [m for _, m in modules if isinstance(m, nn.Linear)]
        head_modules = {id(linears[-1])} if linears else set()
    names: dict[int, list[str]] = {}
    adamw_by_owner: set[int] = set()
    for mod_name, m in modules:
        for p_name, p in m.named_parameters(recurse=False):
            names.setdefault(id(p), []).append(f"{mod_name}.{p_name}" if mod_name else p_name)
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) or id(m) in head_modules:
                adamw_by_owner.add(id(p))
    muon_params: list[nn.Parameter] = []
    adamw_params: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        aliases = names.get(id(p), [name])

        def matches(patterns: list[str], aliases: list[str] = aliases) -> bool:
            return any(fnmatch.fnmatchcase(a, pat) for a in aliases for pat in patterns)

        if matches(force_muon):
            if p.ndim != 2:
                raise ValueError(
                    f"muon_param_groups: {name} matches muon_names but has shape "
                    f"{tuple(p.shape)}; Muon takes 2-D parameters only"
                )
            muon_params.append(p)
        elif matches(force_adamw) or p.ndim != 2 or id(p) in adamw_by_owner:
            adamw_params.append(p)
        else:
            muon_params.append(p)
    return [{"params": muon_params, **muon_kw}], [{"params": adamw_params, **adamw_kw}]


# ---------------------------------------------------------------------------------------------
# The guard against matrix-wise optimizers on shards


def _guard(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The global step pre-hook: see ``install_matrix_wise_guard``."""
    from fsdp2 import optim  # the public tuple, which users may rebind

    if not isinstance(optimizer, optim.MATRIX_WISE_OPTIMIZERS) or isinstance(optimizer, Muon):
        return
    sizes = tuple(len(g["params"]) for g in optimizer.param_groups)
    if optimizer.__dict__.get(_CHECKED_ATTR) == sizes:
        return
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            owner = getattr(p, _OWNER_ATTR, None) if isinstance(p, DTensor) else None
            if owner is not None and _splits(p):
                name = type(optimizer).__name__
                raise RuntimeError(
                    f"{name} works on whole matrices, but param_groups[{gi}]['params'][{pi}] "
                    f"(shape {tuple(p.shape)}, placements {tuple(p.placements)}) is sharded by "
                    f"fsdp2's fully_shard({owner}): stepping its shards does not give the "
                    "full-matrix update. Use fsdp2.optim.Muon for sharded parameters (same "
                    "arguments and numbers as torch.optim.Muon, each matrix orthogonalized "
                    "whole on one rank); fsdp2.optim.muon_param_groups splits a model's "
                    "parameters between Muon and AdamW."
                )
    optimizer.__dict__[_CHECKED_ATTR] = sizes


def _splits(p: DTensor) -> bool:
    """Whether ``p``'s local tensor is less than the full matrix: a placement other than
    ``Replicate()`` (``Shard``, ``_StridedShard``) on a mesh dim of more than one rank."""
    mesh = p.device_mesh
    return any(
        not isinstance(pl, Replicate) and mesh.size(i) > 1 for i, pl in enumerate(p.placements)
    )


_guard_handle: RemovableHandle | None = None


def install_matrix_wise_guard() -> RemovableHandle:
    """Install (once; ``import fsdp2`` does it) the global optimizer step pre-hook that
    refuses a matrix-wise optimizer over ``fully_shard``'s sharded parameters.

    Before each step of an optimizer that is an instance of one of
    ``fsdp2.optim.MATRIX_WISE_OPTIMIZERS`` (``torch.optim.Muon`` and its subclasses; not
    ``fsdp2.optim.Muon``), the hook checks the parameters once (again when the number of
    parameter groups or of parameters in a group changes) and raises ``RuntimeError``,
    naming the parameter, when one is a DTensor that ``fully_shard`` sharded (it carries
    ``_fsdp2_managed_by``) with a ``Shard`` placement on a mesh dim of more than one rank:
    such a step does not compute what the optimizer computes on the full matrix (for
    ``torch.optim.Muon`` on DTensors, every Newton-Schulz product runs as sharded DTensor
    ops, with collectives in each iteration and partial products summed in bfloat16; an
    optimizer working on local tensors would orthogonalize each shard). Parameters whose
    local tensor is the whole matrix (world size 1, ``Replicate()`` placements) and plain
    tensors pass. Any other optimizer costs one ``isinstance`` check per step.

    It cannot detect a matrix-wise optimizer it is not told about: add such a class to
    ``fsdp2.optim.MATRIX_WISE_OPTIMIZERS`` (rebind the tuple) to have it checked. Nor does
    it check DTensors sharded by something other than ``fully_shard`` (tensor parallelism
    alone), nor steps whose ``param_groups`` hold local tensors (``step_on_local_shards``,
    which refuses non-elementwise optimizers itself).

    Returns:
        the hook's handle (``remove()`` uninstalls it; calling this again reinstalls it).
    """
    global _guard_handle
    hooks = None if _guard_handle is None else _guard_handle.hooks_dict_ref()
    if _guard_handle is None or hooks is None or _guard_handle.id not in hooks:
        _guard_handle = register_optimizer_step_pre_hook(_guard)
    return _guard_handle
