"""Checks every error ``fully_shard``, the policies and ``FSDPModule`` promise.

Each case asserts the exception type and, with ``match``, that the message names the
offending thing (module class, parameter path, argument name, dtype, world size). Cases
that call ``fully_shard`` run on 2 and 4 gloo ranks with a 1D CPU mesh and also check that
the failed call left the module untouched: same class, same parameter objects (plain
tensors, not DTensors), no hooks, no fsdp2 state, so it can still be sharded after the fix.
Policy validation and ``mesh=None`` without a process group run in the test process.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _harness import run_on_ranks
from helpers import WORLD_SIZES
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from fsdp2 import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)


class _TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(3, 4)
        self.lin2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.lin1(x))


class _Tied(nn.Module):
    """Embedding and output head sharing one weight (tied embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx))


# ---------------------------------------------------------------------------------------------
# Snapshots: a failed fully_shard must leave the module as it was


def _snapshot(module: nn.Module) -> list[tuple[Any, ...]]:
    out = []
    for name, m in module.named_modules(remove_duplicate=False):
        params = [
            (pname, id(p), type(p).__name__, isinstance(p, DTensor))
            for pname, p in m._parameters.items()
        ]
        hooks = (len(m._forward_pre_hooks), len(m._forward_hooks))
        has_state = any("fsdp" in key for key in m.__dict__)
        out.append((name, type(m), params, hooks, has_state))
    return out


# ---------------------------------------------------------------------------------------------
# Distributed cases: each returns (action, module that must stay untouched or None,
# exception type, message regex)

_Case = tuple[Callable[[], Any], nn.Module | None, type[BaseException], str]


def _case_module_list(mesh, ws: int) -> _Case:
    m = nn.ModuleList([nn.Linear(2, 2)])
    return lambda: fully_shard(m, mesh=mesh), m, ValueError, r"ModuleList.*no forward"


def _case_module_dict(mesh, ws: int) -> _Case:
    m = nn.ModuleDict({"a": nn.Linear(2, 2)})
    return lambda: fully_shard(m, mesh=mesh), m, ValueError, r"ModuleDict.*no forward"


def _case_non_module(mesh, ws: int) -> _Case:
    t = torch.zeros(2)
    return lambda: fully_shard(t, mesh=mesh), None, TypeError, r"nn\.Module.*Tensor"


def _case_non_module_in_list(mesh, ws: int) -> _Case:
    m = nn.Linear(2, 2)
    return lambda: fully_shard([m, "head"], mesh=mesh), m, TypeError, r"nn\.Module.*str"


def _case_empty_list(mesh, ws: int) -> _Case:
    return lambda: fully_shard([], mesh=mesh), None, ValueError, r"empty list"


def _case_same_module_twice_in_list(mesh, ws: int) -> _Case:
    m = nn.Linear(2, 2)
    return lambda: fully_shard([m, m], mesh=mesh), m, ValueError, r"same module twice"


def _case_already_sharded(mesh, ws: int) -> _Case:
    m = nn.Linear(2, 2)
    fully_shard(m, mesh=mesh)
    return lambda: fully_shard(m, mesh=mesh), m, ValueError, r"Linear is already sharded"


def _case_already_sharded_in_list(mesh, ws: int) -> _Case:
    model = _TwoLinear()
    fully_shard(model.lin1, mesh=mesh)
    return (
        lambda: fully_shard([model.lin2, model.lin1], mesh=mesh),
        model,
        ValueError,
        r"Linear is already sharded",
    )


def _case_mesh_3d(mesh, ws: int) -> _Case:
    mesh3 = init_device_mesh("cpu", (1, 1, ws), mesh_dim_names=("a", "b", "c"))
    m = nn.Linear(2, 2)
    return lambda: fully_shard(m, mesh=mesh3), m, ValueError, rf"3D mesh of shape \(1, 1, {ws}\)"


def _case_mesh_not_device_mesh(mesh, ws: int) -> _Case:
    m = nn.Linear(2, 2)
    return lambda: fully_shard(m, mesh="cpu"), m, TypeError, r"mesh to be a DeviceMesh, got str"


def _case_mesh_process_group(mesh, ws: int) -> _Case:
    m = nn.Linear(2, 2)
    pg = dist.group.WORLD
    return lambda: fully_shard(m, mesh=pg), m, TypeError, r"mesh to be a DeviceMesh"


def _case_reshard_str(mesh, ws: int) -> _Case:
    m = nn.Linear(2, 2)
    return (
        lambda: fully_shard(m, mesh=mesh, reshard_after_forward="yes"),
        m,
        ValueError,  # torch's FSDP2 raises ValueError too
        r"reshard_after_forward must be a bool.*'yes'",
    )


def _case_reshard_float(mesh, ws: int) -> _Case:
    m = nn.Linear(2, 2)
    return (
        lambda: fully_shard(m, mesh=mesh, reshard_after_forward=2.0),
        m,
        ValueError,  # torch's FSDP2 raises ValueError too
        r"reshard_after_forward must be a bool.*2\.0",
    )


def _case_reshard_int_not_divisor(mesh, ws: int) -> _Case:
    m = nn.Linear(2, 2)
    return (
        lambda: fully_shard(m, mesh=mesh, reshard_after_forward=3),
        m,
        ValueError,
        rf"reshard_after_forward=3 must divide the shard world size {ws}",
    )


def _case_reshard_int_too_big(mesh, ws: int) -> _Case:
    m = nn.Linear(2, 2)
    return (
        lambda: fully_shard(m, mesh=mesh, reshard_after_forward=2 * ws),
        m,
        ValueError,
        rf"reshard_after_forward={2 * ws} must divide the shard world size {ws}",
    )


def _case_reshard_int_zero(mesh, ws: int) -> _Case:
    m = nn.Linear(2, 2)
    return (
        lambda: fully_shard(m, mesh=mesh, reshard_after_forward=0),
        m,
        ValueError,
        r"reshard_after_forward=0 must divide",
    )


def _case_mp_policy_type(mesh, ws: int) -> _Case:
    m = nn.Linear(2, 2)
    return (
        lambda: fully_shard(m, mesh=mesh, mp_policy={"param_dtype": torch.bfloat16}),
        m,
        TypeError,
        r"mp_policy must be a MixedPrecisionPolicy, got dict",
    )


def _case_offload_policy_type(mesh, ws: int) -> _Case:
    m = nn.Linear(2, 2)
    return (
        lambda: fully_shard(m, mesh=mesh, offload_policy="cpu"),
        m,
        TypeError,
        r"offload_policy must be an OffloadPolicy, got str",
    )


def _case_shard_placement_fn_not_callable(mesh, ws: int) -> _Case:
    m = nn.Linear(2, 2)
    return (
        lambda: fully_shard(m, mesh=mesh, shard_placement_fn=Shard(0)),
        m,
        TypeError,
        r"shard_placement_fn must be callable, got Shard",
    )


def _case_shard_placement_fn_not_shard(mesh, ws: int) -> _Case:
    model = _TwoLinear()
    return (
        lambda: fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Partial()),
        model,
        TypeError,
        r"shard_placement_fn returned Partial\(.*\) for lin1\.weight",
    )


def _case_shard_placement_fn_dim_out_of_range(mesh, ws: int) -> _Case:
    model = _TwoLinear()
    return (
        lambda: fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(2)),
        model,
        ValueError,
        r"Shard\(2\) is out of range for lin1\.weight of shape \(4, 3\)",
    )


def _case_shard_placement_fn_uneven_dim(mesh, ws: int) -> _Case:
    model = _TwoLinear()  # lin1.weight is (4, 3): dim 1 of size 3 divides by no world size
    return (
        lambda: fully_shard(
            model, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None
        ),
        model,
        ValueError,
        rf"lin1\.weight has size 3 on dim 1, not divisible by the shard world size {ws}",
    )


def _case_ignored_params_module(mesh, ws: int) -> _Case:
    m = nn.Linear(2, 2)
    return (
        lambda: fully_shard(m, mesh=mesh, ignored_params=m),
        m,
        TypeError,
        r"ignored_params must be a set of parameters, got Linear",
    )


def _case_ignored_params_tensors(mesh, ws: int) -> _Case:
    m = nn.Linear(2, 2)
    return (
        lambda: fully_shard(m, mesh=mesh, ignored_params={m.weight.detach()}),
        m,
        TypeError,
        r"ignored_params must hold nn\.Parameter objects, got Tensor",
    )


def _case_scalars_of_two_dtypes(mesh, ws: int) -> _Case:
    # parameters of several dtypes share a group, but 0-dim ones live in the flat buffer
    model = _TwoLinear()
    model.lin1.scale = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
    model.lin2.scale = nn.Parameter(torch.tensor(2.0))
    return (
        lambda: fully_shard(model, mesh=mesh),
        model,
        NotImplementedError,
        r"0-dim parameters.*one dtype.*lin1\.scale: torch\.float64, lin2\.scale: torch\.float32",
    )


def _case_grad_dtype_not_floating(mesh, ws: int) -> _Case:
    model = _TwoLinear()
    model.lin2.weight.grad_dtype = torch.int64
    return (
        lambda: fully_shard(model, mesh=mesh),
        model,
        ValueError,
        r"parameter lin2\.weight has grad_dtype=torch\.int64, not a floating-point dtype",
    )


def _case_tied_separate_groups(mesh, ws: int) -> _Case:
    model = _Tied()
    fully_shard(model.emb, mesh=mesh)
    return (
        lambda: fully_shard(model.head, mesh=mesh),
        model.head,
        ValueError,
        r"parameter weight is shared with fully_shard\(Embedding\).*fully_shard\(\[a, b\]\)",
    )


def _case_tied_root(mesh, ws: int) -> _Case:
    model = _Tied()
    fully_shard(model.emb, mesh=mesh)
    return (
        lambda: fully_shard(model, mesh=mesh),
        model.head,
        ValueError,
        r"parameter head\.weight is shared with fully_shard\(Embedding\)",
    )


def _case_dtensor_param(mesh, ws: int) -> _Case:
    m = nn.Linear(4, 2)
    m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Shard(1)]))
    return (
        lambda: fully_shard(m, mesh=mesh),
        m,
        ValueError,
        r"parameter weight is a DTensor on mesh .* not another dimension",
    )


def _case_deepcopy(mesh, ws: int) -> _Case:
    model = _TwoLinear()
    fully_shard(model.lin1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return lambda: copy.deepcopy(model), model, TypeError, r"FSDP_TwoLinear.*state dict"


def _case_deepcopy_child(mesh, ws: int) -> _Case:
    model = _TwoLinear()
    fully_shard(model.lin1, mesh=mesh)
    return lambda: copy.deepcopy(model), model, TypeError, r"FSDPLinear.*state dict"


def _case_forward_prefetch_non_fsdp(mesh, ws: int) -> _Case:
    model = _TwoLinear()
    fully_shard(model.lin1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model, FSDPModule)
    return (
        lambda: model.set_modules_to_forward_prefetch([model.lin1, model.lin2]),
        model,
        ValueError,
        r"FSDP modules.*got Linear",
    )


def _case_backward_prefetch_non_fsdp(mesh, ws: int) -> _Case:
    model = _TwoLinear()
    fully_shard(model.lin1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model, FSDPModule)
    return (
        lambda: model.set_modules_to_backward_prefetch([model.lin2]),
        model,
        ValueError,
        r"FSDP modules.*got Linear",
    )


def _case_set_reshard_after_forward_int(mesh, ws: int) -> _Case:
    model = _TwoLinear()
    fully_shard(model, mesh=mesh)
    assert isinstance(model, FSDPModule)
    return (
        lambda: model.set_reshard_after_forward(2),
        model,
        ValueError,
        r"reshard_after_forward should be a bool, got int",
    )


def _case_forward_method_missing(mesh, ws: int) -> _Case:
    model = _TwoLinear()
    fully_shard(model, mesh=mesh)
    return (
        lambda: register_fsdp_forward_method(model, "generate"),
        model,
        ValueError,
        r"FSDP_TwoLinear has no method 'generate'",
    )


_CASES = sorted(name.removeprefix("_case_") for name in dir() if name.startswith("_case_"))


def _run_case(name: str, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    action, module, exc, match = globals()[f"_case_{name}"](mesh, world_size)
    before = _snapshot(module) if module is not None else None
    with pytest.raises(exc, match=match):
        action()
    if module is not None:
        assert _snapshot(module) == before, f"{name}: the failed call changed the module"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", _CASES)
def test_error(case: str, world_size: int) -> None:
    run_on_ranks(world_size, _run_case, case, world_size)


def _fixed_after_failure(world_size: int) -> None:
    """After an error (a grad_dtype that is not floating-point), fixing it and retrying
    works and trains."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = _TwoLinear()
    model.lin2.weight.grad_dtype = torch.int64
    with pytest.raises(ValueError, match="not a floating-point dtype"):
        fully_shard(model, mesh=mesh)
    model.lin2.weight.grad_dtype = torch.float32
    fully_shard(model, mesh=mesh)
    assert type(model).__name__ == "FSDP_TwoLinear"
    assert all(isinstance(p, DTensor) for p in model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_retry_after_failed_fully_shard(world_size: int) -> None:
    run_on_ranks(world_size, _fixed_after_failure, world_size)


# ---------------------------------------------------------------------------------------------
# Local: policies, and mesh=None without a process group

_DTYPE_FIELDS = ["param_dtype", "reduce_dtype", "output_dtype"]


@pytest.mark.parametrize("field", _DTYPE_FIELDS)
def test_mixed_precision_dtype_not_a_dtype(field: str) -> None:
    with pytest.raises(TypeError, match=rf"MixedPrecisionPolicy\.{field} must be a torch\.dtype"):
        MixedPrecisionPolicy(**{field: "bf16"})


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
@pytest.mark.parametrize("field", _DTYPE_FIELDS)
def test_mixed_precision_dtype_not_floating(field: str, dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=rf"MixedPrecisionPolicy\.{field}.*floating.*{dtype}"):
        MixedPrecisionPolicy(**{field: dtype})


def test_mixed_precision_cast_forward_inputs_not_bool() -> None:
    with pytest.raises(TypeError, match=r"cast_forward_inputs must be a bool, got 'yes'"):
        MixedPrecisionPolicy(cast_forward_inputs="yes")


def test_cpu_offload_pin_memory_not_bool() -> None:
    with pytest.raises(TypeError, match=r"CPUOffloadPolicy\.pin_memory must be a bool"):
        CPUOffloadPolicy(pin_memory=1)


def test_policies_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        MixedPrecisionPolicy().param_dtype = torch.float16  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        CPUOffloadPolicy().pin_memory = False  # type: ignore[misc]
    assert isinstance(CPUOffloadPolicy(), OffloadPolicy)


def test_valid_policies_construct() -> None:
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float16, False)
    assert (mp.param_dtype, mp.reduce_dtype, mp.output_dtype) == (
        torch.bfloat16,
        torch.float32,
        torch.float16,
    )
    assert MixedPrecisionPolicy() == MixedPrecisionPolicy(None, None, None, True)


@pytest.mark.skipif(dist.is_initialized(), reason="a process group is initialized here")
def test_default_mesh_without_process_group() -> None:
    m = nn.Linear(2, 2)
    before = _snapshot(m)
    with pytest.raises(ValueError, match=r"mesh=None.*init_process_group"):
        fully_shard(m)
    assert _snapshot(m) == before
