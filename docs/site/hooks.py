"""mkdocs hooks for the documentation site (mkdocs.yml).

The pages link to files outside docs/ (an example script, the README, the changelog), which
GitHub renders from the repository. The site serves a copy of each under ``source/`` and
rewrites those links to it, so that ``mkdocs build --strict`` still fails on a link that
resolves nowhere.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parent.parent.parent
OUTSIDE = re.compile(r"\]\(\.\./([^)#\s]+)")
# a root page's (README.md's, CHANGELOG.md's) relative links: to docs/ pages, or other files
ROOT_LINK = re.compile(r"\]\((?![a-z]+:|#|docs/)([^)#\s]+)")


def _outside_targets(docs_dir: Path) -> set[str]:
    found: set[str] = set()
    for page in docs_dir.glob("*.md"):
        found.update(OUTSIDE.findall(page.read_text()))
    for rel in list(found):
        if rel.endswith(".md") and (ROOT / rel).is_file():  # a root page's own links
            found.update(ROOT_LINK.findall((ROOT / rel).read_text()))
    return found


def on_files(files: Files, config: Any) -> Files:
    for rel in sorted(_outside_targets(Path(config["docs_dir"]))):
        src = ROOT / rel
        if src.is_file():  # a missing one stays a broken link: strict mode reports it
            file = File.generated(config, f"source/{rel}", abs_src_path=str(src))
            file.inclusion = InclusionLevel.NOT_IN_NAV  # a page of its own, outside the nav
            files.append(file)
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri.startswith("source/"):  # a root page: docs/x.md is the site's x.md
        return markdown.replace("](docs/", "](../")
    return OUTSIDE.sub(r"](source/\1", markdown)
