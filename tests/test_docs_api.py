"""docs/api.md agrees with the code.

* Every call signature written in backticks where api.md declares one (headings, the first
  cell of a table row, the code spans that open a list item up to its first ``:``) must
  name a public fsdp2 object, and match ``inspect.signature`` of it: the same parameters
  in the same order (``self`` may be left out), the same kinds (a ``*`` before keyword-only
  ones) and the same defaults. ``...`` in place of parameters is not accepted there: write
  them all. Elsewhere in the text, a signature-like span (``name(a, b=1)``) whose name is a
  public fsdp2 object is held to the same rule; spans with ``...``, literal arguments or
  empty parentheses there are uses, not signatures, and are not checked.
* Every name in ``fsdp2.__all__``, in the ``__all__`` of every public (non-underscore)
  module under ``fsdp2``, and every public ``FSDPModule`` method is mentioned in api.md
  (as a code span, possibly qualified).

Failures name the doc line and what differs, documented against code.
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import operator
import pkgutil
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdp2

API_MD = Path(__file__).resolve().parents[1] / "docs" / "api.md"
DOC = "docs/api.md"

# Signatures in api.md that are meant not to match fsdp2's code: span text -> why.
ALLOWED = {
    "ShardPlacementResult(placement, mesh_info)": (
        "torch's ShardPlacementResult, named beside fsdp2's to say fully_shard accepts it"
    ),
}

# Public modules whose __all__ need not be mentioned in api.md: module -> why.
NOT_API = {
    "fsdp2.planning.stage": "the estimator's pipeline-stage step; estimate_memory's to call",
    "fsdp2.planning.tracker": (
        "the memory estimator's internal dispatch mode; its __all__ feeds "
        "fsdp2.planning.estimate (PARTS is checked there)"
    ),
}


# ---------------------------------------------------------------------------------------
# The public namespaces


def _public_modules() -> dict[str, types.ModuleType]:
    mods: dict[str, types.ModuleType] = {"fsdp2": fsdp2}
    for info in pkgutil.walk_packages(fsdp2.__path__, "fsdp2."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            mods[info.name] = importlib.import_module(info.name)
    return mods


MODULES = _public_modules()


def _public_names(module: types.ModuleType) -> list[str]:
    return list(getattr(module, "__all__", ()))


def _fsdp2_attr(cls: type, name: str) -> bool:
    """``name`` is defined on ``cls`` by fsdp2's own code (not inherited from torch)."""
    return any(
        name in vars(k) for k in cls.__mro__ if getattr(k, "__module__", "").startswith("fsdp2")
    )


def _getattr_chain(obj: Any, parts: list[str]) -> Any:
    for part in parts:
        obj = getattr(obj, part)
    return obj


_MISSING = object()


def resolve(name: str, scope: Any = None) -> tuple[Any, str] | None:
    """The object a documented ``name`` means and its qualified name, or None.

    ``fsdp2.a.b`` is looked up as written. A bare name is looked up in the section's
    namespace (``scope``: the module or class its heading names), then in the ``__all__``
    of fsdp2 and of every public module, then among the methods fsdp2 defines on the
    classes those export (``allocate`` -> ``fsdp2.AllGather.allocate``).
    """
    parts = name.split(".")
    if parts[0] == "fsdp2":
        for i in range(len(parts), 0, -1):
            mod = MODULES.get(".".join(parts[:i]))
            if mod is not None:
                try:
                    return _getattr_chain(mod, parts[i:]), name
                except AttributeError:
                    return None
        return None
    scopes: list[tuple[Any, str]] = []
    if scope is not None:
        scopes.append(scope)
    scopes += [(m, n) for n, m in MODULES.items()]
    for obj, qual in scopes:
        if isinstance(obj, types.ModuleType) and parts[0] not in _public_names(obj):
            continue
        try:
            return _getattr_chain(obj, parts), f"{qual}.{name}"
        except AttributeError:
            pass
        if obj is fsdp2.FSDPModule:  # every FSDP module is also an nn.Module
            try:
                return _getattr_chain(torch.nn.Module, parts), f"torch.nn.Module.{name}"
            except AttributeError:
                pass
    for mod_name, mod in MODULES.items():
        for export in _public_names(mod):
            cls = getattr(mod, export)
            if isinstance(cls, type) and _fsdp2_attr(cls, parts[0]):
                return _getattr_chain(cls, parts), f"{mod_name}.{export}.{name}"
    return None


# ---------------------------------------------------------------------------------------
# Reading api.md


@dataclass
class Span:
    text: str  # the code span's content, line breaks as spaces
    line: int  # 1-based line of api.md where it starts
    declares: bool  # in a place where api.md declares a signature
    scope: tuple[Any, str] | None  # the namespace of its section


_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
_HEADING = re.compile(r"^(#{1,6})\s")
_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s+")


def _spans(text: str) -> list[tuple[int, int, str]]:
    out = []
    for m in _SPAN.finditer(text):
        content = m.group(2).replace("\n", " ")
        if content.startswith(" ") and content.endswith(" ") and content.strip():
            content = content[1:-1]
        out.append((m.start(), m.end(), content))
    return out


def _outside(
    text: str, spans: list[tuple[int, int, str]], chars: str, start: int = 0
) -> int | None:
    """Index of the first of ``chars`` from ``start`` on, outside code spans and
    parentheses, or None."""
    depth = 0
    inside = {i for s, e, _ in spans for i in range(s, e)}
    for i in range(start, len(text)):
        c = text[i]
        if i in inside:
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth = max(0, depth - 1)
        elif c in chars and depth == 0:
            return i
    return None


def read_api_md(text: str) -> list[Span]:
    """Every code span of api.md outside fenced blocks, with where it stands."""
    blocks: list[tuple[int, str, str]] = []  # (first line, kind, text)
    fence = None
    current: list[str] = []
    start = 0
    kind = ""

    def flush() -> None:
        if current:
            blocks.append((start, kind, "\n".join(current)))
            current.clear()

    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            continue
        if stripped.startswith(("```", "~~~")):
            flush()
            fence = stripped[:3]
            continue
        if not stripped:
            flush()
            continue
        if _HEADING.match(line) or stripped.startswith("|"):
            flush()
            blocks.append((number, "heading" if _HEADING.match(line) else "row", line))
            continue
        if _LIST_ITEM.match(line):
            flush()
            start, kind = number, "item"
        elif not current:
            start, kind = number, "paragraph"
        current.append(line)
    flush()

    out: list[Span] = []
    scope: tuple[Any, str] | None = None
    for first, kind, block in blocks:
        spans = _spans(block)
        if kind == "heading":
            level = len(_HEADING.match(block).group(1))
            if level <= 2:
                scope = None
            if spans and "(" not in spans[0][2]:
                found = resolve(spans[0][2])
                if found is not None and isinstance(found[0], (type, types.ModuleType)):
                    scope = found
            end = len(block)
        elif kind == "row":
            end = _outside(block, spans, "|", block.index("|") + 1) or len(block)
        elif kind == "item":
            body = _LIST_ITEM.match(block).end()
            if not spans or spans[0][0] != body:
                end = -1
            else:
                colon = _outside(block, spans, ":")
                end = len(block) if colon is None else colon
        else:
            end = -1
        for s, _, content in spans:
            line = first + block.count("\n", 0, s)
            out.append(Span(content, line, s < end, scope))
    return out


# ---------------------------------------------------------------------------------------
# Signatures


@dataclass
class DocParam:
    name: str
    kind: inspect._ParameterKind
    default: str | None  # the documented default's text; None: none documented


_CALL = re.compile(r"^(?P<name>[A-Za-z_][\w.]*)\((?P<args>.*)\)(?:\s*->\s*(?P<ret>.+))?$", re.S)
_ELIDED = "..."


def _split_top(args: str) -> list[str]:
    parts, depth, quote, cur = [], 0, "", []
    for c in args:
        if quote:
            quote = "" if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
            continue
        cur.append(c)
    parts.append("".join(cur).strip())
    if parts and parts[-1] == "":
        parts.pop()
    return parts


def _balanced(args: str) -> bool:
    depth = 0
    for c in args:
        depth += c in "([{"
        depth -= c in ")]}"
        if depth < 0:
            return False
    return depth == 0


def parse_call(text: str) -> tuple[str, list[DocParam] | None] | None:
    """(name, parameters) for a span ``name(...)``; parameters None if they are not a
    signature's (literal arguments, ``[op,]``, ...); None if it is no call at all."""
    m = _CALL.match(text.strip())
    if m is None or not _balanced(m.group("args")):
        return None
    params: list[DocParam] = []
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    for piece in _split_top(m.group("args")):
        if piece == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
        elif piece == "/":
            for p in params:
                p.kind = inspect.Parameter.POSITIONAL_ONLY
        elif piece == _ELIDED:
            params.append(DocParam(_ELIDED, kind, None))
        elif piece.startswith("**") and piece[2:].isidentifier():
            params.append(DocParam(piece[2:], inspect.Parameter.VAR_KEYWORD, None))
        elif piece.startswith("*") and piece[1:].isidentifier():
            params.append(DocParam(piece[1:], inspect.Parameter.VAR_POSITIONAL, None))
            kind = inspect.Parameter.KEYWORD_ONLY
        elif piece.isidentifier() and piece not in ("None", "True", "False"):
            params.append(DocParam(piece, kind, None))
        elif "=" in piece and piece.split("=", 1)[0].strip().isidentifier():
            name, default = (s.strip() for s in piece.split("=", 1))
            if not default or default.startswith("="):
                return m.group("name"), None
            params.append(DocParam(name, kind, default))
        else:
            return m.group("name"), None
    return m.group("name"), params


_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
    ast.LShift: operator.lshift,
}


def _evaluate(node: ast.AST) -> Any:
    """A documented default's value: literals, arithmetic, ``torch.x``, public fsdp2 names
    and calls of them with such arguments; _MISSING for anything else."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_evaluate(e) for e in node.elts]
        if any(i is _MISSING for i in items):
            return _MISSING
        return tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _evaluate(node.operand)
        return _MISSING if v is _MISSING else (-v if isinstance(node.op, ast.USub) else v)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _evaluate(node.left), _evaluate(node.right)
        return _MISSING if _MISSING in (a, b) else _BINOPS[type(node.op)](a, b)
    if isinstance(node, (ast.Name, ast.Attribute)):
        dotted = ast.unparse(node)
        if dotted.split(".")[0] == "torch":
            try:
                return _getattr_chain(torch, dotted.split(".")[1:])
            except AttributeError:
                return _MISSING
        found = resolve(dotted)
        return _MISSING if found is None else found[0]
    if isinstance(node, ast.Call) and not any(isinstance(a, ast.Starred) for a in node.args):
        func = _evaluate(node.func)
        args = [_evaluate(a) for a in node.args]
        kwargs = {k.arg: _evaluate(k.value) for k in node.keywords}
        if func is _MISSING or not callable(func) or None in kwargs:
            return _MISSING
        if _MISSING in args or _MISSING in kwargs.values():
            return _MISSING
        try:
            return func(*args, **kwargs)
        except Exception:
            return _MISSING
    return _MISSING


def same_default(documented: str, actual: Any) -> bool:
    if isinstance(actual, enum.Enum) and documented in (
        actual.name,
        f"{type(actual).__name__}.{actual.name}",
    ):
        return True
    try:
        value = _evaluate(ast.parse(documented, mode="eval").body)
    except SyntaxError:
        value = _MISSING
    if value is not _MISSING:
        if value is actual:
            return True
        numbers = all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, actual)
        )
        return (numbers or type(value) is type(actual)) and value == actual
    norm = re.sub(r"\s+", "", documented).replace("'", '"')
    return norm == re.sub(r"\s+", "", repr(actual)).replace("'", '"')


_KIND = {
    inspect.Parameter.POSITIONAL_ONLY: "positional-only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.KEYWORD_ONLY: "keyword-only",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
}


def _show(params: list[inspect.Parameter]) -> str:
    return str(inspect.Signature([p.replace(annotation=inspect.Parameter.empty) for p in params]))


def compare(doc: list[DocParam], obj: Any) -> list[str]:
    """What differs between documented parameters and ``obj``'s signature."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError) as e:
        return [f"the code object {obj!r} has no signature ({e})"]
    code = list(sig.parameters.values())
    if code and code[0].name in ("self", "cls") and not (doc and doc[0].name == code[0].name):
        code = code[1:]
    code_text = _show(code)
    if any(p.name == _ELIDED for p in doc):
        return [f"'...' elides parameters: write them all; code has {code_text}"]
    problems = []
    doc_names = [p.name for p in doc]
    code_names = [p.name for p in code]
    if doc_names != code_names:
        missing = [n for n in code_names if n not in doc_names]
        unknown = [n for n in doc_names if n not in code_names]
        what = []
        if unknown:
            what.append(f"documented but not in the code: {', '.join(unknown)}")
        if missing:
            what.append(f"in the code but not documented: {', '.join(missing)}")
        if not what:
            what.append("the order differs")
        problems.append(
            f"parameters: documented ({', '.join(doc_names)}), code {code_text}; " + "; ".join(what)
        )
    by_name = {p.name: p for p in code}
    for d in doc:
        c = by_name.get(d.name)
        if c is None:
            continue
        if d.kind != c.kind:
            problems.append(
                f"`{d.name}`: documented {_KIND[d.kind]}, code {_KIND[c.kind]} (code {code_text})"
            )
        if d.default is None and c.default is not inspect.Parameter.empty:
            problems.append(f"`{d.name}`: documented without a default, code default {c.default!r}")
        elif d.default is not None and c.default is inspect.Parameter.empty:
            problems.append(f"`{d.name}`: documented default {d.default}, code has none")
        elif d.default is not None and not same_default(d.default, c.default):
            problems.append(f"`{d.name}`: documented default {d.default}, code {c.default!r}")
    return problems


@dataclass
class Documented:
    span: Span
    name: str
    params: list[DocParam] | None

    @property
    def id(self) -> str:
        return f"L{self.span.line}-{self.name}"


def documented_signatures() -> list[Documented]:
    out = []
    for span in read_api_md(API_MD.read_text()):
        call = parse_call(span.text)
        if call is None:
            continue
        name, params = call
        if span.declares or span.text in ALLOWED:
            out.append(Documented(span, name, params))
            continue
        # prose: a signature-like span naming a public fsdp2 object (`f(x=...)` is a use)
        if not params or any(_ELIDED in (p.name, p.default) for p in params):
            continue
        if name.startswith("fsdp2.") or resolve(name, span.scope) is not None:
            out.append(Documented(span, name, params))
    return out


SIGNATURES = documented_signatures()


@pytest.mark.parametrize("doc", SIGNATURES, ids=[d.id for d in SIGNATURES])
def test_signature_matches_code(doc: Documented) -> None:
    where = f"{DOC}:{doc.span.line}: `{doc.span.text}`"
    if doc.span.text in ALLOWED:
        return
    if doc.params is None:
        pytest.fail(
            f"{where}: not a signature fsdp2 can check (write `name(param, *, kw=default)`)"
        )
    found = resolve(doc.name, doc.span.scope)
    if found is None:
        pytest.fail(
            f"{where}: `{doc.name}` is no public fsdp2 object (renamed or removed?); "
            f"fix the doc or add it to ALLOWED in {Path(__file__).name} with a reason"
        )
    obj, qualname = found
    problems = compare(doc.params, obj)
    assert not problems, f"{where} vs {qualname}:\n  " + "\n  ".join(problems)


def test_signatures_found() -> None:
    """The reader finds the signatures it must (a change in api.md's layout that hid them
    would otherwise pass)."""
    names = {d.name.rsplit(".", 1)[-1] for d in SIGNATURES}
    for expected in (
        "fully_shard",
        "unshard",
        "set_requires_gradient_sync",
        "MixedPrecisionPolicy",
        "load_full_checkpoint",
        "save_full_checkpoint",
        "step_on_local_shards",
        "shard_model",
        "use_fsdp2",
        "estimate_memory",
        "timeline",
        "set_debug",
    ):
        assert expected in names, f"{DOC}: no signature of `{expected}` found"
    spans = {s.text for s in read_api_md(API_MD.read_text())}
    stale = [text for text in ALLOWED if text not in spans]
    assert not stale, f"ALLOWED lists spans {DOC} no longer has: {stale}"


# ---------------------------------------------------------------------------------------
# Every public name is mentioned


def _mentioned() -> set[str]:
    names: set[str] = set()
    for span in read_api_md(API_MD.read_text()):
        m = re.match(r"[A-Za-z_][\w.]*", span.text.strip())
        if m:
            names.update(m.group(0).split("."))
    return names


MENTIONED = _mentioned()
EXPORTING = [n for n, m in MODULES.items() if hasattr(m, "__all__")]


@pytest.mark.parametrize("module_name", EXPORTING)
def test_public_names_are_documented(module_name: str) -> None:
    if module_name in NOT_API:
        pytest.skip(NOT_API[module_name])
    missing = [n for n in MODULES[module_name].__all__ if n not in MENTIONED]
    for name in MODULES[module_name].__all__:
        assert getattr(MODULES[module_name], name, _MISSING) is not _MISSING, (
            f"{module_name}.__all__ lists {name!r}, which it does not define"
        )
    assert not missing, (
        f"{DOC} does not mention {', '.join(f'{module_name}.{n}' for n in missing)} "
        f"(in {module_name}.__all__): add each as a code span, e.g. `{missing[0]}`"
    )


def test_fsdp_module_methods_are_documented() -> None:
    methods = sorted(
        n
        for k in fsdp2.FSDPModule.__mro__
        if k.__module__.startswith("fsdp2")
        for n, v in vars(k).items()
        if not n.startswith("_") and callable(v)
    )
    missing = [n for n in methods if n not in MENTIONED]
    assert not missing, f"{DOC}'s `FSDPModule` methods table does not mention: {', '.join(missing)}"
