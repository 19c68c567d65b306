"""Exception types. The CLI turns these into exit codes; nothing else does."""

from __future__ import annotations


class FlatcliError(Exception):
    """Base class of every error flatcli raises on purpose."""

    exit_code = 1


class ConfigError(FlatcliError):
    """Bad user input: a config key, a file, a CLI option. Exit code 2."""

    exit_code = 2


class MeasurementError(FlatcliError):
    """A measurement failed (non-finite loss, OOM that could not be backed off...). Exit code 1."""

    exit_code = 1
