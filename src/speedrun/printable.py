"""Text we print or log stays valid whatever bytes a path or argument holds.

Python hands a command-line byte that is not UTF-8 (`--out $'\\xff'`) to us as a lone surrogate
('\\udcff'), which a UTF-8 encoder refuses: printing the path, or logging it, would end in a
traceback. The error handler ESCAPE, used for standard output, standard error and log.txt, writes
such a byte as the text `\\xff` and a character the stream's encoding lacks (an ASCII terminal) as a
backslash escape, so every stream stays valid text in its encoding. JSON files need nothing: `json`
writes '\\udcff' as that escape, which reads back as the same path.
"""

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
