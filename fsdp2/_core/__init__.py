"""The engine behind ``fully_shard`` (private: the public names are in ``fsdp2``), in wings.

Each wing is a folder whose face says what it owns and what it may import; the imports run
one way, from the top wing down (docs/architecture.md draws the map and walks a step
through it; tests/core/test_architecture.py holds the rules)::

    front      fully_shard, the FSDPModule mixin, replicate, state-dict hooks, the seam
      |
    runtime    the step: states, slots, StepContext, reduction, double backward, relayout
      |
    replicas   HSDP's gradients and optimizer state in pieces over the replicas
      |
    params     a parameter's and a group's storage: unshard / reshard, placement, subclasses
      |
    comm       one function per collective, gloo's paths, transport, sums in a fixed order
      |
    support    meshes, settings, observers, labels, debug, compat, the optimizer check

Before the wings every module lived here: ``fsdp2._core.<name>`` still imports the module
that moved (``_MOVED``), so a pickle that names one (a ``torch.save``d DTensor's mesh cache,
``fsdp2._core.mesh.MeshCache``) and code holding the old private path keep loading.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

# the modules of the flat folder, and their wings
_MOVED = {
    **dict.fromkeys(
        (
            "clean_exit",
            "compat",
            "debug",
            "labels",
            "mesh",
            "observe",
            "pipeline",
            "settings",
            "unsharded",
        ),
        "support",
    ),  # fmt: skip
    **dict.fromkeys(("collectives", "exact", "gloo", "transport"), "comm"),
    **dict.fromkeys(
        ("extension", "group", "layout", "param", "placement", "small_shard", "storage"), "params"
    ),
    **dict.fromkeys(("pieces", "piece_grad", "piece_state"), "replicas"),
    **dict.fromkeys(
        ("higher_order", "reduce", "relayout", "slot", "state", "step", "tree_checks"), "runtime"
    ),
    **dict.fromkeys(("module", "replicate", "seam", "sharding", "state_dict"), "front"),
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``fsdp2._core.<name>`` -> ``fsdp2._core.<wing>.<name>``: the same module object."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        parent, _, name = fullname.rpartition(".")
        if parent != __name__ or name not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        name = spec.name.rpartition(".")[2]
        return importlib.import_module(f"{__name__}.{_MOVED[name]}.{name}")

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module ran when its wing imported it


if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
    sys.meta_path.append(_OldPaths())
