"""The package version (one place; pyproject.toml reads it)."""

__version__ = "0.8.0"
