"""Text we print or log stays valid whatever bytes a path or argument holds: the error handler ESCAPE
(standard output, standard error, log.txt) writes a non-UTF-8 command-line byte (a lone surrogate,
'\\udcff') as the text `\\xff`, and a character the stream cannot encode as a backslash escape."""

from __future__ import annotations

import codecs

ESCAPE = "speedrun.escape"


def _escape(error: UnicodeError) -> tuple[str, int]:
    if not isinstance(error, UnicodeEncodeError):
        raise error
    chunk = error.object[error.start : error.end]
    if all(0xDC80 <= ord(c) <= 0xDCFF for c in chunk):  # bytes that were not UTF-8 (surrogateescape)
        return "".join(f"\\x{ord(c) - 0xDC00:02x}" for c in chunk), error.end
    return codecs.backslashreplace_errors(error)


codecs.register_error(ESCAPE, _escape)


def printable(text: str) -> str:
    """`text` with the bytes that were not UTF-8 written as `\\xNN` (valid UTF-8 from then on)."""
    return text.encode("utf-8", ESCAPE).decode("utf-8")
