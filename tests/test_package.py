"""The package's face: one version (``fsdp2/_version.py``) read by ``fsdp2.__version__``,
``fsdp2 --version``, pyproject.toml (dynamic) and the newest CHANGELOG.md section; the
``py.typed`` marker shipped as package data."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import fsdp2

ROOT = Path(__file__).resolve().parent.parent


def test_one_version_everywhere() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", fsdp2.__version__), fsdp2.__version__
    changelog = (ROOT / "CHANGELOG.md").read_text()
    newest = re.search(r"^## (\S+)", changelog, re.M)
    assert newest is not None and newest.group(1) == fsdp2.__version__, (
        "CHANGELOG.md's newest section must be the version fsdp2/_version.py names"
    )
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = { attr = "fsdp2._version.__version__" }' in pyproject
    assert '\nversion = "' not in pyproject, "a second version in pyproject.toml"


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """In-process (the entry point's own launch is tested by test_cli.py's subprocess run)."""
    from fsdp2.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"fsdp2 {fsdp2.__version__}"


def test_typed_marker_shipped() -> None:
    assert (Path(fsdp2.__file__).parent / "py.typed").exists()
    assert 'fsdp2 = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()
