"""One file of a run folder, written or read without following a link: atomic writes,
appended lines, removal that never leaves the folder, regular-file reads."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO

from ppokit.errors import UserError
from ppokit.runfolder.names import temp_name
from ppokit.runfolder.oserrors import io_error

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_BINARY = getattr(os, "O_BINARY", 0)


def is_link(path: Path) -> bool:
    """Whether ``path`` is a symbolic link (no error: a missing path is not one)."""
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def link_error(path: Path) -> UserError:
    """The refusal of a link where ppokit would read or write."""
    return UserError(
        f"{path} is a symbolic link: ppokit follows no link in a run folder (it could write "
        "outside it); remove the link"
    )


def remove(path: Path) -> None:
    """Remove ``path`` if it exists: a link itself (never its target), a folder with what it
    holds (links inside it removed, not followed), or a file. OS errors propagate."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)  # removes links inside, never what they point to
    else:
        path.unlink()


def ensure_dir(root: Path, *parts: str) -> Path:
    """``root/parts...``, each folder below ``root`` created when missing; a part that is a
    link (or not a folder) is a one-line UserError: nothing is written through it."""
    path = root
    for part in parts:
        path = path / part
        try:
            path.mkdir()
        except FileExistsError:
            pass
        except OSError as exc:
            raise io_error(path, exc, "cannot create the folder") from None
        if is_link(path):
            raise link_error(path)
        if not path.is_dir():
            raise UserError(f"{path} exists and is not a folder")
    return path


def open_new(path: Path) -> IO[bytes]:
    """A new file at ``path`` for writing (``O_EXCL | O_NOFOLLOW``): a file or link left at
    that name by someone else is removed first (the link itself)."""
    remove(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC | _BINARY
    return os.fdopen(os.open(path, flags, 0o666), "wb")


def write_atomic(path: Path, data: str | bytes | Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` whole through :func:`temp_name` and a rename (a link at ``path`` is
    replaced, never followed). ``data``: text, bytes, or a function writing to the open
    binary file. An OS error is a one-line ``UserError``; the temporary file is removed and
    ``path`` left as it was."""
    tmp = temp_name(path)
    try:
        with open_new(tmp) as fh:
            if callable(data):
                data(fh)
            else:
                fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except OSError as exc:
        if not is_link(tmp):
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise io_error(path, exc) from None


def append_line(path: Path, line: str) -> None:
    """Append one line in one ``write`` (``O_NOFOLLOW``); on an OS error the file is cut
    back to its previous size (no partial line is left) and a one-line ``UserError`` is
    raised."""
    data = (line.rstrip("\n") + "\n").encode("utf-8")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o666)
    except OSError as exc:
        raise io_error(path, exc) from None
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise io_error(path, exc) from None
    finally:
        os.close(fd)


def read_bytes(path: Path) -> bytes:
    """A regular file's bytes, opened without following a link (``OSError`` otherwise: a
    link, a pipe or a device in a run folder could stall or flood a read)."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | _BINARY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return fh.read()
