"""Files we write for the user: atomic writes (a reader or a crash sees the old file or the whole new
one; modes from the umask, not mkstemp's 0600), and the one rule for what may stand at their paths
(`check_replaceable`, `open_regular`, `user_folder`): absent or a regular file. A link, FIFO, device or
socket there is never followed or replaced but refused in one line; only a folder the user names may
be a symbolic link to a folder (followed, the link kept)."""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path

from speedrun.errors import ConfigError, SpeedrunError


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


def _kind(mode: int) -> str | None:
    """What a non-regular, non-folder file is, in words (None for a regular file or a folder)."""
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    return "a socket" if stat.S_ISSOCK(mode) else "a device"


def _refuse(path: Path, kind: str) -> SpeedrunError:
    return SpeedrunError(
        f"{path}: is {kind}, not a regular file; not writing through or replacing it "
        "(remove it, or choose another name)"
    )


def check_replaceable(path: Path) -> None:
    """Nothing, if `path` is absent or a regular file (which we may replace); else one-line errors:
    a folder is IsADirectoryError, a symbolic link, FIFO, device or socket a SpeedrunError."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError:  # unreadable parent, not a folder: the write itself names the problem
        return
    if stat.S_ISDIR(mode):  # else the rename fails naming our temporary file, not the path the user gave
        raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", str(path))
    if (kind := _kind(mode)) is not None:
        raise _refuse(Path(path), kind)


def open_regular(path: Path, flags: int, mode: int = 0o666) -> int:
    """`os.open(path, flags)` that opens only a regular file (or creates one): never follows a
    symbolic link, never blocks on a FIFO, never opens a device (SpeedrunError naming `path`)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EWOULDBLOCK):
            raise
        check_replaceable(path)  # names what stands there
        raise
    st_mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(st_mode):
        os.close(fd)
        raise _refuse(Path(path), _kind(st_mode) or "a folder")
    os.set_blocking(fd, True)
    return fd


def read_regular(path: Path) -> bytes:
    """The bytes of the file at `path` (a link to a regular file is followed). A FIFO there would block
    the read forever and a device (`/dev/zero`) never end it: either is one SpeedrunError naming `path`."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if (kind := _kind(os.fstat(fd).st_mode)) is not None:
            raise SpeedrunError(f"{path}: is {kind}, not a regular file; not reading it")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def json_object(path: Path) -> dict:
    """The JSON object in the file at `path`; {} where there is none (missing, unreadable, not a regular
    file, not an object): what a run or data folder may or may not record."""
    try:
        value = json.loads(read_regular(path))
    except (OSError, ValueError, SpeedrunError):
        return {}
    return value if isinstance(value, dict) else {}


def user_folder(path: Path) -> Path:
    """The folder to fill for a path the user gave: `path`, or the folder a symbolic link there points to
    (kept on rename; a link to anything else is refused). `.` and `..` are named by their absolute path."""
    path = Path(path)
    if path.name in ("", ".."):
        path = Path(os.path.abspath(path))
    if not path.is_symlink():
        return path
    target = path.resolve()
    if not target.is_dir():
        raise SpeedrunError(
            f"{path}: is a symbolic link to {target}, which is not a folder; not replacing it "
            "(point it at a folder, or choose another path)"
        )
    return target


TEMP_NAME_EXTRA = 14  # bytes our temporary names add to a name: `.NAME.XXXXXXXX.tmp`, `.NAME.tmp-XXXXXXXX`


def name_too_long(path: Path, extra: int = 0) -> str | None:
    """Why `path` cannot exist on its file system (a name, the last with `extra` bytes for our temporary
    names, or the whole path too long for the limits at the nearest existing folder), or None."""
    path = Path(os.path.abspath(path))
    base = next((p for p in (path, *path.parents) if os.path.isdir(p)), Path("/"))
    try:
        name_max, path_max = os.pathconf(base, "PC_NAME_MAX"), os.pathconf(base, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    parts = path.parts[1:]
    for i, part in enumerate(parts):
        size, more = len(os.fsencode(part)), extra if i == len(parts) - 1 else 0
        if size + more > name_max:
            shown = part if len(part) <= 40 else f"{part[:32]}..."
            return f"the name {shown!r} is {size} bytes; this file system allows {name_max - more} here"
    size = len(os.fsencode(str(path)))
    if size + extra >= path_max:
        return f"the path is {size} bytes long; this file system allows {path_max - 1 - extra} here"
    return None


def check_name_fits(path: Path, flag: str, extra: int = 0) -> None:
    """A path the user gives us to create (`--out`, `--data-dir`, `--json`), checked where it enters:
    an over-long name is refused naming it, not the first file we would have made inside it."""
    why = name_too_long(path, extra)
    if why is not None:
        raise ConfigError(f"{flag}: {why}; choose a shorter name")


def write_atomic(path: Path, *chunks: bytes) -> None:
    """Write `chunks` to a temporary file beside `path`, fsync it, then rename it over `path`
    (which must be absent or a regular file: `check_replaceable`)."""
    path = Path(path)
    check_replaceable(path)
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
