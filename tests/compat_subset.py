"""The compatibility subset: what ``make compat`` runs on the other supported torch releases.

CI runs the whole suite on torch 2.13 and this subset on 2.11 and 2.14, chosen by what
differs between the releases, not by feature:

* ``SWITCHES``: each of ``fsdp2/_core/support/compat.py``'s switches (``compat.SWITCHES``),
  the tests that take fsdp2 through it on every release (both of its sides are reached on
  one release or the other). tests/core/support/test_compat.py fails when a switch has no
  test here, or when fsdp2 checks the torch release outside compat.py.
* ``PRIVATE``: the private torch APIs fsdp2 leans on (docs/architecture.md, "Private torch
  APIs in use"), grouped by what a release may change under them, one test or file each:
  the paths most likely to break on another release that the switches do not name.
* ``TORCH_SIDE``: the tests whose reference, torch's FSDP2, differs between the releases
  (features torch gained in 2.13: they skip where torch lacks them, and run fsdp2's side).

``python tests/compat_subset.py`` prints the subset (the Makefile's ``COMPAT_TESTS``).
"""

from __future__ import annotations

SWITCHES: dict[str, list[str]] = {
    # all_gather_single (2.13+) or all_gather_into_tensor: every all-gather
    "AG_API": ["tests/core/test_parity.py"],
    # reduce_scatter_single (2.13+) or reduce_scatter_tensor: every reduce-scatter
    "RS_API": ["tests/core/test_parity.py"],
    # a DTensor subclass's own __torch_dispatch__ (2.13+) or the torch-function checks
    "DTENSOR_SUBCLASS_DISPATCH": ["tests/core/replicas/test_replica_grads.py"],
    # Tensor.grad_dtype (2.13+): gradient dtypes of their own, or each parameter's dtype
    "GRAD_DTYPE": ["tests/core/params/test_grad_dtype.py"],
}

PRIVATE: dict[str, list[str]] = {
    # DTensor(local, spec), _local_tensor / _spec, DTensorSpec, TensorMeta; mixed precision's
    # casts around them
    "DTensor internals": ["tests/core/params/test_mixed_precision.py"],
    # DeviceMesh._flatten / _unflatten / _concatenate, _StridedShard: HSDP, dp_mesh_dims, TP
    "mesh internals": [
        "tests/core/params/test_dp_mesh_dims.py",
        "tests/integrations/test_tensor_parallel.py::test_fsdp_tp_layout_and_parity",
    ],
    # per-parameter meshes and Replicate() placements (groups per process group)
    "per-parameter meshes": ["tests/core/params/test_per_param_mesh.py"],
    # a Partial DTensor cast and redistributed (functional all_reduce) in reduce_dtype;
    # _chunk_cat packing gradients of several dtypes
    "TP gradients in reduce_dtype": ["tests/integrations/test_tp_reduce_dtype.py"],
    # the autograd engine's final callback, _current_graph_task_id, Tensor._version,
    # _use_count, the storage use count, the Python references a tensor's object gains
    "autograd and storage internals": [
        "tests/core/front/test_registration.py",
        "tests/core/params/test_saved_tensors_hooks.py",
    ],
    # module._parameters, _is_param, to_empty / .to(): parameters replaced under a group
    "module internals": ["tests/core/params/test_meta_init.py"],
    # FakeTensorMode, the "fake" process group, TorchDispatchMode: estimate_memory
    "fake tensors": ["tests/planning/test_estimate_memory.py"],
    # torch._compile._disable_dynamo: the hooks eager under torch.compile
    "compile": ["tests/integrations/test_compile.py"],
    # the traced mode: torch.ops._c10d_functional in compiled graphs, selective-checkpoint
    # policies, the min-cut partitioner's recompute tags
    "traced mode": ["tests/integrations/test_traced.py::test_traced_parity"],
    # torch.distributed.checkpoint's state dicts and compute_local_shape_and_global_offset
    "checkpoints": [
        "tests/checkpoint/test_torch_state_dict.py",
        "tests/checkpoint/test_full_checkpoint_round_trip.py",
    ],
    # the all-gather extension hooks of tensor subclasses (torchao's float8 weights)
    "all-gather extensions": ["tests/integrations/test_torchao.py::test_float8_llama_parity"],
    # torch.distributed.pipelining's stage and schedule internals fsdp2 wraps
    "pipeline schedules": ["tests/integrations/test_pipelining.py"],
    # the exchanges' all_to_all_single, canonical sums; replica sharding's pieces
    "exact sums and pieces": [
        "tests/core/comm/test_reduction.py",
        "tests/core/runtime/test_deterministic.py",
        "tests/core/replicas/test_replica_optim.py",
    ],
}

TORCH_SIDE: dict[str, list[str]] = {
    # torch's replicate on the FSDP2 engine, ShardPlacementResult (2.13+): the references
    "replicate": ["tests/core/front/test_replicate.py"],
    "experts on meshes of their own": ["tests/integrations/test_moe.py"],
}


def subset() -> list[str]:
    """Every test path or node of the subset, once, in order."""
    seen: dict[str, None] = {}
    for table in (SWITCHES, PRIVATE, TORCH_SIDE):
        for tests in table.values():
            seen.update(dict.fromkeys(tests))
    return list(seen)


if __name__ == "__main__":
    print(" ".join(subset()))
