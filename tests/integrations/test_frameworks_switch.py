"""``fsdp2.integrations.use_fsdp2``: the switch that makes code written for torch's FSDP2 use
fsdp2, and fsdp2 accepting torch's policy objects.

In the test process (no collectives): torch's policies converted by field (and refused when
unknown); the switch puts bridges in torch's public FSDP modules and in loaded modules that
copied torch's objects under the same name (not under another name, not fsdp2's own), is
idempotent, catches modules imported between two calls, is undone everywhere (also in modules
imported while it was on, never in a module that imported fsdp2's names from fsdp2), nests as
a context manager, survives concurrent calls from threads, and ``isinstance`` through the
bridge classes accepts both engines' policies while calling them builds fsdp2's. torch main's
``cpu_offload_by_budget`` and ``GradientReductionHandle`` are added to torch's public module
while on (torch 2.11-2.14 lack them) and removed by the restore; switched and restored like
the rest where torch has them.

On 2 ranks (one spawned run): fsdp2's ``fully_shard`` with torch's ``MixedPrecisionPolicy``
(bf16) and ``OffloadPolicy`` trains bitwise equal to fsdp2's own policies; under the switch,
code calling torch's names shards with fsdp2, ``isinstance(m, FSDPModule)`` holds for modules
of both engines, ``register_fsdp_forward_method`` wraps each engine's module with its own
engine, and sharding a model torch already sharded raises a clear error.
"""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from _harness import run_on_ranks
from helpers import world_mesh
from models import MLPStack, make_batch, rank_slice
from torch.distributed._composable import fsdp as torch_composable_fsdp
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffload
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import OffloadPolicy as TorchOffload
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp2
from fsdp2.api import as_mixed_precision_policy, as_offload_policy
from fsdp2.integrations import is_using_fsdp2, restore_torch_fsdp, use_fsdp2, using_fsdp2

NAMES = (
    "fully_shard",
    "FSDPModule",
    "register_fsdp_forward_method",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
)
TORCH = {n: getattr(torch_fsdp, n) for n in NAMES}


@pytest.fixture(autouse=True)
def _switch_off():
    assert not is_using_fsdp2()
    yield
    restore_torch_fsdp()
    for n in NAMES:
        assert getattr(torch_fsdp, n) is TORCH[n], n


def test_torch_policies_read_by_field() -> None:
    mp = as_mixed_precision_policy(TorchMP(param_dtype=torch.bfloat16, cast_forward_inputs=False))
    assert mp == fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
    assert as_offload_policy(TorchOffload()) == fsdp2.OffloadPolicy()
    assert as_offload_policy(TorchCPUOffload(pin_memory=False)) == fsdp2.CPUOffloadPolicy(False)
    ours = fsdp2.MixedPrecisionPolicy()
    assert as_mixed_precision_policy(ours) is ours

    class DiskOffloadPolicy(TorchOffload):
        pass

    with pytest.raises(TypeError, match="DiskOffloadPolicy.*OffloadPolicy or CPUOffloadPolicy"):
        as_offload_policy(DiskOffloadPolicy())
    with pytest.raises(TypeError, match="mp_policy must be a MixedPrecisionPolicy, got dict"):
        as_mixed_precision_policy({"param_dtype": torch.bfloat16})
    with pytest.raises(ValueError, match="MixedPrecisionPolicy.param_dtype must be a floating"):
        as_mixed_precision_policy(TorchMP(param_dtype=torch.int8))


def _module(name: str, **attrs: object) -> types.ModuleType:
    mod = types.ModuleType(name)
    vars(mod).update(attrs)
    sys.modules[name] = mod
    return mod


def test_switch_patches_and_restores() -> None:
    # a framework's module that copied torch's names at import; a test's alias of them; a
    # script that imported fsdp2's names from fsdp2
    framework = _module("_fw_before", fully_shard=torch_fully_shard, FSDPModule=TorchFSDPModule)
    alias = _module("_fw_alias", torch_fully_shard=torch_fully_shard)
    script = _module("_fw_script", fully_shard=fsdp2.fully_shard)
    try:
        use_fsdp2()
        assert is_using_fsdp2()
        bridges = {n: getattr(torch_fsdp, n) for n in NAMES}
        for mod in (torch_fsdp, torch_composable_fsdp):
            for n in NAMES:
                assert getattr(mod, n) is bridges[n], (mod.__name__, n)
        assert bridges["fully_shard"] is not TORCH["fully_shard"]
        assert framework.fully_shard is bridges["fully_shard"]
        assert framework.FSDPModule is bridges["FSDPModule"]
        assert alias.torch_fully_shard is torch_fully_shard
        assert script.fully_shard is fsdp2.fully_shard

        # the bridge classes: torch's and fsdp2's objects pass; calls build fsdp2's
        MP, CPU = bridges["MixedPrecisionPolicy"], bridges["CPUOffloadPolicy"]
        built = MP(param_dtype=torch.bfloat16)
        assert type(built) is fsdp2.MixedPrecisionPolicy
        assert isinstance(TorchMP(), MP) and isinstance(built, MP)
        assert isinstance(TorchCPUOffload(), bridges["OffloadPolicy"])
        assert not isinstance(TorchOffload(), CPU)
        assert issubclass(TorchFSDPModule, bridges["FSDPModule"])
        assert issubclass(fsdp2.FSDPModule, bridges["FSDPModule"])
        assert not isinstance(nn.Linear(1, 1), bridges["FSDPModule"])

        # idempotent; a module imported between two calls is caught by the second
        late = _module("_fw_late", MixedPrecisionPolicy=TorchMP)
        use_fsdp2()
        assert late.MixedPrecisionPolicy is MP
        assert torch_fsdp.fully_shard is bridges["fully_shard"]
        # a module imported while on copies the bridges; restored with the rest
        during = _module("_fw_during", fully_shard=torch_fsdp.fully_shard)
    finally:
        restore_torch_fsdp()
        for name in ("_fw_before", "_fw_alias", "_fw_script", "_fw_late", "_fw_during"):
            sys.modules.pop(name, None)
    assert not is_using_fsdp2()
    assert framework.fully_shard is torch_fully_shard
    assert framework.FSDPModule is TorchFSDPModule
    assert late.MixedPrecisionPolicy is TorchMP
    assert during.fully_shard is torch_fully_shard
    assert script.fully_shard is fsdp2.fully_shard
    assert torch_composable_fsdp.fully_shard is torch_fully_shard
    restore_torch_fsdp()  # a no-op when off


MAIN_NAMES = ("cpu_offload_by_budget", "GradientReductionHandle")


def test_torch_main_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch main's ``cpu_offload_by_budget`` and ``GradientReductionHandle``: in
    ``torch.distributed.fsdp`` while the switch is on, added where torch lacks them (2.11-2.14)
    and removed by ``restore_torch_fsdp``; where torch has them, switched and restored like
    the other names (a torch main stood in for by names patched into torch's module)."""
    from fsdp2.integrations._switch import _Switch

    lacks = [n for n in MAIN_NAMES if not hasattr(torch_fsdp, n)]
    script = _module("_fw_main_script", cpu_offload_by_budget=fsdp2.cpu_offload_by_budget)
    try:
        with using_fsdp2():
            from torch.distributed.fsdp import (  # code written for torch main
                GradientReductionHandle,
                cpu_offload_by_budget,
            )

            lin = nn.Linear(4, 4)  # weight 64 bytes, bias 16
            assert cpu_offload_by_budget(lin, 70) == {"weight": fsdp2.CPUOffloadPolicy()}
            got = cpu_offload_by_budget(lin, 80, pin_memory=False)
            assert got == dict.fromkeys(["weight", "bias"], fsdp2.CPUOffloadPolicy(False))
            assert cpu_offload_by_budget is not fsdp2.cpu_offload_by_budget
            assert isinstance(fsdp2.GradientReductionHandle(), GradientReductionHandle)
            with pytest.raises(ValueError, match="non-negative"):
                cpu_offload_by_budget(lin, -1)
        for name in lacks:
            assert not hasattr(torch_fsdp, name), name
        assert script.cpu_offload_by_budget is fsdp2.cpu_offload_by_budget  # fsdp2's own kept
    finally:
        sys.modules.pop("_fw_main_script", None)

    # a torch that has them (torch main): switched where copied, torch's put back
    def torch_budget(module: nn.Module, budget_bytes: int, *, pin_memory: bool = True) -> dict:
        return {}

    class TorchHandle:
        pass

    monkeypatch.setattr(torch_fsdp, "cpu_offload_by_budget", torch_budget, raising=False)
    monkeypatch.setattr(torch_fsdp, "GradientReductionHandle", TorchHandle, raising=False)
    framework = _module("_fw_main_copy", cpu_offload_by_budget=torch_budget)
    switch = _Switch()  # (the process's switch captured this torch's objects already)
    try:
        switch.turn_on()
        bridge = switch.bridges["cpu_offload_by_budget"]
        assert torch_fsdp.cpu_offload_by_budget is bridge is framework.cpu_offload_by_budget
        assert bridge(nn.Linear(4, 4), 64) == {"weight": fsdp2.CPUOffloadPolicy()}
        handle = torch_fsdp.GradientReductionHandle
        assert isinstance(TorchHandle(), handle)
        assert isinstance(fsdp2.GradientReductionHandle(), handle)
    finally:
        switch.turn_off()
        sys.modules.pop("_fw_main_copy", None)
    assert torch_fsdp.cpu_offload_by_budget is torch_budget
    assert torch_fsdp.GradientReductionHandle is TorchHandle
    assert framework.cpu_offload_by_budget is torch_budget


def test_context_manager_nests_and_threads() -> None:
    with using_fsdp2():
        inner_bridge = torch_fsdp.fully_shard
        with using_fsdp2():
            assert torch_fsdp.fully_shard is inner_bridge
        assert is_using_fsdp2() and torch_fsdp.fully_shard is inner_bridge  # outer still on
    assert not is_using_fsdp2() and torch_fsdp.fully_shard is torch_fully_shard
    with pytest.raises(ZeroDivisionError), using_fsdp2():
        1 / 0  # noqa: B018
    assert not is_using_fsdp2()

    errors: list[BaseException] = []

    def flip() -> None:
        try:
            for _ in range(20):
                use_fsdp2()
                restore_torch_fsdp()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=flip) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    use_fsdp2()  # after the storm, on and off still land where they should
    assert torch_fsdp.fully_shard is inner_bridge
    restore_torch_fsdp()


def _train(model: nn.Module, rank: int, steps: int = 3) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = make_batch("mlp", step)
        loss = nn.functional.mse_loss(model(rank_slice(x, rank, 2)).float(), rank_slice(y, rank, 2))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


class _WithMethod(MLPStack):
    def predict(self, x: torch.Tensor) -> torch.Tensor:  # not forward: needs registering
        return self.head(x)  # the root's own parameter


def _switch_on_ranks() -> dict[str, object]:
    import torch.distributed as dist

    rank = dist.get_rank()
    mesh = world_mesh()
    mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    out: dict[str, object] = {}
    runs = {}
    for kind in ("fsdp2", "torch-policies"):
        torch.manual_seed(0)
        model = MLPStack((7, 6, 1))
        policies = (
            {"mp_policy": fsdp2.MixedPrecisionPolicy(**mp), "offload_policy": fsdp2.OffloadPolicy()}
            if kind == "fsdp2"
            else {"mp_policy": TorchMP(**mp), "offload_policy": TorchOffload()}
        )
        for block in model.layers:
            fsdp2.fully_shard(block, mesh=mesh, **policies)
        fsdp2.fully_shard(model, mesh=mesh, **policies)
        runs[kind] = _train(model, rank)
    out["policies_equal"] = runs["fsdp2"] == runs["torch-policies"]

    torch.manual_seed(0)
    torch_model = _WithMethod((7, 6, 1), head_dim=3)
    torch_fully_shard(torch_model, mesh=mesh)  # sharded by torch before the switch
    with using_fsdp2():
        FSDPModule = torch_fsdp.FSDPModule
        torch.manual_seed(0)
        model = _WithMethod((7, 6, 1), head_dim=3)
        for block in model.layers:  # code written for torch's FSDP2, through torch's names
            torch_fsdp.fully_shard(block, mesh=mesh, mp_policy=torch_fsdp.MixedPrecisionPolicy())
        torch_composable_fsdp.fully_shard(model, mesh=mesh)
        out["fsdp2_sharded"] = isinstance(model, fsdp2.FSDPModule)
        out["isinstance_both"] = isinstance(model, FSDPModule) and isinstance(
            torch_model, FSDPModule
        )
        x = torch.ones(2, 1)
        for m in (model, torch_model):
            torch_fsdp.register_fsdp_forward_method(m, "predict")
            out[f"predict_{type(m).__name__}"] = tuple(m.predict(x).shape)
        try:
            torch_fsdp.fully_shard(torch_model, mesh=mesh)
            out["late_error"] = None
        except RuntimeError as e:
            out["late_error"] = str(e)
        model.reshard()  # predict() left the root's parameters registered unsharded
        out["trained"] = len(_train(model, rank))
    out["restored"] = torch_fsdp.fully_shard is torch_fully_shard
    return out


def test_switch_on_two_ranks() -> None:
    for out in run_on_ranks(2, _switch_on_ranks):
        assert out["policies_equal"], out
        assert out["fsdp2_sharded"] and out["isinstance_both"], out
        assert out["predict_FSDP_WithMethod"] == (2, 3), out
        assert "sharded by torch's fully_shard" in str(out["late_error"]), out
        assert "Call use_fsdp2() before" in str(out["late_error"]), out
        assert out["trained"] == 3 and out["restored"], out


def test_transformers_module_loaded_before_the_switch() -> None:
    """transformers' ``distributed.fsdp`` copies ``fully_shard`` and the policies when it
    loads (``from_pretrained(..., distributed_config=...)`` uses them): switched in place."""
    fsdp_mod = pytest.importorskip("transformers.distributed.fsdp")
    assert fsdp_mod.fully_shard is torch_fully_shard
    with using_fsdp2():
        assert fsdp_mod.fully_shard is torch_fsdp.fully_shard is not torch_fully_shard
        assert fsdp_mod.MixedPrecisionPolicy is torch_fsdp.MixedPrecisionPolicy
    assert fsdp_mod.fully_shard is torch_fully_shard


def test_docs_snippets_run() -> None:
    """Every Python block of docs/frameworks.md runs, in order, in one namespace."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[2] / "docs" / "frameworks.md").read_text()
    # not the excerpts of the tests (test_recipes.py holds them to their files)
    blocks = re.findall(r"(?<!-->\n)```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 3, len(blocks)
    namespace: dict[str, object] = {}
    try:
        for block in blocks:
            exec(compile(block, "docs/frameworks.md", "exec"), namespace)
    finally:
        restore_torch_fsdp()
        if "PartialState" in namespace:  # the CPU setup block: accelerate's shared state
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state(True)
            GradientState._reset_state()


def test_torch_modules_imported_while_on_keep_torchs_engine() -> None:
    """A torch module imported while the switch is on (torch's pipelining, imported by a
    framework) copies the bridge from torch's public module: torch's own calls on it
    (``fully_shard.state(module)``, in ``PipelineStage.perform_reduce_grad``) still reach
    torch's, and ``restore_torch_fsdp`` gives it torch's object back."""
    import sys
    import types

    import torch.distributed.fsdp as torch_fsdp

    torch_fully_shard = torch_fsdp.fully_shard
    with using_fsdp2():
        copy = types.ModuleType("torch._fsdp2_switch_test")
        exec("from torch.distributed.fsdp import fully_shard", copy.__dict__)
        sys.modules[copy.__name__] = copy
        try:
            assert copy.fully_shard is not torch_fully_shard
            assert copy.fully_shard.state is torch_fully_shard.state
        except BaseException:
            del sys.modules[copy.__name__]
            raise
    try:
        assert copy.fully_shard is torch_fully_shard
    finally:
        del sys.modules[copy.__name__]
