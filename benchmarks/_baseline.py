"""Another checkout's fsdp2 next to this one, in the same process, for A/B benchmarks
(``overhead.py --baseline DIR``, ``compare.py --baseline DIR``).

``load_baseline(DIR)`` imports DIR/fsdp2 as the package ``fsdp2_baseline``, whichever way it
imports itself. This checkout's ``fsdp2`` modules are set aside in ``sys.modules``, DIR is
put first on ``sys.path``, DIR's ``fsdp2`` and every one of its submodules are imported (so
each ``from fsdp2... import`` inside it binds DIR's modules), then all of them are renamed
``fsdp2_baseline...`` and this checkout's modules put back. What the baseline imports later
(inside a function, at run time) would bind this checkout's modules instead, so a baseline
with such an import on the training path (the engine and the modules a training step uses:
``TRAINING``) is refused: ``runtime_fsdp2_imports`` lists them. The command line, planning,
checkpoints and integrations may import late; a benchmark does not call them.
"""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import sys
import types

__all__ = ["BASELINE", "load_baseline", "runtime_fsdp2_imports"]

BASELINE = "fsdp2_baseline"


def _is_fsdp2(name: str) -> bool:
    return name == "fsdp2" or name.startswith("fsdp2.")


# the baseline's files a training step runs: the engine, the face and what it imports
TRAINING = ("_core", "muon", "__init__.py", "api.py", "optim.py", "clip.py")


def runtime_fsdp2_imports(root: str) -> list[str]:
    """``file:line`` of every absolute ``fsdp2`` import inside a function of the training
    path of ``root``/fsdp2 (``TRAINING``): run after loading, it would bind the wrong
    package."""
    found = []
    for dirpath, _, files in os.walk(os.path.join(root, "fsdp2")):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            part = os.path.relpath(path, os.path.join(root, "fsdp2")).split(os.sep)[0]
            if part not in TRAINING:
                continue
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom) and node.level == 0:
                        mods = [node.module or ""]
                    elif isinstance(node, ast.Import):
                        mods = [alias.name for alias in node.names]
                    else:
                        continue
                    if any(_is_fsdp2(m) for m in mods):
                        found.append(f"{os.path.relpath(path, root)}:{node.lineno}")
    return found


def load_baseline(root: str) -> types.ModuleType:
    """Import ``root``/fsdp2 as ``fsdp2_baseline`` (see the module docstring)."""
    if BASELINE in sys.modules:
        return sys.modules[BASELINE]
    if not os.path.isfile(os.path.join(root, "fsdp2", "__init__.py")):
        raise ValueError(f"--baseline: no fsdp2 package under {root}")
    late = runtime_fsdp2_imports(root)
    if late:
        raise ValueError(
            f"--baseline: {root}'s fsdp2 imports fsdp2 inside functions ({', '.join(late[:3])}"
            f"{', ...' if len(late) > 3 else ''}); loaded as {BASELINE} those would run this "
            "checkout's code"
        )
    ours = {k: v for k, v in sys.modules.items() if _is_fsdp2(k)}
    for k in ours:
        del sys.modules[k]
    sys.path.insert(0, os.path.abspath(root))
    try:
        package = importlib.import_module("fsdp2")
        for info in pkgutil.walk_packages(package.__path__, "fsdp2."):
            if info.name.rpartition(".")[2] != "__main__":  # a command: it would run
                importlib.import_module(info.name)
        theirs = {k: v for k, v in sys.modules.items() if _is_fsdp2(k)}
    finally:
        sys.path.remove(os.path.abspath(root))
        for k in [k for k in sys.modules if _is_fsdp2(k)]:
            del sys.modules[k]
        sys.modules.update(ours)
    for k, v in theirs.items():
        sys.modules[BASELINE + k[len("fsdp2") :]] = v
    return sys.modules[BASELINE]
