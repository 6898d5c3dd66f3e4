"""Errors that end a command with one clear line on stderr instead of a traceback."""


class SpeedrunError(Exception):
    """A failure the user can act on. The CLI prints the message and exits with `exit_code`."""

    exit_code = 1


class ConfigError(SpeedrunError):
    """Bad recipe, override key or value: a usage error (exit 2)."""

    exit_code = 2


class DataError(SpeedrunError):
    """Missing, corrupt or mismatched data, tokenizer or checkpoint files (exit 1)."""

    exit_code = 1
