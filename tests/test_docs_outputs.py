"""Documentation that cannot drift from the code: what the pages show code printing is what it
prints, and a figure several pages quote is the one in docs/results.toml.

* Shown outputs. Every block of README.md and docs/ that shows what code prints (a plain or
  ``text`` block; a ``print(...)`` in a ``python`` block with the output in a comment) is
  listed in ``SHOWN`` with the test that compares it, and a new one fails
  ``test_every_shown_output_is_checked`` until it is listed. Most are compared where their
  scenario already runs: docs/cli.md's commands in tests/test_cli.py (stdout, and the stderr
  the page shows), the debug-mode errors in tests/core/support/test_debug.py, the experts
  warning in tests/planning/test_estimate_experts.py, docs/huggingface.md's estimate in
  tests/test_recipes.py. Here: docs/debugging.md's ``print(est)`` of a 64-rank Llama, exactly
  (the simulation takes about 25 s, so it is ``long``; the main suite prints the page's
  numbers through ``MemoryEstimate.__str__`` and compares the layout), and its
  ``print(tl.summary)`` (seconds are the machine's: the layout, parts that add up to the
  step, and counts a Llama of 4 blocks gives; docs/api.md quotes the same line).
* Results. Every ``<!-- result: NAME -->`` marker of the pages is followed by NAME's value in
  docs/results.toml, and every entry there is quoted, marked, in two places or more
  (``benchmarks/results.py``; see docs/benchmarks.md's introduction).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import sys
from pathlib import Path

import pytest

if sys.version_info < (3, 11):  # docs/results.toml is read with tomllib, or tomli before 3.11
    pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_spec = importlib.util.spec_from_file_location("results", ROOT / "benchmarks" / "results.py")
assert _spec is not None and _spec.loader is not None
results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results)

_OUTPUTS = "tests/test_docs_outputs.py::"
_CLI = "tests/test_cli.py::test_page_commands_print_what_the_page_shows"
# (page, what the shown output begins with (a regex), the test comparing it: "file::test", or
# "not an output: why"). The first matching row counts; "sh" rows match a block right after a
# ``sh`` block only.
SHOWN: list[tuple[str, str, str]] = [
    ("docs/architecture.md", r"fsdp2/$", "not an output: the package's map"),
    (
        "docs/cli.md",
        r"fsdp2 estimate: warning: mesh 64:",
        "tests/planning/test_estimate_experts.py::test_experts_dim_option",
    ),
    ("docs/cli.md", r"fsdp2 convert: not converted", _CLI),
    ("docs/cli.md", r"sh", _CLI),
    (
        "docs/debugging.md",
        r"fsdp2 memory estimate: rank 0 of 64 ",
        _OUTPUTS + "test_estimate_snippet_prints_what_the_page_shows",
    ),
    (
        "docs/debugging.md",
        r"RuntimeError: fsdp2 debug: ranks disagree",
        "tests/core/support/test_debug.py::test_microbatch_counts_with_no_sync",
    ),
    (
        "docs/debugging.md",
        r"RuntimeError: fsdp2 debug: rank 0 is about to run",
        "tests/core/support/test_debug.py::test_microbatch_counts_with_synced_gradients",
    ),
    ("docs/debugging.md", r"step \d", _OUTPUTS + "test_timeline_summary_as_the_pages_show"),
    ("docs/huggingface.md", r"peak ", "tests/test_recipes.py::test_huggingface_page_runs"),
]


def _fences(text: str) -> list[tuple[int, int, str, str]]:
    """``(start, end, language, body)`` of each fenced block of a page."""
    return [
        (m.start(), m.end(), m.group(1), m.group(2))
        for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```[^\n]*$", text, re.M | re.S)
    ]


def shown_outputs(page: Path) -> list[tuple[int, str, bool]]:
    """``(line, first line, right after a sh block)`` of each output ``page`` shows: a plain or
    ``text`` block, or the comment on (or under) a ``print(...)`` line of a ``python`` block."""
    text = page.read_text()
    out = []
    previous: tuple[int, str] | None = None
    for start, end, lang, body in _fences(text):
        line = text.count("\n", 0, start) + 1
        if lang in ("", "text"):
            after_sh = (
                bool(previous) and previous[1] == "sh" and not text[previous[0] : start].strip()
            )
            out.append((line, body.split("\n", 1)[0], after_sh))
        elif lang == "python":
            lines = body.split("\n")
            for i, code in enumerate(lines):
                if not code.startswith("print("):
                    continue
                comment = re.search(r"\)\s+# (.*)$", code)
                if comment is None and i + 1 < len(lines):
                    comment = re.match(r"# (.*)$", lines[i + 1])
                if comment is not None:
                    out.append((line + 1 + i, comment.group(1), False))
        previous = (end, lang)
    return out


def _row(page: str, first: str, after_sh: bool) -> tuple[str, str, str] | None:
    """The row of ``SHOWN`` for a shown output (None: no test compares it)."""
    for row in SHOWN:
        where, pattern, _ = row
        if where == page and (after_sh if pattern == "sh" else re.match(pattern, first)):
            return row
    return None


def test_every_shown_output_is_checked() -> None:
    unlisted, used = [], set()
    for page in PAGES:
        name = str(page.relative_to(ROOT))
        for line, first, after_sh in shown_outputs(page):
            row = _row(name, first, after_sh)
            if row is None:
                unlisted.append(f"{name}:{line}: {first[:60]!r}")
            else:
                used.add(row)
    assert not unlisted, (
        "pages show outputs no test compares; compare each in a test and list it in SHOWN: "
        + "; ".join(unlisted)
    )
    assert used == set(SHOWN), f"rows of SHOWN no page needs: {set(SHOWN) - used}"
    for _, _, checker in SHOWN:
        if checker.startswith("not an output"):
            continue
        path, _, test = checker.partition("::")
        assert re.search(rf"^def {test}\(", (ROOT / path).read_text(), re.M), checker


def _block_after_python(page: str, first: str) -> tuple[str, str]:
    """``(python block, the output block after it)`` of ``page`` whose output starts with
    ``first``."""
    text = (ROOT / page).read_text()
    fences = _fences(text)
    for (_, _, lang, code), (_, _, out_lang, out) in zip(fences, fences[1:], strict=False):
        if lang == "python" and out_lang == "" and out.startswith(first):
            return code, out
    raise AssertionError(f"{page}: no python block printing {first!r}")


_ESTIMATE = ("docs/debugging.md", "fsdp2 memory estimate: rank 0 of 64 ")


def _bytes(size: str) -> int:
    number, unit = size.split()
    return round(float(number) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(unit))


def test_estimate_layout_as_the_page_shows() -> None:
    """``MemoryEstimate.__str__`` lays the page's numbers out as the page does (its header,
    its parts in ``PARTS``' order, the table of settings); the numbers are the ``long``
    test's."""
    from fsdp2.planning.estimate import PARTS, MemoryEstimate

    _, shown = _block_after_python(*_ESTIMATE)
    lines = shown.rstrip("\n").split("\n")
    head = re.fullmatch(
        r"fsdp2 memory estimate: rank 0 of (\d+) \(mesh \((.*)\)\), (\w+), (.*)", lines[0]
    )
    peak = re.fullmatch(r"peak (.+?) per rank, in the (.*)", lines[1])
    assert head and peak, lines[:2]
    unsharded = lines[2].removeprefix("  unsharded then: ").split(", ")
    parts = {}
    for line in lines[3 : lines.index("")]:
        part = re.fullmatch(r"  (.+?)\s{2,}(\S+ \w+)", line)
        assert part and part.group(1) in PARTS, line
        parts[part.group(1)] = _bytes(part.group(2))
    rows = [
        re.fullmatch(r"(\S+)\s{2,}(\S+ \w+)\s+-", line) for line in lines[lines.index("") + 2 :]
    ]
    assert all(rows), lines
    common = {
        "world_size": int(head.group(1)),
        "mesh_shape": tuple(int(n) for n in head.group(2).split(",") if n),
        "device": head.group(3),
        "host_peak_bytes": 0,
        "when": peak.group(2),
        "unsharded": tuple(unsharded),
    }
    others = tuple(
        MemoryEstimate(peak_bytes=_bytes(r.group(2)), parts={}, settings=r.group(1), **common)
        for r in rows[1:]
    )
    est = MemoryEstimate(
        peak_bytes=_bytes(peak.group(1)),
        parts=parts,
        settings=head.group(4),
        alternatives=others,
        **common,
    )
    assert rows[0].group(1) == est.settings
    assert str(est) + "\n" == shown, f"MemoryEstimate prints\n{est}\nthe page shows\n{shown}"


@pytest.mark.long
def test_estimate_snippet_prints_what_the_page_shows() -> None:
    """docs/debugging.md's snippet (a 6.8B Llama on 64 ranks, both reshard choices), run as
    shown: it prints the page's block, to the character (a simulation: the same bytes on every
    CPU)."""
    code, shown = _block_after_python(*_ESTIMATE)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/debugging.md", "exec"), {})
    assert printed.getvalue() == shown, f"the snippet prints\n{printed.getvalue()}"


def test_timeline_summary_as_the_pages_show() -> None:
    """``Timeline.summary`` writes the page's numbers as docs/debugging.md shows them (docs/api.md
    quotes the same line); the parts add up to the step, as tests/planning/test_timeline.py
    asserts of real steps, and the counts are a Llama of 4 blocks' (4 + 1 all-gathers in the
    forward, 4 in the backward, one reduce-scatter per group: ``make train``'s model)."""
    from fsdp2.planning.timeline import Timeline

    page = (ROOT / "docs" / "debugging.md").read_text()
    (shown,) = re.findall(r"^print\(tl\.summary\)\n# (.*)$", page, re.M)
    m = re.fullmatch(
        r"step ([\d.]+) s: compute ([\d.]+) s, exposed comm ([\d.]+) s, framework ([\d.]+) s "
        r"\((\d+) all-gather, (\d+) reduce-scatter\)",
        shown,
    )
    assert m, shown
    step, compute, comm, framework = (float(m.group(i)) for i in range(1, 5))
    gathers, reduces = int(m.group(5)), int(m.group(6))
    tl = Timeline(
        step_s=step,
        compute_s=compute,
        exposed_comm_s=comm,
        framework_s=framework,
        collectives={"all_gather": gathers, "reduce_scatter": reduces},
    )
    assert tl.summary == shown, tl.summary
    assert abs(compute + comm + framework - step) < 1e-9, shown
    assert (gathers, reduces) == (2 * 4 + 1, 4 + 1), shown
    api = (ROOT / "docs" / "api.md").read_text()
    assert f'("{shown.split(" (")[0]} (...)")' in api, "docs/api.md quotes another summary"


# ---- results --------------------------------------------------------------------------------


def test_pages_quote_the_results_file() -> None:
    problems = results.problems()
    assert not problems, (
        "pages and docs/results.toml disagree (python benchmarks/results.py --write rewrites the "
        "quotes from the file):\n" + "\n".join(problems)
    )


def test_results_name_their_benchmark_section() -> None:
    from test_docs_links import slugs

    anchors = slugs(ROOT / "docs" / "benchmarks.md")
    entries = results.load()
    assert len(entries) >= 20
    bad = [n for n, e in entries.items() if "section" in e and e["section"] not in anchors]
    assert not bad, f"sections not in docs/benchmarks.md: {bad}"


def test_write_rewrites_a_changed_figure() -> None:
    entries = {"pipeline.step_vs_torch": {"value": "0.70-0.90x"}}
    text = "at <!-- result: pipeline.step_vs_torch -->0.66-0.96x its step, and 1.5x other"
    assert results.rewrite(text, entries) == (
        "at <!-- result: pipeline.step_vs_torch -->0.70-0.90x its step, and 1.5x other"
    )
    figures = ["0.89-0.99x", "~4x", "+2.7%", "27.94 GiB", "8.0 s", "~20-25 ms", "5.50-6.29x"]
    assert all(results.FIGURE.fullmatch(f) for f in figures)
    assert [results.FIGURE.match(s).group(0) for s in ("8 steps", "1.00x / 0.98x")] == [
        "8",
        "1.00x",
    ]
