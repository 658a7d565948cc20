"""The exclusive lock a run (or a sweep) holds on its folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ppokit.errors import UserError
from ppokit.runfolder.files import is_link
from ppokit.runfolder.names import LOCK
from ppokit.runfolder.oserrors import io_error


class FolderLock:
    """An exclusive lock on ``folder/name`` (``filelock``: the OS releases it when the
    process ends in any way, so a stale lock is never an obstacle). A link at that name is
    removed first, never opened; ``busy`` is the refusal's text."""

    def __init__(self, folder: Path, name: str = LOCK, busy: str = "") -> None:
        self.path = folder / name
        self.busy = busy or (
            f"{folder} is in use by another ppokit run (it holds {self.path}): wait for it to "
            "finish or choose another --out"
        )
        self._lock: Any = None

    def held_elsewhere(self) -> bool:
        """Whether another process holds the lock now (taken and released at once)."""
        if not self.path.parent.is_dir():
            return False
        try:
            self.acquire()
        except UserError:
            return True
        self.release()
        return False

    def acquire(self) -> None:
        from filelock import FileLock, Timeout

        lock = FileLock(str(self.path), timeout=0)
        try:
            if is_link(self.path):
                self.path.unlink()  # the link itself: a lock file is always made afresh
            lock.acquire()
        except Timeout:
            raise UserError(self.busy) from None
        except OSError as exc:
            raise io_error(self.path, exc, "cannot create the lock file") from None
        self._lock = lock

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
