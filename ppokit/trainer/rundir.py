"""The output folder of a run: recognised by its marker, held by a lock for the run's life,
replaced only where ppokit wrote it, resumed only with the spec it was trained with, and every
OS error while writing it a one-line :class:`UserError` naming the path and the cause.

Torch-free (the checks run before any model is loaded).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from ppokit import __version__
from ppokit.errors import UserError
from ppokit.runfiles import CHECKPOINT, LOCK, MARKER, RUN_FILES, SPEC_CHANGES, TEMP_FILES

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "RunFolder",
    "check_metrics",
    "io_error",
    "io_errors",
    "is_os_error",
    "logged_rounds",
    "spec_differences",
    "write_atomic",
]

#: Spec keys whose change does not change what a run optimises (a resume may change them).
FREE_KEYS = ("output", "eval", "parallel", "train.rounds", "model.device", "model.threads")
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


# ---------------------------------------------------------------------- OS errors
def _cause(exc: BaseException) -> str:
    """``no space left on device``: the cause of an OS error, in lower case, on one line."""
    text = ""
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


def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` through a temporary file and a rename (``UserError`` on an OS error;
    the temporary file is removed and ``path`` left as it was)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise io_error(path, exc) from None


def append_line(path: Path, line: str) -> None:
    """Append one line in one ``write``; on an OS error the file is cut back to its previous
    size (no partial line is left) and a one-line ``UserError`` is raised."""
    data = (line.rstrip("\n") + "\n").encode("utf-8")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
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


# ---------------------------------------------------------------------- the lock
def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    if sys.platform == "win32":  # pragma: no cover - os.kill(pid, 0) would end the process
        import ctypes

        kernel32 = ctypes.windll.kernel32  # type: ignore[attr-defined]
        handle = kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
        if not handle:
            return False
        code = ctypes.c_ulong()
        try:
            kernel32.GetExitCodeProcess(handle, ctypes.byref(code))
        finally:
            kernel32.CloseHandle(handle)
        return code.value == 259  # STILL_ACTIVE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    except OSError:
        return False
    return True


#: Lock files this process holds (the pid-file fallback cannot tell itself apart otherwise).
_HELD: set[str] = set()


class RunLock:
    """An exclusive lock on ``folder/.ppokit-lock`` for the life of a run.

    ``fcntl.flock`` where the platform has it: the OS releases it when the process ends in
    any way (SIGKILL included), so a stale lock is never an obstacle. Elsewhere (or where the
    file system refuses flock) a pid file, taken over when its process is no longer alive.
    """

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK
        self.fd: int | None = None
        self.pidfile = False

    def _busy(self, holder: str) -> UserError:
        who = f" (pid {holder})" if holder else ""
        return UserError(
            f"{self.path.parent} is in use by another ppokit run{who}: wait for it to finish "
            "or choose another --out"
        )

    def _holder(self) -> str:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8") or "{}")
            return str(int(data.get("pid", 0)) or "")
        except (OSError, ValueError, AttributeError, TypeError):
            return ""

    def _info(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "since": _now()}).encode()

    def acquire(self) -> None:
        key = str(self.path.resolve())
        if key in _HELD:
            raise self._busy(str(os.getpid()))
        if fcntl is not None:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as exc:
                raise io_error(self.path, exc, "cannot create the lock file") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise self._busy(self._holder()) from None
                self._acquire_pidfile()  # e.g. ENOLCK: a file system without flock
            else:
                self.fd = fd
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                    os.write(fd, self._info())
        else:  # pragma: no cover - exercised through a monkeypatch on POSIX
            self._acquire_pidfile()
        _HELD.add(key)

    def _acquire_pidfile(self) -> None:
        for _attempt in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                holder = self._holder()
                if holder and _pid_alive(int(holder)) and int(holder) != os.getpid():
                    raise self._busy(holder) from None
                with contextlib.suppress(FileNotFoundError):  # stale: its process is gone
                    self.path.unlink()
                continue
            except OSError as exc:
                raise io_error(self.path, exc, "cannot create the lock file") from None
            try:
                os.write(fd, self._info())
            finally:
                os.close(fd)
            self.pidfile = True
            return
        raise self._busy(self._holder())

    def release(self) -> None:
        _HELD.discard(str(self.path.resolve()))
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
            os.close(self.fd)  # releases the flock
            self.fd = None
        if self.pidfile:
            with contextlib.suppress(OSError):
                self.path.unlink()
            self.pidfile = False


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


# ---------------------------------------------------------------------- the folder
def _read_marker(folder: Path) -> dict[str, Any] | None:
    """The marker's JSON object, or None where the folder has no valid marker."""
    try:
        data = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "ppokit" in data else None


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _has_checkpoint(folder: Path) -> bool:
    return (folder / CHECKPOINT).exists() or any(
        (folder / name / "manifest.json").is_file() for name in TEMP_FILES[:2]
    )


class RunFolder:
    """The output folder of one run, prepared and locked (a context manager that releases
    the lock).

    - a folder that does not exist, is empty or holds only an empty run is (re)started;
    - a ppokit run (its marker) is resumed with ``resume``, replaced with ``overwrite``
      (only the names a run writes are removed), else refused;
    - a non-empty folder without the marker was never a run: refused, never written into
      (resuming a folder with a checkpoint but no marker, a run of an older ppokit, is
      allowed);
    - a folder another run holds is refused.
    """

    def __init__(self, out: Path, *, resume: bool, overwrite: bool) -> None:
        self.out = out
        self.resume = resume
        self.overwrite = overwrite
        self.lock = RunLock(out)

    def __enter__(self) -> RunFolder:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _foreign(self) -> UserError | None:
        """The refusal of a folder that is not a ppokit run, if it is one."""
        out = self.out
        names = sorted(p.name for p in out.iterdir() if p.name != LOCK)
        if not names or _read_marker(out) is not None:
            return None
        if self.resume and _has_checkpoint(out):
            return None  # a run of a ppokit that wrote no marker
        return UserError(
            f"output.dir {out} is not empty and is not a ppokit run folder (no {MARKER} "
            f"marker; it holds {_shown(names)}): ppokit neither writes into nor empties it, "
            "even with --overwrite; choose another --out"
        )

    def open(self) -> None:
        out = self.out
        if out.exists() and not out.is_dir():
            raise UserError(f"output.dir {out} exists and is not a directory")
        if self.resume and not out.is_dir():
            raise UserError(f"nothing to resume: {out} does not exist (run without --resume)")
        if out.is_dir():
            with io_errors(out, "cannot read"):
                refusal = self._foreign()  # before anything is written into it
            if refusal is not None:
                raise refusal
        with io_errors(out, "cannot create the output folder"):
            out.mkdir(parents=True, exist_ok=True)
        self.lock.acquire()
        try:
            self._prepare()
        except BaseException:
            self.lock.release()
            raise

    def _prepare(self) -> None:
        out = self.out
        with io_errors(out, "cannot read"):
            refusal = self._foreign()  # again, now that the folder is ours
            names = sorted(p.name for p in out.iterdir() if p.name not in (LOCK, MARKER))
        if refusal is not None:
            raise refusal
        if self.resume:
            if not _has_checkpoint(out):
                raise UserError(
                    f"nothing to resume: {out / CHECKPOINT} does not exist (run without "
                    "--resume, with --overwrite to replace the run)"
                )
            if _read_marker(out) is None:
                self._write_marker()
            return
        if names:
            if not self.overwrite:
                raise UserError(
                    f"output.dir {out} is not empty: it holds a ppokit run ({_shown(names)}); "
                    "use --resume to continue it or --overwrite to replace it"
                )
            for name in (*RUN_FILES, *TEMP_FILES):
                path = out / name
                with io_errors(path, "cannot remove"):
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path)
                    elif path.exists() or path.is_symlink():
                        path.unlink()
        self._write_marker()

    def _write_marker(self) -> None:
        marker = {"ppokit": __version__, "created": _now(), "pid": os.getpid()}
        write_atomic(self.out / MARKER, json.dumps(marker) + "\n")

    def close(self) -> None:
        self.lock.release()


# ---------------------------------------------------------------------- resume checks
def _flat_diff(old: Any, new: Any, path: str, found: list[tuple[str, Any, Any]]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in [*old, *(k for k in new if k not in old)]:
            _flat_diff(
                old.get(key, "<absent>"),
                new.get(key, "<absent>"),
                f"{path}.{key}" if path else str(key),
                found,
            )
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            _flat_diff(a, b, f"{path}.{i}", found)
    elif old != new:
        found.append((path, old, new))


def _free(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in FREE_KEYS)


def spec_differences(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old value, new value)`` for every difference between two resolved specs
    that changes what a run optimises (FREE_KEYS aside)."""
    found: list[tuple[str, Any, Any]] = []
    _flat_diff(_plain(old), _plain(new), "", found)
    return [d for d in found if not _free(d[0])]


def _plain(data: Any) -> Any:
    return json.loads(json.dumps(data, default=str))


def run_spec_text(out: Path) -> tuple[Path, str] | None:
    """The run's spec.yaml (``out/spec.yaml``, else the checkpoint's copy) and its text."""
    for path in (
        out / "spec.yaml",
        out / CHECKPOINT / "spec.yaml",
        *(out / name / "spec.yaml" for name in TEMP_FILES[:2]),
    ):
        try:
            return path, path.read_text(encoding="utf-8")
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise io_error(path, exc, "cannot read") from None
    return None


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def resume_spec_changes(out: Path, new: dict[str, Any], allow: bool) -> list[tuple[str, Any, Any]]:
    """The objective-changing differences between the run's spec and ``new`` (a validated
    spec's ``model_dump()``); a ``UserError`` naming them unless ``allow``."""
    from ppokit.spec import SpecError, validate_spec

    found = run_spec_text(out)
    if found is None:
        return []  # nothing to compare with (the checkpoint check reports what is missing)
    path, text = found
    try:
        data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise ValueError("not a mapping")
    except (yaml.YAMLError, ValueError) as exc:
        if allow:
            return [("spec", "<unreadable>", "<this spec>")]
        raise UserError(
            f"{path}: unreadable ({str(exc).splitlines()[0]}); pass --allow-spec-change to "
            "resume with this spec anyway"
        ) from None
    try:
        old = validate_spec(data).model_dump()
    except SpecError as exc:
        if not allow:
            first = exc.errors[0] if exc.errors else "invalid"
            raise UserError(
                f"{path}: the run's spec no longer validates ({first}); pass "
                "--allow-spec-change to resume with this spec anyway"
            ) from None
        old = data
    changes = spec_differences(old, new)
    if changes and not allow:
        shown = "; ".join(f"{k}: {_short(a)} -> {_short(b)}" for k, a, b in changes[:4])
        more = f" and {len(changes) - 4} more" if len(changes) > 4 else ""
        raise UserError(
            f"--resume: this spec differs from the run's ({path}) in what it optimises: "
            f"{shown}{more}. Resume with the run's spec (and its --seed/--set), or pass "
            "--allow-spec-change to continue with this one (recorded in spec_changes.jsonl)"
        )
    return changes


def record_spec_changes(out: Path, round_no: int, changes: list[tuple[str, Any, Any]]) -> None:
    """Append one line to ``spec_changes.jsonl``: round, keys, old and new values."""
    record = {
        "round": round_no,
        "time": _now(),
        "keys": [k for k, _, _ in changes],
        "old": {k: a for k, a, _ in changes},
        "new": {k: b for k, _, b in changes},
    }
    append_line(out / SPEC_CHANGES, json.dumps(_plain(record)))


def logged_rounds(path: Path) -> list[int] | None:
    """The round numbers of ``metrics.jsonl``'s readable lines (None: no such file)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise io_error(path, exc, "cannot read") from None
    rounds = []
    for line in text.splitlines():
        try:
            rounds.append(int(json.loads(line)["round"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a crash
    return rounds


def _spans(numbers: list[int]) -> str:
    spans: list[str] = []
    for n in sorted(numbers):
        if spans and spans[-1].split("-")[-1] == str(n - 1):
            spans[-1] = f"{spans[-1].split('-')[0]}-{n}"
        else:
            spans.append(str(n))
    return ", ".join(spans[:4]) + (" ..." if len(spans) > 4 else "")


def check_metrics(path: Path, checkpoint_round: int) -> list[int]:
    """Check that ``metrics.jsonl`` agrees with a checkpoint of ``checkpoint_round`` rounds.

    Returns the logged rounds after the checkpoint (what a resumed run redoes: they are
    dropped). A missing file or a missing round up to the checkpoint is a ``UserError`` that
    says what is inconsistent: resuming would leave a gap in the metrics.
    """
    rounds = logged_rounds(path)
    if checkpoint_round <= 0:
        return sorted({r for r in rounds or () if r > 0})
    if rounds is None:
        raise UserError(
            f"cannot resume: the checkpoint is at round {checkpoint_round} but {path} does "
            "not exist (the run's metrics would start with a gap); restore it, or start "
            "again with --overwrite"
        )
    missing = sorted(set(range(1, checkpoint_round + 1)) - set(rounds))
    if missing:
        last = max((r for r in rounds if r <= checkpoint_round), default=0)
        what = (
            f"ends at round {last}"
            if missing == list(range(last + 1, checkpoint_round + 1))
            else f"lacks round(s) {_spans(missing)}"
        )
        raise UserError(
            f"cannot resume: the checkpoint is at round {checkpoint_round} but {path} {what} "
            "(the metrics would have a gap); restore the file, or start again with --overwrite"
        )
    return sorted({r for r in rounds if r > checkpoint_round})
