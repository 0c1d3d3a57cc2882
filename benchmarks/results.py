"""The figures the pages quote from docs/results.toml: where each is quoted, and what disagrees.

    python benchmarks/results.py            # every quote that differs from the file (exit 1)
    python benchmarks/results.py --list     # where each figure is quoted
    python benchmarks/results.py --write    # rewrite the differing quotes from the file

A measured figure that more than one page quotes (fsdp2's step as a ratio of torch's FSDP2's,
the pipeline schedules' ratios, the estimate's error, ...) has one entry in docs/results.toml:
its name, its value as the pages write it (``"0.66-0.96x"``), the benchmark command that
measured it, the date and the machine. Each page quoting it marks the quote with an HTML
comment right before the figure, which the site and GitHub do not show:

    at <!-- result: pipeline.step_vs_torch -->0.66-0.96x its step time

The figure is the text after the marker that reads as one (``FIGURE``: a number or a range,
with ``x``, ``%`` or a unit). To change a figure, edit its value in docs/results.toml and run
this script with ``--write`` (or ``tests/test_docs_outputs.py``, which lists each page and
line that quotes another value). See docs/benchmarks.md's introduction.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results.toml"
FIELDS = ("value", "what", "command", "date", "machine")
MARKER = re.compile(r"<!-- result: ([\w.]+) -->")
_NUMBER = r"[~+]?\d[\d,]*(?:\.\d+)?(?:x|%)?"
FIGURE = re.compile(
    _NUMBER + r"(?:-" + _NUMBER + r")?" + r"(?: ?(?:TiB|GiB|MiB|KiB|GB|MB|ms|s|min)(?![\w]))?"
)


def pages() -> list[Path]:
    """The pages that may quote a result: README.md, CHANGELOG.md and docs/*.md."""
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def load(path: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """The results file's entries by dotted name (``pipeline.step_vs_torch``)."""
    with open(path, "rb") as f:
        tree = tomllib.load(f)
    out: dict[str, dict[str, Any]] = {}

    def walk(prefix: str, table: dict[str, Any]) -> None:
        if "value" in table:
            out[prefix] = table
            return
        for key, sub in table.items():
            if not isinstance(sub, dict):
                raise ValueError(f"{path.name}: {prefix}.{key} is neither an entry nor a table")
            walk(f"{prefix}.{key}" if prefix else key, sub)

    walk("", tree)
    return out


def quotes(text: str) -> list[tuple[int, str, str, int, int]]:
    """``(line, name, quoted figure, start, end)`` for each marker in a page's ``text`` (the
    figure's offsets in ``text``; an empty figure when none follows the marker)."""
    out = []
    for m in MARKER.finditer(text):
        if text[m.start() - 1 : m.start()] == "`":  # an example in inline code, not a quote
            continue
        figure = FIGURE.match(text, m.end())
        start, end = (figure.start(), figure.end()) if figure else (m.end(), m.end())
        out.append((text.count("\n", 0, m.start()) + 1, m.group(1), text[start:end], start, end))
    return out


def problems(results: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """Every disagreement between the pages and the results file, one line each
    (``page:line: ...``); empty when the pages quote the file exactly."""
    results = load() if results is None else results
    out = []
    for name, entry in results.items():
        missing = [f for f in FIELDS if not str(entry.get(f, "")).strip()]
        if missing:
            out.append(f"docs/results.toml: {name} has no {', '.join(missing)}")
        whole = FIGURE.fullmatch(str(entry.get("value", "")))
        if whole is None:
            out.append(f"docs/results.toml: {name}'s value {entry.get('value')!r} is not a figure")
    used: dict[str, int] = dict.fromkeys(results, 0)
    for page in pages():
        where = page.relative_to(ROOT)
        for line, name, figure, _, _ in quotes(page.read_text()):
            if name not in results:
                out.append(f"{where}:{line}: no result {name!r} in docs/results.toml")
                continue
            used[name] += 1
            if figure != results[name]["value"]:
                want = results[name]["value"]
                out.append(
                    f"{where}:{line}: {name} is quoted as {figure!r}; the file says {want!r}"
                )
    for name, n in used.items():
        if n < 2:
            out.append(
                f"docs/results.toml: {name} is quoted {n} time(s): a result is a figure that "
                "two places or more quote, each marked <!-- result: NAME -->"
            )
    return out


def rewrite(text: str, results: dict[str, dict[str, Any]]) -> str:
    """``text`` with every marked quote replaced by its value in ``results``."""
    for _, name, figure, start, end in reversed(quotes(text)):
        if name in results and figure != results[name]["value"]:
            text = text[:start] + results[name]["value"] + text[end:]
    return text


def write(results: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """Rewrite every marked quote that differs from the results file; the pages changed."""
    results = load() if results is None else results
    changed = []
    for page in pages():
        text = page.read_text()
        new = rewrite(text, results)
        if new != text:
            page.write_text(new)
            changed.append(str(page.relative_to(ROOT)))
    return changed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="where each figure is quoted")
    ap.add_argument("--write", action="store_true", help="rewrite the quotes from the file")
    args = ap.parse_args()
    results = load()
    if args.list:
        for page in pages():
            for line, name, figure, _, _ in quotes(page.read_text()):
                print(f"{page.relative_to(ROOT)}:{line}: {name} = {figure}")
        return 0
    if args.write:
        for changed in write(results):
            print(f"rewrote {changed}")
    found = problems(results)
    for problem in found:
        print(problem)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
