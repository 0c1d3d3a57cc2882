"""Unsharded views (``fsdp_get_unsharded_view``, a torch PR branch's tensor-subclass hook):
with one shard rank, a frozen, uncast, not offloaded parameter whose local shard defines the
hook uses the tensor it returns, over the shard's own storage, as its unsharded parameter:
no all-gather, no gather outputs ([Note: unsharded views] in fsdp2/_core/params/extension.py).

Ported from torch's ``test_fully_shard_unsharded_views.py`` (one gloo rank; its
``FSDPParam.init_all_gather_outputs`` patched to raise becomes: no all-gather seen by
``spy_all_gathers`` and ``Extension._check_layout``, where gather outputs are made, patched
to raise), against the values the unsharded ``nn.Linear`` gives (``9 * version`` for weights
and bias filled with ``version`` and an input of ones):

* the views survive ``reshard()``, ``state_dict()`` and ``load_state_dict`` (in place: the
  same view object, the same data pointers, the new values), for a plain parameter and a
  ``TwoTensor`` subclass, built on the device or on meta + ``to_empty``, with
  ``reshard_after_forward`` True and False;
* trainable or cast parameters keep storage of their own (a subclass with all-gather hooks;
  a plain cast one), while fsdp2's plain trainable ones view the flat buffer at one shard rank
  (a documented difference from torch's);
* the hook may decline (``None``: gathered) and must keep the local shape, dtype and device
  (``ValueError``), for a hook set on a plain local shard after ``fully_shard`` (as torch's
  test does) and for a subclass's;
* ``load_state_dict(assign=True)`` gives a new view over the new storage;
* fsdp2's own: a group mixing a view, trainable plain parameters (trained 2 steps against a
  replica, still no all-gather) and a gathered trainable subclass; a viewed subclass made
  trainable (gathered from then on, the bias still viewing the flat buffer); a subclass with
  the view hook alone raises ``TypeError`` at ``fully_shard`` where no view applies and
  ``RuntimeError`` at the forward where it stops applying or the hook declines.
* ``estimate_memory`` counts no unsharded bytes for a view: tests/planning/test_estimate_memory.py.

``gpu``-marked (``make gpu-check``): CPU offload keeps storage of its own, and a CUDA graph
captured over the views reads weights loaded in place without an unshard.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn as nn
from _harness import run_on_ranks
from comm_counter import spy_all_gathers
from devices import REPEATS, one_rank_mesh, require_cuda
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.two_tensor import TwoTensor

import fsdp2
from fsdp2._core.params.extension import Extension
from fsdp2._core.runtime.state import state_of


class BorrowedTwoTensor(TwoTensor):
    """torch's test subclass: the view hook only (no all-gather hooks)."""

    @staticmethod
    def __new__(cls, a, b, *args, **kwargs):
        with torch.inference_mode(a.is_inference()):
            return TwoTensor.__new__(cls, a, b, *args, **kwargs)

    def fsdp_get_unsharded_view(self, mesh: DeviceMesh, module: nn.Module, mp_policy: Any) -> Any:
        if mesh.size() != 1:
            raise AssertionError("The unsharded view requires one shard rank")
        return BorrowedTwoTensor(self.a, self.b)


class GatheredTwoTensor(BorrowedTwoTensor):
    """The view hook and the all-gather hooks: gathered where no view applies."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self.a, self.b), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        a, b = outputs
        if out is not None:
            if a.dtype != param_dtype:
                out.a.copy_(a)
                out.b.copy_(b)
            return None
        return GatheredTwoTensor(a.to(param_dtype), b.to(param_dtype)), (a, b)


def _mesh(device: str) -> DeviceMesh:
    return one_rank_mesh() if device == "cuda" else init_device_mesh("cpu", (1,))


def _two(w: torch.Tensor, cls: type = BorrowedTwoTensor, grad: bool = False) -> nn.Parameter:
    w = w.detach()
    return nn.Parameter(cls(w, w.clone()), requires_grad=grad)


def _make_model(device: str, subclass: bool, meta: bool, raf: bool) -> nn.Module:
    """torch's test model: a frozen Linear(8, 4) (its weight a subclass or not), sharded on
    one rank, every value 0.5."""
    with torch.device("meta" if meta else device):
        model = nn.Linear(8, 4)
        if subclass:
            model.weight = _two(model.weight)
        model.requires_grad_(False)
    fsdp2.fully_shard(model, mesh=_mesh(device), reshard_after_forward=raf)
    if meta:
        model.to_empty(device=device)
    state = model.state_dict()
    for tensor in state.values():
        tensor.fill_(0.5)
    model.load_state_dict(state)
    return model


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (t.a, t.b) if isinstance(t, TwoTensor) else (t,)


def _no_gather_outputs() -> Any:
    return mock.patch.object(
        Extension,
        "_check_layout",
        side_effect=AssertionError("Borrowed views must not allocate gather outputs"),
    )


# ---- views survive reshard and weight loading ------------------------------------------------


def _views_survive(device: str, subclass: bool, meta: bool, raf: bool) -> None:
    model = _make_model(device, subclass, meta, raf)
    pointers = [t.data_ptr() for t in _halves(model.weight.to_local())]
    inputs = torch.ones(2, 8, device=device)
    gathered: list[Any] = []
    with torch.no_grad(), _no_gather_outputs(), spy_all_gathers(lambda t, g: gathered.append(t)):
        model(inputs)
        group = state_of(model).groups[0]
        param = next(p for p in group.params if p.fqn == "weight")
        borrowed = param.unsharded
        assert borrowed is not None
        buffers = _halves(borrowed)
        assert [t.data_ptr() for t in buffers] == pointers
        for version in range(1, 4):
            model.reshard()
            state = model.state_dict()
            assert [t.data_ptr() for t in buffers] == pointers
            assert all(t.untyped_storage().nbytes() > 0 for t in buffers)
            model.load_state_dict({n: torch.full_like(t, version) for n, t in state.items()})
            assert param.unsharded is borrowed
            for t in buffers:
                assert torch.equal(t, torch.full_like(t, version))
            for t in _halves(model(inputs)):
                assert torch.equal(t, torch.full_like(t, 9.0 * version)), (version, t)
            assert [t.data_ptr() for t in buffers] == pointers
            # every parameter a view: the flat buffer's (plain) or its own (subclass)
            assert group.aliased and group.unsharded_bufs == [] and group.gathered == []
            for p in group.ext_params:
                assert p.ext is not None and p.ext.outputs is None
                assert p.ext.view_of is p.sharded._local_tensor
    assert gathered == []


@pytest.mark.parametrize("raf", [False, True], ids=["keep", "reshard"])
@pytest.mark.parametrize("meta", [False, True], ids=["device", "meta"])
@pytest.mark.parametrize("subclass", [False, True], ids=["plain", "subclass"])
def test_views_survive_reshard_and_weight_loading(subclass: bool, meta: bool, raf: bool) -> None:
    run_on_ranks(1, _views_survive, "cpu", subclass, meta, raf)


# ---- training and casts keep storage of their own ----------------------------------------------


def _independent(kind: str, requires_grad: bool, param_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    ref = nn.Linear(8, 4)
    ref.load_state_dict(model.state_dict())
    if kind == "subclass":
        model.weight = _two(model.weight, GatheredTwoTensor, requires_grad)
    model.requires_grad_(requires_grad)
    fsdp2.fully_shard(
        model,
        mesh=_mesh("cpu"),
        mp_policy=fsdp2.MixedPrecisionPolicy(param_dtype=param_dtype),
        reshard_after_forward=False,
    )
    source = model.weight.to_local()
    x = torch.randn(2, 8)
    out = model(x)
    param = state_of(model).groups[0].params[0]
    unsharded = param.unsharded
    assert unsharded is not None and unsharded.dtype == param_dtype
    want = ref.to(param_dtype)(x.to(param_dtype))
    views = [
        u.data_ptr() == s.data_ptr()
        for u, s in zip(_halves(unsharded), _halves(source), strict=True)
    ]
    if kind == "subclass" or param_dtype != torch.float32:
        assert not any(views), (kind, requires_grad, param_dtype)
        assert param.ext is None or param.ext.view_of is None
    else:  # fsdp2: plain parameters view the flat buffer at one shard rank, trainable too
        assert all(views)
    for t in _halves(out):
        torch.testing.assert_close(t, want.detach())


@pytest.mark.parametrize(
    "kind,requires_grad,param_dtype",
    [
        ("subclass", True, torch.float32),
        ("subclass", False, torch.bfloat16),
        ("plain", False, torch.bfloat16),
        ("plain", True, torch.float32),
    ],
    ids=["subclass-trainable", "subclass-cast", "plain-cast", "plain-trainable"],
)
def test_training_and_casts_keep_independent_storage(
    kind: str, requires_grad: bool, param_dtype: torch.dtype
) -> None:
    run_on_ranks(1, _independent, kind, requires_grad, param_dtype)


# ---- the hook may decline and must keep the metadata --------------------------------------------


def _decline(kind: str, invalid: bool) -> str | None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    ref = nn.Linear(8, 4)
    ref.load_state_dict(model.state_dict())
    if kind == "subclass":
        model.weight = _two(model.weight, GatheredTwoTensor)
    model.requires_grad_(False)
    fsdp2.fully_shard(model, mesh=_mesh("cpu"))
    local = model.weight._local_tensor  # the hook as an instance attribute, as torch's test
    local.fsdp_get_unsharded_view = lambda *_: local.double() if invalid else None
    x = torch.randn(2, 8)
    if invalid:
        try:
            model(x)
        except ValueError as e:
            return str(e)
        raise AssertionError("a view of another dtype was accepted")
    for _ in range(2):  # gathered again after the reshard
        with torch.no_grad():
            out = model(x)
        for t in _halves(out):
            torch.testing.assert_close(t, ref(x).detach())
        group = state_of(model).groups[0]
        weight = next(p for p in group.params if p.fqn == "weight")
        assert weight.ext is not None and weight.ext.view_of is None
        assert group.gathered == [weight] and group.aliased  # the bias views the flat buffer
        assert weight.unsharded is not None
        for u, s in zip(
            _halves(weight.unsharded), _halves(weight.sharded._local_tensor), strict=True
        ):
            assert u.data_ptr() != s.data_ptr()
        model.reshard()
    return None


@pytest.mark.parametrize("invalid", [False, True], ids=["decline", "invalid"])
@pytest.mark.parametrize("kind", ["plain", "subclass"])
def test_extension_can_decline_and_must_preserve_metadata(kind: str, invalid: bool) -> None:
    [msg] = run_on_ranks(1, _decline, kind, invalid)
    if invalid:
        assert "weight" in msg and "parameter's local shape, dtype, and device" in msg, msg


# ---- replaced storage recreates the view ---------------------------------------------------------


def _replaced(subclass: bool) -> None:
    model = _make_model("cpu", subclass, False, False)
    inputs = torch.ones(2, 8)
    with torch.no_grad():
        model(inputs)
        old = [t.data_ptr() for t in _halves(model.weight)]
        state = {n: torch.full_like(t, 2) for n, t in model.state_dict().items()}
        model.load_state_dict(state, assign=True)
        source = [t.data_ptr() for t in _halves(model.weight.to_local())]
        assert source != old
        for t in _halves(model(inputs)):
            assert torch.equal(t, torch.full((2, 4), 18.0))
        assert [t.data_ptr() for t in _halves(model.weight)] == source


@pytest.mark.parametrize("subclass", [False, True], ids=["plain", "subclass"])
def test_replaced_storage_recreates_view(subclass: bool) -> None:
    run_on_ranks(1, _replaced, subclass)


# ---- fsdp2's own: mixed groups, the view hook alone ----------------------------------------------


class _Adapted(nn.Module):
    """A frozen base (its weight a view-only subclass) and a trainable plain adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 4)
        self.adapter = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return (y.a if isinstance(y, TwoTensor) else y) + self.adapter(x)


def _mixed() -> None:
    torch.manual_seed(0)
    model, ref = _Adapted(), _Adapted()
    ref.load_state_dict(model.state_dict())
    model.base.weight = _two(model.base.weight)
    model.base.requires_grad_(False)
    ref.base.requires_grad_(False)
    fsdp2.fully_shard(model, mesh=_mesh("cpu"))
    pointer = model.base.weight.to_local().a.data_ptr()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gathered: list[Any] = []
    with _no_gather_outputs(), spy_all_gathers(lambda t, g: gathered.append(t)):
        for step in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            loss, ref_loss = model(x).square().sum(), ref(x).square().sum()
            loss.backward()
            ref_loss.backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            torch.testing.assert_close(loss, ref_loss)
            group = state_of(model).groups[0]
            [base] = group.ext_params
            assert base.unsharded is not None and base.unsharded.a.data_ptr() == pointer
    assert gathered == []
    for name, p in ref.named_parameters():
        mine = dict(model.named_parameters())[name].full_tensor()
        torch.testing.assert_close(_halves(mine)[0], p.detach())

    # A trainable gathered subclass next to the view: only it (and the flat buffer) gathered.
    torch.manual_seed(0)
    model, ref = _Adapted(), _Adapted()
    ref.load_state_dict(model.state_dict())
    model.base.weight = _two(model.base.weight)
    model.adapter.weight = _two(model.adapter.weight, GatheredTwoTensor, True)
    model.base.requires_grad_(False)
    fsdp2.fully_shard(model, mesh=_mesh("cpu"))
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = model(x)
    group = state_of(model).groups[0]
    base, adapter = group.ext_params
    assert group.gathered == [adapter] and not group.aliased
    assert base.unsharded is not None and base.ext is not None
    assert base.unsharded.a.data_ptr() == base.sharded._local_tensor.a.data_ptr()
    torch.testing.assert_close(out.a, ref(x).detach())

    # A viewed subclass made trainable: gathered from then on, next to the aliased bias.
    model = nn.Linear(8, 4)
    nn.init.constant_(model.bias, 0.5)
    model.weight = _two(torch.full((4, 8), 0.5), GatheredTwoTensor)
    model.requires_grad_(False)
    fsdp2.fully_shard(model, mesh=_mesh("cpu"), reshard_after_forward=True)
    x = torch.ones(2, 8)
    group = state_of(model).groups[0]
    for trainable in (False, True):
        model.weight.requires_grad_(trainable)
        with torch.no_grad():
            out = model(x)
        [weight] = group.ext_params
        assert weight.unsharded is not None and group.aliased
        assert (group.gathered == [weight]) is trainable
        borrowed = weight.unsharded.a.data_ptr() == weight.sharded._local_tensor.a.data_ptr()
        assert borrowed is not trainable
        for t in _halves(out):
            assert torch.equal(t, torch.full_like(t, 4.5))


def test_mixed_group() -> None:
    run_on_ranks(1, _mixed)


def _view_only_errors() -> list[str]:
    msgs = []
    for kw in ({"grad": True}, {"mp": torch.bfloat16}):
        model = nn.Linear(8, 4)
        model.weight = _two(model.weight, grad=kw.get("grad", False))
        model.bias.requires_grad_(False)
        mp = fsdp2.MixedPrecisionPolicy(param_dtype=kw.get("mp"))
        try:
            fsdp2.fully_shard(model, mesh=_mesh("cpu"), mp_policy=mp)
        except TypeError as e:
            msgs.append(str(e))
    # made trainable after its first view; the hook declines (at the first forward)
    for case in ("trainable", "decline"):
        model = _make_model("cpu", True, False, True)
        if case == "trainable":
            with torch.no_grad():
                model(torch.ones(2, 8))  # a view
            model.weight.requires_grad_(True)
        else:
            model.weight._local_tensor.fsdp_get_unsharded_view = lambda *_: None
        try:
            model(torch.ones(2, 8))
        except RuntimeError as e:
            msgs.append(str(e))
    return msgs


def test_view_only_subclass_errors() -> None:
    [msgs] = run_on_ranks(1, _view_only_errors)
    assert len(msgs) == 4, msgs
    grad, cast, trainable, decline = msgs
    for msg in msgs:
        assert msg.startswith("parameter weight") and "BorrowedTwoTensor" in msg, msg
    assert "it requires grad" in grad
    assert "mixed precision casts it from torch.float32 to torch.bfloat16" in cast
    assert "it requires grad" in trainable
    assert "fsdp_get_unsharded_view returned None" in decline


# ---- on a GPU (make gpu-check) -----------------------------------------------------------------


def _offload_cuda(subclass: bool) -> None:
    model = nn.Linear(8, 4, device="cuda")
    if subclass:
        model.weight = _two(model.weight, GatheredTwoTensor)
    model.requires_grad_(False)
    fsdp2.fully_shard(
        model,
        mesh=_mesh("cuda"),
        offload_policy=fsdp2.CPUOffloadPolicy(pin_memory=False),
        reshard_after_forward=False,
    )
    model(torch.ones(2, 8, device="cuda"))
    group = state_of(model).groups[0]
    param = group.params[0]
    assert param.sharded.device.type == "cpu"
    assert param.unsharded is not None and param.unsharded.device.type == "cuda"
    assert param.ext is None or param.ext.view_of is None
    assert not group.aliased


@pytest.mark.gpu
@pytest.mark.parametrize("subclass", [False, True], ids=["plain", "subclass"])
def test_cpu_offload_keeps_independent_storage_cuda(subclass: bool) -> None:
    require_cuda("CPU offload to a GPU")  # tests/devices.py: make gpu-check DEVICE=cpu
    run_on_ranks(1, _offload_cuda, subclass)


def _graph_replay(subclass: bool) -> None:
    model = _make_model("cuda", subclass, True, False)
    inputs = torch.ones(2, 8, device="cuda")
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                model(inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = model(inputs)
    with torch.no_grad():
        for version in range(1, 4):
            state = {n: torch.full_like(t, version) for n, t in model.state_dict().items()}
            model.load_state_dict(state)
            graph.replay()
            for t in _halves(captured):
                assert torch.equal(t, torch.full_like(t, 9.0 * version)), (version, t)
    graph.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("subclass", [False, True], ids=["plain", "subclass"])
def test_graph_replay_reads_loaded_weights_without_unshard_cuda(subclass: bool) -> None:
    require_cuda("CUDA graphs")
    for _ in range(REPEATS):
        run_on_ranks(1, _graph_replay, subclass)
