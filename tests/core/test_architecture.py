"""The package's shape, read from its source with ``ast`` (one process, no collectives):

* the import graph of ``fsdp2/`` has no cycle, counting imports under ``TYPE_CHECKING`` and
  inside functions, and no import runs back up: the package's parts stand in ``FLOORS``
  (the command line over the layers built on the engine over the public modules over the
  engine), and a part imports only its own floor or those below;
* ``fsdp2/_core/`` is in wings (``WINGS``, folders): each module in the wing its folder
  says; a wing imports only itself and the wings below it; the engine's face
  (``fsdp2/_core/__init__.py``) imports none of them; at most 10 files directly in
  ``_core/`` and 12 in a wing;
* inside the wings, the layers import downwards only, in the order of ``LAYERS``: no module
  below the group layer imports the group (so none can call a ``ParamGroup`` method), and
  the step layer does not import the state layer;
* exactly one function issues all-gathers (``collectives.all_gather``): every call of an
  all-gather primitive (``all_gather_single`` / ``all_gather_into_tensor``, gloo's
  exchanges) is inside it, and every other module calls it; the same for reduce-scatters
  (``collectives.reduce_scatter``) and all-reduces (``collectives.all_reduce``);
* no file in ``fsdp2/`` or ``benchmarks/`` is over 500 lines;
* no one-letter aliases of fsdp2's modules (``from fsdp2._core import collectives as C``).
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import fsdp2

PACKAGE = pathlib.Path(fsdp2.__file__).parent

# fsdp2/_core's wings, from the top down: a wing imports its own modules and the wings below.
WINGS = ["front", "runtime", "replicas", "params", "comm", "support"]

# Inside the wings, the layers from the top down: a module imports its own layer or below
# (within a layer: no cycle, checked by the cycle test). Each wing is a run of layers.
LAYERS = [
    ["front.replicate"],
    [
        "front.sharding",
        "front.module",
        "front.handles",
        "front.gradients",
        "front.seam",
        "front.state_dict",
        "front.pipelining",
        "front.offload",
    ],
    ["runtime.state", "runtime.tree_checks", "runtime.pending"],
    ["runtime.step", "runtime.relayout", "runtime.higher_order"],
    ["runtime.slot"],
    ["runtime.reduce"],
    ["replicas.piece_state"],
    ["replicas.piece_grad"],
    ["replicas.pieces"],
    ["params.group"],
    [
        "params.layout",
        "params.small_shard",
        "params.placement",
        "params.residence",
        "params.dtypes",
        "params.views",
    ],
    ["params.faces"],
    ["params.param", "params.extension"],
    ["params.storage"],
    ["comm.collectives"],
    ["comm.gloo", "comm.transport", "comm.exact"],
    [
        "support.mesh",
        "support.settings",
        "support.labels",
        "support.debug",
        "support.unsharded",
        "support.clean_exit",
        "support.pipeline",
    ],
    ["support.observe", "support.compat"],
]
GROUP = "params.group"
BELOW_GROUP = {m for layer in LAYERS[LAYERS.index([GROUP]) + 1 :] for m in layer}

# The package's parts, from the top floor down: a part imports its own floor or below (no
# arrow runs back up). A part is a top-level module or folder of fsdp2/.
FLOORS = [
    ["__main__"],
    ["cli"],
    ["integrations", "fsdp1"],
    ["memory", "profiling", "planning"],
    ["reduction", "checkpoint"],
    ["replica_optim", "clip", "fsdp2", "traced"],  # the package's face: ``fsdp2/__init__.py``
    ["optim"],
    ["_core", "models"],
    ["muon", "api", "_version"],
]
# The face re-exports the planning and checkpoint layers at first use (``_LAZY``, PEP 562):
# imported by name from the face's ``__getattr__`` and under ``TYPE_CHECKING``, not when the
# face runs.
LAZY = {("fsdp2", "planning"), ("fsdp2", "checkpoint")}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST, modules: dict[str, pathlib.Path]) -> Iterator[tuple[str, int]]:
    """The fsdp2 modules ``tree`` imports (every import statement, wherever it is)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("fsdp2"):
                    yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp2"):
            assert node.level == 0, f"relative import at line {node.lineno}"
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                yield (sub if sub in modules else node.module or ""), node.lineno


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        graph[name] = {m for m, _ in _imports(tree, modules) if m != name and m in modules}
    return graph


def test_no_import_cycle() -> None:
    graph = _graph()
    # The package's __init__ re-exports from everything (its children import fsdp2.api,
    # not fsdp2): leave it out, as Python itself does for a package being initialised.
    graph = {m: deps - {"fsdp2"} for m, deps in graph.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle = path[path.index(d) :] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fsdp2"


def test_no_import_runs_back_up() -> None:
    floor = {p: i for i, parts in enumerate(FLOORS) for p in parts}
    graph = _graph()
    assert {_part(m) for m in graph} == set(floor), {_part(m) for m in graph} ^ set(floor)
    bad = []
    for m, deps in graph.items():
        for d in deps:
            a, b = _part(m), _part(d)
            if floor[b] < floor[a] and (a, b) not in LAZY:
                bad.append(f"{m} imports {d}: {b} stands above {a}")
    assert not bad, bad


def _wing(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "_core" else None


def test_core_is_in_wings_importing_downwards() -> None:
    core = PACKAGE / "_core"
    top = sorted(p.name for p in core.iterdir() if p.suffix == ".py")
    assert len(top) <= 10, top
    assert sorted(p.name for p in core.iterdir() if p.is_dir() and p.name != "__pycache__") == (
        sorted(WINGS)
    )
    for wing in WINGS:
        files = sorted(p.name for p in (core / wing).glob("*.py"))
        assert "__init__.py" in files and len(files) <= 12, (wing, files)
        face = ast.get_docstring(ast.parse((core / wing / "__init__.py").read_text()))
        assert face and "Imports:" in face, f"_core/{wing}/__init__.py says what it may import"
    rank = {w: i for i, w in enumerate(WINGS)}
    bad = []
    for m, deps in _graph().items():
        if m == "fsdp2._core":
            bad += [f"the engine's face imports {d}" for d in deps if d.startswith("fsdp2._core")]
        w = _wing(m)
        if w is None:
            continue
        for d in deps:
            dw = _wing(d)
            if dw is not None and rank[dw] < rank[w]:
                bad.append(f"{m} imports {d}: the {dw} wing stands above {w}")
            if d.startswith("fsdp2.") and not d.startswith("fsdp2._core") and d != "fsdp2.api":
                bad.append(f"{m} imports {d}, outside the engine")
    assert not bad, bad


def test_core_layers_import_downwards() -> None:
    layer_of = {f"fsdp2._core.{m}": i for i, layer in enumerate(LAYERS) for m in layer}
    core = {m for m in _modules() if _wing(m) is not None}
    assert core == set(layer_of), f"modules missing from LAYERS: {core ^ set(layer_of)}"
    for m in layer_of:
        assert LAYERS[layer_of[m]][0].split(".")[0] == _wing(m), f"{m}: a layer of another wing"
    bad = []
    for m, deps in _graph().items():
        if m not in layer_of:
            continue
        for d in deps:
            if d in layer_of and layer_of[d] < layer_of[m]:
                bad.append(f"{m} imports {d} (a layer above)")
    assert not bad, bad
    graph = _graph()
    for m in BELOW_GROUP:  # nothing below the group can name it, so none calls its methods
        assert f"fsdp2._core.{GROUP}" not in graph[f"fsdp2._core.{m}"], m
        tree = ast.parse((PACKAGE / "_core" / (m.replace(".", "/") + ".py")).read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert "ParamGroup" not in names, m


def _calls(tree: ast.AST) -> Iterator[tuple[str, str, int]]:
    """``(enclosing function, callee as written, line)`` for every call in ``tree``."""

    def walk(node: ast.AST, fn: str) -> Iterator[tuple[str, str, int]]:
        for child in ast.iter_child_nodes(node):
            name = fn
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = child.name
            if isinstance(child, ast.Call):
                yield fn, ast.unparse(child.func), child.lineno
            yield from walk(child, name)

    yield from walk(tree, "<module>")


# The primitives that put an all-gather / reduce-scatter / all-reduce on the wire (the last
# part of the callee's name; c10d's all-reduce as ``dist.all_reduce``).
PRIMITIVES = {
    "all_gather": {
        "all_gather_single",
        "all_gather_into_tensor",
        "all_gather_by_exchange",
        "all_gather_into",
    },
    "reduce_scatter": {
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "reduce_scatter_by_exchange",
        "reduce_scatter_by_all_reduce",
        "reduce_scatter_grads",
        "_reduce_scatter_packed",
    },
    "all_reduce": {"dist.all_reduce"},
}


def _is(callee: str, primitives: set[str]) -> bool:
    return callee in primitives or callee.rpartition(".")[2] in primitives


def test_one_function_issues_each_collective() -> None:
    modules = _modules()
    entry = "fsdp2._core.comm.collectives"
    transports = {
        "fsdp2._core.comm.gloo",
        "fsdp2._core.support.compat",
        "fsdp2._core.comm.transport",
    }
    calls = {
        name: list(_calls(ast.parse(path.read_text())))
        for name, path in modules.items()
        if name.startswith("fsdp2._core")  # the layers on top (fsdp1, checkpoint, clip) have
        # collectives of their own, outside training steps
    }
    for kind, primitives in PRIMITIVES.items():
        # Outside the entry module and the transports it picks from (gloo's exchanges,
        # torch's single-tensor collectives, a custom comm): no primitive is called.
        for m, found in calls.items():
            if m == entry or m in transports:
                continue
            bad = [(fn, c, line) for fn, c, line in found if _is(c, primitives)]
            assert not bad, f"{m} issues a {kind} itself: {bad}"
        # In the entry module: only ``kind`` (and private helpers only it calls) issue it.
        found = calls[entry]
        issuing = {fn for fn, c, _ in found if _is(c, primitives) and fn != kind}
        for helper in issuing:
            assert helper.startswith("_"), f"{entry}.{helper} issues a {kind}"
            callers = {fn for fn, c, _ in found if c == helper}
            assert callers == {kind}, f"{entry}.{helper} is called from {callers}"
        assert any(fn == kind and _is(c, primitives) for fn, c, _ in found), kind


def test_no_file_over_500_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for root in (PACKAGE, PACKAGE.parent / "benchmarks")
        for p in root.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long


def test_no_one_letter_module_aliases() -> None:
    bad = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module = node.module if isinstance(node, ast.ImportFrom) else ""
                for a in node.names:
                    if not (module or a.name).startswith("fsdp2"):
                        continue
                    if a.asname is not None and len(a.asname) == 1:
                        bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {a.asname}")
    assert not bad, bad


def test_the_docs_map_matches_the_tree() -> None:
    """docs/architecture.md's table of files names every file of ``fsdp2/`` and no other, and
    its map names every wing."""
    import re

    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    table = page[page.index("## Files") :]
    table = table[: table.index("\n## ")]
    listed: set[str] = set()
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        for path in re.findall(r"`([\w/<>.]+\.py)`", first):
            wings = WINGS if "<wing>" in path else [""]
            listed |= {path.replace("<wing>", w) for w in wings}
    actual = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    assert not actual - listed, f"files missing from docs/architecture.md: {actual - listed}"
    assert not listed - actual, f"docs/architecture.md lists no such files: {listed - actual}"
    the_map = page[page.index("## The map") : page.index("## What each layer calls")]
    for wing in WINGS:
        assert f"{wing}/" in the_map, f"the map does not show the {wing} wing"


def test_old_private_paths_still_load() -> None:
    """Before the wings every engine module was ``fsdp2._core.<name>``: those paths import the
    moved module, and a pickle naming one (a ``torch.save``d DTensor's mesh cache) loads."""
    import importlib
    import pickle

    from fsdp2._core import _MOVED
    from fsdp2._core.support.mesh import MeshCache

    for name, wing in _MOVED.items():
        old = importlib.import_module(f"fsdp2._core.{name}")
        assert old is importlib.import_module(f"fsdp2._core.{wing}.{name}"), name
    assert isinstance(pickle.loads(b"cfsdp2._core.mesh\nMeshCache\n(tR."), MeshCache)
    core = {p.stem for p in (PACKAGE / "_core").glob("*/*.py") if p.stem != "__init__"}
    assert set(_MOVED) <= core, set(_MOVED) - core  # every old name still has its module
