"""benchmarks/suite.py, the suite's cost report and its budget guard (CI's ``budget`` stage).

The guard is what makes a new test pay for its time visibly: the main suite's test count must
equal the count in docs/testing.md's budget row, so a change that adds tests updates the row
(and the minutes beside it) in the same commit. Tested on small junit files written here.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _suite() -> ModuleType:
    spec = importlib.util.spec_from_file_location("suite", ROOT / "benchmarks" / "suite.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_one" time="2.5"/>
<testcase classname="tests.test_a" name="test_two" time="0.5"><skipped message="x"/></testcase>
<testcase classname="tests.core.test_b" name="test_three[2]" time="7.0">
<failure message="boom"/></testcase>
</testsuite></testsuites>
"""


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_report_per_file_and_slowest(tmp_path: Path) -> None:
    suite = _suite()
    cases = suite.read_junit(_write(tmp_path, "junit.xml", JUNIT))
    assert cases == [
        ("tests/test_a.py", "test_one", 2.5, "passed"),
        ("tests/test_a.py", "test_two", 0.5, "skipped"),
        ("tests/core/test_b.py", "test_three[2]", 7.0, "failed"),
    ]
    text = suite.report(cases, slowest=2)
    assert text.splitlines()[0] == "3 tests (1 failed, 1 passed, 1 skipped), 0.2 min in tests"
    assert "    7.0      1  tests/core/test_b.py" in text
    assert "    3.0      2  tests/test_a.py" in text
    slow = text.split("the 2 slowest tests:")[1].splitlines()[2:]
    assert slow == [
        "    7.0  tests/core/test_b.py::test_three[2]",
        "    2.5  tests/test_a.py::test_one",
    ]


def test_budget_row_must_name_the_count(tmp_path: Path) -> None:
    suite = _suite()
    cases = suite.read_junit(_write(tmp_path, "junit.xml", JUNIT))
    table = "| suite | tests |\n| --- | --- |\n| main suite | 3 tests | 1 min |\n"
    right = _write(tmp_path, "right.md", table)
    wrong = _write(tmp_path, "wrong.md", "| main suite | 2 tests | 1 min |\n")
    none = _write(tmp_path, "none.md", "no table\n")
    assert suite.check(cases, right) is None
    problem = suite.check(cases, wrong)
    assert problem is not None and "ran 3 tests" in problem and "says 2" in problem
    assert "no budget row" in (suite.check(cases, none) or "")
    junit = _write(tmp_path, "junit2.xml", JUNIT)
    assert suite.main([junit, "--check", right, "--slowest", "0"]) == 0
    assert suite.main([junit, "--check", wrong, "--slowest", "0"]) == 1


def test_stages_and_pools(tmp_path: Path) -> None:
    suite = _suite()
    stages = _write(tmp_path, "stages.txt", "stage install 95\nstage test 600\nnoise\n")
    text = suite.stages(stages)
    assert "     95  install" in text and "    695  all (11.6 min)" in text
    log = _write(
        tmp_path,
        "pools.log",
        "spawn 2 1.50 tests/a.py::t1\nspawn 4 3.00 tests/b.py::t2\nspawn 2 1.25 tests/c.py::t3\n",
    )
    text = suite.pools(log)
    assert "    2       2      2.8  tests/a.py::t1, tests/c.py::t3" in text
    assert "    4       1      3.0  tests/b.py::t2" in text


def test_the_docs_have_a_budget_row() -> None:
    """CI's budget stage reads this row: it exists and names a count."""
    suite = _suite()
    text = (ROOT / "docs" / "testing.md").read_text()
    m = suite.BUDGET_ROW.search(text)
    assert m is not None, "docs/testing.md lost its '| main suite | N tests | ...' row"
    assert int(m.group(1)) > 0
    assert os.path.exists(ROOT / ".ci" / "run")
    assert "--check docs/testing.md" in (ROOT / ".ci" / "run").read_text()
