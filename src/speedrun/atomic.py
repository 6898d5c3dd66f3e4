"""Atomic file writes: a reader (or a crash) sees the old file or the complete new one, never a part.

Files are created with the permissions the user's umask gives ordinary files (0644 under the usual
umask 022), not the 0600 that temporary-file helpers use.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path


def umask() -> int:
    """The process umask, read without changing it where Linux allows (/proc), else set-and-restore."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """Mode of a new ordinary file: 0666 less the umask, as `open(path, "w")` would give."""
    return 0o666 & ~umask()


def dir_mode() -> int:
    """Mode of a new folder: 0777 less the umask, as `mkdir` would give."""
    return 0o777 & ~umask()


def write_atomic(path: Path, *chunks: bytes) -> None:
    """Write `chunks` to a temporary file beside `path`, fsync it, then rename it over `path`."""
    path = Path(path)
    if path.is_dir():  # else the rename fails naming our temporary file, not the path the user gave
        raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:  # read-only folder, /proc: name the file we were asked for, not the temporary
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None
    try:
        os.fchmod(fd, file_mode())  # mkstemp makes 0600 files; ours are ordinary data
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.filename in (None, tmp):  # a failed write or rename names no file, or our temporary
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
