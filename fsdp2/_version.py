"""fsdp2's version: the one place it is written (pyproject.toml reads it; CHANGELOG.md has a
section per version)."""

__version__ = "0.2.0"
