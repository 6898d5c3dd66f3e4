"""Errors that end a command with one clear line on stderr instead of a traceback."""


class SpeedrunError(Exception):
    """A failure the user can act on. The CLI prints the message and exits with `exit_code`."""

    exit_code = 1
    rank_specific = False  # True: under torchrun, this rank's own problem, so it prints even if not rank 0


class Stopped(SpeedrunError):
    """A clean stop on request (SIGINT/SIGTERM): not an error, the CLI says so and how to go on."""

    exit_code = 130


class ConfigError(SpeedrunError):
    """Bad recipe, override key or value: a usage error (exit 2)."""

    exit_code = 2


class DataError(SpeedrunError):
    """Missing, corrupt or mismatched data, tokenizer or checkpoint files (exit 1)."""

    exit_code = 1


def first_line(e: BaseException, limit: int = 200) -> str:
    """An exception's message cut to its first line (an OSError's reason without the file name; the
    type's name when empty), for a one-line error."""
    text = getattr(e, "strerror", None) or str(e).strip() or type(e).__name__
    return text.splitlines()[0][:limit]
