"""A prepared data folder in use is never replaced under a run: a run holds a shared `flock` on the
folder from before it reads `meta.json` until it ends, and `prepare` needs the exclusive lock to rename a
new folder into place. Without `flock` (some network mounts) there is no protection and no error."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from speedrun.errors import DataError

_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)


def _open(folder: Path) -> int | None:
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:  # missing, a file, unreadable: nothing to lock; the reader of meta.json says why
        return None


def hold_for_training(folder: Path) -> int | None:
    """A shared lock on `folder` for as long as the returned descriptor stays open (None: no lock
    here). Waits while a `prepare` renames a new folder into place, then locks the folder now there."""
    while True:
        fd = _open(folder)
        if fd is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # blocks only for the instant of prepare's rename
        except OSError as e:
            os.close(fd)
            if e.errno in _UNSUPPORTED:
                return None
            raise
        try:
            same = os.stat(folder).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # replaced while we waited: lock the folder that is there now


@contextlib.contextmanager
def replacing(folder: Path) -> Iterator[None]:
    """Hold the exclusive lock on an existing `folder` while it is replaced; a DataError when a
    training run uses it. Nothing to lock for a folder that does not exist yet."""
    fd = _open(folder) if folder.is_dir() else None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DataError(
                    f"{folder}: a training run is reading this data folder; preparing it again now "
                    "would change its data under it (wait for the run to end, or choose another "
                    "--data-dir)"
                ) from None
            except OSError as e:
                if e.errno not in _UNSUPPORTED:
                    raise
        yield
    finally:
        if fd is not None:
            os.close(fd)
