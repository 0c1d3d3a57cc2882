"""The package's shape, read from its source with ``ast`` (one process, no collectives):

* the import graph of ``fsdp2/`` has no cycle, counting imports under ``TYPE_CHECKING`` and
  inside functions;
* the layers of ``fsdp2/_core/`` import downwards only, in the order of ``LAYERS``: no
  module below the group layer imports the group (so none can call a ``ParamGroup``
  method), and the step layer does not import the state layer;
* exactly one function issues all-gathers (``collectives.all_gather``): every call of an
  all-gather primitive (``all_gather_single`` / ``all_gather_into_tensor``, gloo's
  exchanges) is inside it, and every other module calls it; the same for reduce-scatters
  (``collectives.reduce_scatter``) and all-reduces (``collectives.all_reduce``);
* no file in ``fsdp2/`` is over 500 lines;
* no one-letter aliases of fsdp2's modules (``from fsdp2._core import collectives as C``).
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import fsdp2

PACKAGE = pathlib.Path(fsdp2.__file__).parent

# fsdp2/_core from top to bottom: a module may import only modules of its own layer or
# below (within a layer: no cycle, checked by the cycle test).
LAYERS = [
    ["replicate", "piece_state"],
    ["sharding", "module", "seam", "state_dict"],
    ["state", "tree_checks", "placement"],
    ["step", "relayout", "higher_order"],
    ["slot"],
    ["reduce"],
    ["piece_grad"],
    ["pieces"],
    ["group"],
    ["layout", "small_shard"],
    ["param", "extension"],
    ["collectives"],
    ["gloo", "transport", "exact"],
    ["mesh", "settings", "storage", "labels", "debug", "unsharded", "clean_exit", "pipeline"],
    ["observe", "compat"],
]
BELOW_GROUP = {m for layer in LAYERS[LAYERS.index(["group"]) + 1 :] for m in layer}


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


def test_core_layers_import_downwards() -> None:
    layer_of = {f"fsdp2._core.{m}": i for i, layer in enumerate(LAYERS) for m in layer}
    core = {m for m in _modules() if m.startswith("fsdp2._core.")}
    assert core == set(layer_of), f"modules missing from LAYERS: {core ^ set(layer_of)}"
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
        assert "fsdp2._core.group" not in graph[f"fsdp2._core.{m}"], m
        tree = ast.parse((PACKAGE / "_core" / f"{m}.py").read_text())
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
    entry = "fsdp2._core.collectives"
    transports = {"fsdp2._core.gloo", "fsdp2._core.compat", "fsdp2._core.transport"}
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
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
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
