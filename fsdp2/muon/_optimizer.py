"""``Muon``: checks, state and the matrices of one step (see ``fsdp2.muon``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, overload

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim.optimizer import ParamsT

from fsdp2.muon._exchange import _buckets, _check_ns_settings, _Matrix, _Pieces, _Route, _run

# Keller Jordan's quintic Newton-Schulz coefficients and torch.optim.Muon's defaults.
DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
DEFAULT_EPS = 1e-7
DEFAULT_NS_STEPS = 5
#: Full matrices (in bfloat16) per communication bucket, by default.
DEFAULT_BUCKET_BYTES = 64 << 20


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
    the parameter otherwise): plain tensors and DTensors with ``Replicate()``, ``Shard(d)``
    and ``_StridedShard`` placements. One ``Shard(d)`` (``torch.chunk``'s split of dim
    ``d``, as ``fully_shard`` makes them: ``(Shard(0),)``, ``(Shard(1),)`` from a
    ``shard_placement_fn``, HSDP's ``(Replicate(), Shard(0))``; per-parameter meshes too):
    the parameter communicates over the group of its ``Shard`` mesh dim only. Several
    (tensor parallelism + FSDP: ``(_StridedShard(0, sf=2), Shard(0))`` for a colwise weight
    on ``(dp, tp)``, ``(Shard(0), Shard(1))`` for a rowwise one; HSDP + TP with a
    ``Replicate()`` in front): over the group of all the mesh dims that split it (created
    here, collectively, by flattening them: the mesh needs ``mesh_dim_names``), each rank's
    piece put where ``distribute_tensor`` would have cut it from. Mesh dims of one rank do
    not count. Replicas (HSDP's, TP's of a matrix TP does not split) repeat the same work
    each; a replicated DTensor's matrix is orthogonalized on every rank. ``Partial`` is not
    supported.

    Every rank of a parameter's shard group must step with the same parameters having
    gradients (``grad`` not ``None``); ``fully_shard`` makes it so, since it reduces the
    gradients over those ranks: a parameter without a gradient is skipped on every rank.
    A rank outside a DTensor parameter's mesh skips it. Every rank must build the optimizer
    (it may create process groups) and call ``step()`` (it communicates) with the same
    parameter groups.

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
        # per (mesh, sharded mesh dims): the flattened mesh of those dims; per layout: its
        # process group, this rank's index in it and every rank's piece (see ``_pieces``)
        self._flat_meshes: dict[tuple[DeviceMesh, tuple[int, ...]], DeviceMesh] = {}
        self._plans: dict[tuple[Any, ...], tuple[Any, int, _Pieces]] = {}
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
        support (``NotImplementedError``), or with invalid Newton-Schulz settings. Flattens
        the mesh dims that split a parameter when there are several (collective: every rank
        adds the same groups)."""
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
                _shard_dims(p, where)
        except (ValueError, NotImplementedError):
            self.param_groups.pop()
            raise
        # Flattened meshes (process groups) for the parameters sharded over several mesh
        # dims, created now: creating one is collective over all ranks, which all construct
        # the optimizer with the same parameters, in the same order.
        for i, p in enumerate(group["params"]):
            split = _split_dims(p, _shard_dims(p, f"param_groups[{index}]['params'][{i}]"))
            if len(split) > 1:
                _flat_mesh(self, p.device_mesh, split)

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
                layout = _layout(self, p, where)
                if layout is None:  # this rank is outside the parameter's mesh
                    continue
                key, pg, world, rank, dim, pieces = layout
                local = _local(p, p, where)
                rows, cols = p.shape
                if pieces is None:
                    sizes = _chunk_sizes(p.shape[dim], world)
                    want = (sizes[rank], cols) if dim == 0 else (rows, sizes[rank])
                else:
                    sizes, want = (), pieces.shapes[rank]
                if tuple(local.shape) != want:
                    raise RuntimeError(
                        f"Muon: the local shard of {where} (shape {tuple(p.shape)}, placements "
                        f"{_placements(p)}) has shape {tuple(local.shape)}, not the "
                        f"{want} its placements give rank {rank} of {world}"
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
                    pieces=pieces,
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


def _shard_dims(p: torch.Tensor, where: str) -> tuple[int, ...]:
    """The mesh dims of ``p``'s ``Shard`` and ``_StridedShard`` placements (empty: not
    sharded); raises ``NotImplementedError`` for layouts ``Muon`` does not support."""
    if not isinstance(p, DTensor):
        return ()
    dims = []
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) not in (Shard, _StridedShard):
            raise NotImplementedError(
                f"fsdp2.optim.Muon: {where} (shape {tuple(p.shape)}) has placements "
                f"{tuple(p.placements)}; Muon supports Replicate(), Shard(d) and "
                "_StridedShard placements (FSDP, HSDP, tensor parallelism), not Partial."
            )
        dims.append(mesh_dim)
    if len(dims) > 1 and p.device_mesh.mesh_dim_names is None:
        raise NotImplementedError(
            f"fsdp2.optim.Muon: {where} (shape {tuple(p.shape)}) has several sharded "
            f"placements {tuple(p.placements)} on a mesh without mesh_dim_names; Muon "
            "exchanges such matrices over the flattened mesh of those dims, which needs names "
            "(e.g. init_device_mesh(..., mesh_dim_names=('dp', 'tp')))."
        )
    return tuple(dims)


def _split_dims(p: torch.Tensor, dims: tuple[int, ...]) -> tuple[int, ...]:
    """The dims of ``dims`` that split ``p`` (of more than one rank)."""
    if not isinstance(p, DTensor):
        return ()
    return tuple(i for i in dims if p.device_mesh.size(i) > 1)


_Layout = tuple[Any, Any, int, int, int, _Pieces | None]


def _layout(opt: Muon, p: torch.Tensor, where: str) -> _Layout | None:
    """``(route key, process group or None, world, rank, tensor dim, pieces)`` of ``p``'s
    shards; ``None`` when this rank is outside ``p``'s mesh. One ``Shard`` placement splitting
    ``p``: its mesh dim's group and ``torch.chunk``'s split of ``dim`` (``pieces`` ``None``);
    several (or a ``_StridedShard``): the group of those mesh dims and where each rank's
    piece lies (``_pieces``)."""
    dims = _shard_dims(p, where)
    if not isinstance(p, DTensor):
        return (("local", p.device), None, 1, 0, 0, None)
    mesh = p.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    split = _split_dims(p, dims)
    if not split:
        return (("local", p._local_tensor.device), None, 1, 0, 0, None)
    if len(split) == 1 and type(p.placements[split[0]]) is Shard:
        pg = mesh.get_group(split[0])
        dim = p.placements[split[0]].dim % 2  # type: ignore[attr-defined]
        return (pg, pg, mesh.size(split[0]), coordinate[split[0]], dim, None)
    pg, rank, pieces = _pieces(opt, p, split, coordinate)
    return (pg, pg, len(pieces.shapes), rank, 0, pieces)


def _flat_mesh(opt: Muon, mesh: DeviceMesh, split: tuple[int, ...]) -> DeviceMesh:
    """The 1-D mesh of ``mesh``'s dims ``split`` flattened (``DeviceMesh._flatten``, which
    creates its process groups, collectively, once: torch caches it on the root mesh by
    name); cached per optimizer."""
    flat = opt._flat_meshes.get((mesh, split))
    if flat is None:
        names = mesh.mesh_dim_names
        assert names is not None  # checked by _shard_dims
        sub = mesh if len(split) == mesh.ndim else mesh[tuple(names[i] for i in split)]
        name = "_".join(names[i] for i in split)
        try:
            flat = sub._flatten(name)
        except ValueError:  # the root has a dim (or another flattened mesh) of that name
            flat = sub._flatten(f"_fsdp2_muon_{name}")
        opt._flat_meshes[(mesh, split)] = flat
    return flat


def _pieces(
    opt: Muon, p: DTensor, split: tuple[int, ...], coordinate: Sequence[int]
) -> tuple[Any, int, _Pieces]:
    """The process group of ``p``'s mesh dims ``split``, this rank's index in it and where
    each of its ranks' local piece lies in the full matrix, cached per layout.

    A 2-D tensor's ``Shard`` and ``_StridedShard`` placements split its rows and its columns
    independently, so a rank's piece is ``full[rows][:, cols]``: its rows are what the
    placements on dim 0 leave of ``arange(rows)``, split left to right as
    ``distribute_tensor`` splits a tensor (``_split_tensor``, e.g. FSDP's chunk of a TP
    shard as ``_StridedShard``), the same for the columns."""
    mesh = p.device_mesh
    key = (mesh, tuple(p.placements), tuple(p.shape), split)
    plan = opt._plans.get(key)
    if plan is not None:
        return plan
    pg = mesh.get_group(split[0]) if len(split) == 1 else _flat_mesh(opt, mesh, split).get_group()
    # the ranks of this rank's submesh over ``split``, in the group's rank order
    sub = mesh.mesh[tuple(slice(None) if i in split else c for i, c in enumerate(coordinate))]
    device = _mesh_device(p)
    index, shapes = [], []
    for global_rank in dist.get_process_group_ranks(pg):
        coord = list(coordinate)
        for i, c in zip(split, (sub == global_rank).nonzero()[0].tolist(), strict=True):
            coord[i] = c
        rows, cols = (_indices(p, d, coord) for d in (0, 1))
        index.append(_index(rows, cols, device))
        shapes.append((rows.numel(), cols.numel()))
    if sum(r * c for r, c in shapes) != p.numel():
        raise NotImplementedError(  # not expected: the placements tile the matrix
            f"fsdp2.optim.Muon: the pieces of a {tuple(p.shape)} matrix with placements "
            f"{tuple(p.placements)} do not tile it"
        )
    plan = opt._plans[key] = (pg, dist.get_rank(pg), _Pieces(index, shapes))
    return plan


def _indices(p: DTensor, dim: int, coordinate: Sequence[int]) -> torch.Tensor:
    """The indices along ``dim`` of the rank at mesh ``coordinate``'s piece of ``p``."""
    n = p.shape[dim]
    idx = torch.arange(n).view((n, 1) if dim == 0 else (1, n))
    for mesh_dim, placement in enumerate(p.placements):
        chunks = p.device_mesh.size(mesh_dim)
        if isinstance(placement, (Shard, _StridedShard)) and placement.dim % 2 == dim:
            if chunks > 1:
                split, _ = placement._split_tensor(
                    idx, chunks, with_padding=False, contiguous=False
                )
                idx = split[coordinate[mesh_dim]]
    return idx.reshape(-1)


def _index(rows: torch.Tensor, cols: torch.Tensor, device: torch.device) -> tuple[Any, Any]:
    """``full[index]`` is the piece of ``rows`` and ``cols``: slices where they are ranges."""
    r, c = _as_slice(rows), _as_slice(cols)
    if r is not None and c is not None:
        return (r, c)
    if r is None and c is None:
        return (rows.to(device).view(-1, 1), cols.to(device))
    return (rows.to(device) if r is None else r, cols.to(device) if c is None else c)


def _as_slice(idx: torch.Tensor) -> slice | None:
    n = idx.numel()
    start = int(idx[0]) if n else 0
    return slice(start, start + n) if torch.equal(idx, torch.arange(start, start + n)) else None


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
