"""The package version and its release date (one place; pyproject.toml reads the version,
``flatcli --version`` prints both, CHANGELOG.md's section heading carries the same date)."""

__version__ = "0.10.0"
__date__ = "2026-11-28"
