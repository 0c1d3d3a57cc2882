"""Every relative link and anchor in README.md, CHANGELOG.md and docs/ resolves: the file exists
and, for ``#anchor``, a heading of that file has that slug (GitHub's rule: lower case,
punctuation but ``-`` and ``_`` dropped, spaces to ``-``, repeats numbered ``-1``, ``-2``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("**/*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def slugs(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    out: set[str] = set()
    seen: dict[str, int] = {}
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link: its text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [
        m.group(1)
        for m in LINK.finditer(FENCE.sub("", page.read_text()))
        if not re.match(r"[a-z]+:", m.group(1))
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_tables_have_one_separator_row(page: Path) -> None:
    """A table's ``| --- |`` row is its second line only (another renders as a row of dashes)."""
    lines = FENCE.sub("", page.read_text()).split("\n")
    stray = [
        line
        for i, line in enumerate(lines)
        if re.match(r"^\|\s*:?-{3,}", line)
        and not (i > 0 and lines[i - 1].startswith("|") and not lines[i - 2].startswith("|"))
    ]
    assert not stray, f"{page.relative_to(ROOT)}: separator rows inside a table: {stray}"
