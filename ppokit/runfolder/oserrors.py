"""OS errors as one line: ``PATH: cannot write (no space left on device)``."""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

from ppokit.errors import UserError

_OS_MESSAGE = re.compile(r'message: "([^"]+)"')
_OS_CODE = re.compile(r"code: (\d+)|\(os error (\d+)\)")


def is_os_error(exc: BaseException) -> bool:
    """An ``OSError``, or an OS error as a library's Rust side reports it (safetensors:
    ``Error while serializing: I/O error: No space left on device (os error 28) ...``)."""
    if isinstance(exc, OSError):
        return True
    text = str(exc)
    return isinstance(exc, Exception) and (
        "I/O error" in text or "IoError" in text or _OS_CODE.search(text) is not None
    )


def _cause(exc: BaseException) -> str:
    """``no space left on device``: the cause of an OS error, in lower case, on one line."""
    text = ""
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        return "it is a symbolic link: ppokit does not write through links in a run folder"
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
    elif isinstance(exc, OSError) and exc.errno:
        text = os.strerror(exc.errno)
    else:  # safetensors: '... (os error 28) ...' or 'IoError(Os { code: 28, message: "..." })'
        raw = str(exc)
        found = _OS_MESSAGE.search(raw)
        code = _OS_CODE.search(raw)
        if found:
            text = found.group(1)
        elif code:
            text = os.strerror(int(code.group(1) or code.group(2)))
        else:
            text = raw.strip().splitlines()[0] if raw.strip() else type(exc).__name__
    return text[:1].lower() + text[1:]


def io_error(path: Path | str, exc: BaseException, doing: str = "cannot write") -> UserError:
    """``UserError('PATH: cannot write (no space left on device)')``; the path is the file
    the OS error names when it names one."""
    where = getattr(exc, "filename", None) or path
    return UserError(f"{where}: {doing} ({_cause(exc)})")


@contextlib.contextmanager
def io_errors(path: Path | str, doing: str = "cannot write") -> Iterator[None]:
    """Turn an ``OSError`` inside the block into :func:`io_error`'s one-line UserError."""
    try:
        yield
    except OSError as exc:
        raise io_error(path, exc, doing) from None
