"""The test suite's own cost: what each file and test takes, CI's stages, the budget.

    python benchmarks/suite.py runs/junit.xml                      # per file, the 50 slowest
    python benchmarks/suite.py runs/junit.xml --stages runs/ci-stages.txt
    python benchmarks/suite.py runs/junit.xml --check docs/testing.md  # the budget guard
    FSDP2_HARNESS_LOG=runs/pools.log make test PYTEST_ARGS=--junitxml=runs/junit.xml
    python benchmarks/suite.py runs/junit.xml --pools runs/pools.log   # worker pools spawned

The junit file is pytest's (``make test PYTEST_ARGS=--junitxml=runs/junit.xml``; CI writes
one). ``--stages`` reads the stage times ``.ci/run`` writes (``stage <name> <seconds>``).
``--pools`` reads the log ``tests/_harness.py`` writes under ``FSDP2_HARNESS_LOG``: how many
worker pools each world size spawned, their start-up time and the tests that spawned them
(a pool is respawned after a test that killed or hung it). ``--check`` compares the number
of tests the main suite ran with the budget table of docs/testing.md ("| main suite | N
tests | ..."): a suite that grew (or shrank) without the table being updated fails with exit
code 1, so a new test pays for its time visibly. Line coverage is ``make coverage``
(coverage.py, worker processes included).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import xml.etree.ElementTree as ET

BUDGET_ROW = re.compile(r"^\|\s*main suite\s*\|\s*(\d+) tests\s*\|", re.M)


def read_junit(path: str) -> list[tuple[str, str, float, str]]:
    """``(file, test, seconds, outcome)`` of every test case in a junit XML file."""
    out = []
    for case in ET.parse(path).iter("testcase"):
        cls = case.get("classname", "")
        file = cls.replace(".", "/") + ".py" if cls else "?"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        out.append((file, case.get("name", "?"), float(case.get("time", 0.0)), outcome))
    return out


def report(cases: list[tuple[str, str, float, str]], slowest: int) -> str:
    by_file: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for file, _, seconds, _ in cases:
        by_file[file] += seconds
        counts[file] += 1
    total = sum(by_file.values())
    outcomes = collections.Counter(o for *_, o in cases)
    lines = [
        f"{len(cases)} tests ({', '.join(f'{n} {o}' for o, n in sorted(outcomes.items()))}), "
        f"{total / 60:.1f} min in tests",
        "",
        "seconds  tests  file",
    ]
    lines += [f"{s:7.1f}  {counts[f]:5d}  {f}" for f, s in by_file.most_common()]
    if slowest > 0:
        lines += ["", f"the {slowest} slowest tests:", "seconds  test"]
        ranked = sorted(cases, key=lambda c: -c[2])[:slowest]
        lines += [f"{s:7.1f}  {f}::{t}" for f, t, s, _ in ranked]
    return "\n".join(lines)


def stages(path: str) -> str:
    lines = ["", "CI stages:", "seconds  stage"]
    total = 0
    for line in open(path):
        parts = line.split()
        if len(parts) == 3 and parts[0] == "stage":
            lines.append(f"{int(parts[2]):7d}  {parts[1]}")
            total += int(parts[2])
    lines.append(f"{total:7d}  all ({total / 60:.1f} min)")
    return "\n".join(lines)


def pools(path: str) -> str:
    """The pool spawns a ``FSDP2_HARNESS_LOG`` file records (``spawn <world size> <s> <test>``),
    and the pools discarded for their threads (``drop <world size> <threads by name> <test>``)."""
    spawns: dict[int, list[tuple[float, str]]] = collections.defaultdict(list)
    drops: list[str] = []
    for line in open(path):
        parts = line.split(maxsplit=3)
        if len(parts) == 4 and parts[0] == "spawn":
            spawns[int(parts[1])].append((float(parts[2]), parts[3].strip()))
        elif len(parts) == 4 and parts[0] == "drop":
            drops.append(f"  {parts[1]} ranks after {parts[3].strip()}: {parts[2]}")
    lines = ["", "worker pools spawned:", "ranks  spawns  seconds  first tests"]
    for ws in sorted(spawns):
        got = spawns[ws]
        tests = ", ".join(t for _, t in got[:3]) + (" ..." if len(got) > 3 else "")
        lines.append(f"{ws:5d}  {len(got):6d}  {sum(s for s, _ in got):7.1f}  {tests}")
    if drops:
        lines += ["pools discarded for their threads (rank 0's, by name):", *drops]
    return "\n".join(lines)


def check(cases: list[tuple[str, str, float, str]], page: str) -> str | None:
    """``None`` if the page's budget row names the number of tests run, else why not."""
    text = open(page).read()
    m = BUDGET_ROW.search(text)
    if m is None:
        return f"{page} has no budget row '| main suite | N tests | ...'"
    want, ran = int(m.group(1)), len(cases)
    if want != ran:
        return (
            f"the main suite ran {ran} tests, the budget table of {page} says {want}: "
            "update the row (tests and the minutes they take on CI's machine) with the change "
            "that adds or removes tests, so that the suite's cost is visible where it grows"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", help="pytest's --junitxml file")
    parser.add_argument("--stages", help="the stage times .ci/run wrote")
    parser.add_argument("--pools", help="the harness's FSDP2_HARNESS_LOG file")
    parser.add_argument("--check", metavar="PAGE", help="hold the count to PAGE's budget")
    parser.add_argument("--slowest", type=int, default=50)
    args = parser.parse_args(argv)
    cases = read_junit(args.junit)
    print(report(cases, args.slowest))
    if args.stages:
        print(stages(args.stages))
    if args.pools:
        print(pools(args.pools))
    if args.check:
        problem = check(cases, args.check)
        if problem:
            print(f"\nbudget: {problem}", file=sys.stderr)
            return 1
        print(f"\nbudget: {len(cases)} tests, as {args.check} says")
    return 0


if __name__ == "__main__":
    sys.exit(main())
