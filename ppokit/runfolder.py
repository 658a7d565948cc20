"""The run folder: its file names, its safe writes, its lock, its readers, and the checks a
run makes before it writes into one. Everything that knows the layout of ``output.dir``
(the trainer, the checkpoints, the trackers, ``ppokit compare``, ``eval`` and ``export``)
reads it from here.

A run folder may come from elsewhere (a shared file system, a downloaded run): it is
untrusted input. The rules, written once here:

- **No link is followed when writing.** Files are written through :func:`write_atomic`
  (a fresh temporary file opened with ``O_NOFOLLOW | O_EXCL``, then a rename, which replaces
  a link itself) or :func:`append_line` (``O_NOFOLLOW``): a symbolic link where ppokit
  writes is an error, never a write into its target. A temporary name or the lock file that
  is a link is removed (the link, not its target) before the fresh file is made;
  :class:`RunFolder` refuses to resume a folder in which any of the names a run writes, or
  anything inside them, is a link, naming it; ``--overwrite`` removes links themselves
  (:func:`remove` never deletes through a link, and never outside the folder).
- **Nothing a folder says runs code.** :func:`read_run_spec` refuses a run's spec that sets
  ``model.trust_remote_code`` or names a ``python`` reward function unless the command line
  says so (``--trust-remote-code``).
- **What is read is bounded.** JSON and YAML read from a run folder are at most
  ``MAX_DEPTH`` levels deep (a deeper one is a one-line error, never a RecursionError).

Torch-free: the checks run before any model is loaded, and the CLI's light paths import it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from ppokit import __version__
from ppokit.errors import UserError

__all__ = [
    "CHECKPOINT",
    "CHECKPOINT_OLD",
    "CHECKPOINT_TMP",
    "COMPARE_LOCK",
    "CURVES_PNG",
    "LIBRARY_LOG",
    "LOCK",
    "MARKER",
    "MAX_DEPTH",
    "METRICS",
    "RUN_FILES",
    "SAMPLES",
    "SPEC",
    "SPEC_CHANGES",
    "TEMP_FILES",
    "TRACKERS_JSON",
    "TRACKER_FILES",
    "FolderLock",
    "RunFolder",
    "append_line",
    "check_metrics",
    "ensure_dir",
    "has_checkpoint",
    "io_error",
    "io_errors",
    "is_os_error",
    "link_error",
    "links_in",
    "load_json",
    "logged_rounds",
    "open_new",
    "read_bytes",
    "read_json",
    "read_metrics",
    "read_run_spec",
    "read_spec_data",
    "remove",
    "temp_name",
    "timestamp",
    "truncate_jsonl",
    "write_atomic",
]

# ---------------------------------------------------------------------- the names
#: Written first into a run folder: JSON with the ppokit version and the creation time. A
#: folder without it was never a ppokit run and is never emptied.
MARKER = ".ppokit-run"
#: Locked for the life of a run (``filelock``), so a second run on the folder refuses.
LOCK = ".ppokit-lock"
#: Locked for the life of a sweep in its ``--out`` folder (``ppokit compare``).
COMPARE_LOCK = ".ppokit-compare-lock"
CHECKPOINT = "checkpoint"
#: A checkpoint being written, and the previous one during the swap.
CHECKPOINT_TMP = f".{CHECKPOINT}.tmp"
CHECKPOINT_OLD = f".{CHECKPOINT}.old"
SPEC = "spec.yaml"
METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"
CURVES_PNG = "curves.png"
#: Deliberate spec changes on resume (``--allow-spec-change``), one JSON line each.
SPEC_CHANGES = "spec_changes.jsonl"
#: The log lines of the libraries a run drives (vLLM's), one a line, appended.
LIBRARY_LOG = "library.log"
#: What ``output.report_to`` writes (ppokit/trainer/trackers.py): the trackers' run ids and
#: their local stores; removed with the run so an --overwrite starts new tracker runs.
TRACKERS_JSON = "trackers.json"
TRACKER_FILES = (TRACKERS_JSON, "tensorboard", "wandb", "mlruns")

#: Files a run writes into its output folder (``--overwrite`` removes these, and only these
#: and TEMP_FILES; the lock file stays).
RUN_FILES = (
    MARKER,
    METRICS,
    SAMPLES,
    CURVES_PNG,
    SPEC,
    SPEC_CHANGES,
    LIBRARY_LOG,
    CHECKPOINT,
    *TRACKER_FILES,
)
#: Files written whole (through :func:`write_atomic`, under :func:`temp_name`).
_ATOMIC = (MARKER, METRICS, SAMPLES, CURVES_PNG, SPEC, TRACKERS_JSON)


def temp_name(path: Path) -> Path:
    """The temporary file :func:`write_atomic` writes ``path`` through: ``NAME.tmp``."""
    return path.with_name(path.name + ".tmp")


#: Temporary names of the run's atomic writes.
TEMP_FILES = (CHECKPOINT_TMP, CHECKPOINT_OLD, *(f"{name}.tmp" for name in _ATOMIC))

#: JSON and YAML read from a run folder nest at most this deep.
MAX_DEPTH = 64

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_BINARY = getattr(os, "O_BINARY", 0)
_OS_MESSAGE = re.compile(r'message: "([^"]+)"')
_OS_CODE = re.compile(r"code: (\d+)|\(os error (\d+)\)")


# ---------------------------------------------------------------------- OS errors
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


# ---------------------------------------------------------------------- safe writes
def _is_link(path: Path) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def link_error(path: Path) -> UserError:
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
        if _is_link(path):
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
        if not _is_link(tmp):
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


# ---------------------------------------------------------------------- bounded reading
def _depth(value: Any) -> int:
    """How deep lists and mappings nest in ``value`` (iterative: no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            items: Any = item.values()
        elif isinstance(item, list):
            items = item
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in items)
    return deepest


def _bounded(value: Any) -> Any:
    if _depth(value) > MAX_DEPTH:
        raise ValueError(f"nested more than {MAX_DEPTH} levels deep")
    return value


def load_json(text: str | bytes) -> Any:
    """``json.loads`` of text from a run folder: ``ValueError`` for a malformed document or
    one nested more than ``MAX_DEPTH`` levels (never a RecursionError)."""
    try:
        return _bounded(json.loads(text))
    except RecursionError:
        raise ValueError(f"nested more than {MAX_DEPTH} levels deep") from None


def read_bytes(path: Path) -> bytes:
    """A regular file's bytes, opened without following a link (``OSError`` otherwise: a
    link, a pipe or a device in a run folder could stall or flood a read)."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | _BINARY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return fh.read()


def read_json(path: Path) -> Any:
    """:func:`load_json` of a regular file (``OSError`` and ``ValueError`` propagate)."""
    return load_json(read_bytes(path))


def read_spec_data(path: Path) -> dict[str, Any]:
    """The mapping of a spec file read from a run folder (the spec module's bounded
    reader: size, aliases, duplicate keys), at most ``MAX_DEPTH`` levels deep.
    Raises :class:`~ppokit.spec.SpecError` or a one-line ``UserError``."""
    from ppokit.spec import read_spec_file

    try:  # a regular file, not a link: the spec reader opens it by name
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode):
            code = errno.ELOOP if stat.S_ISLNK(mode) else errno.EINVAL
            raise OSError(code, "not a regular file", str(path))
    except FileNotFoundError:
        pass  # the spec reader says so
    except OSError as exc:
        raise io_error(path, exc, "cannot read") from None
    try:
        data = read_spec_file(path)
    except RecursionError:
        raise UserError(f"{path}: nested more than {MAX_DEPTH} levels deep") from None
    if _depth(data) > MAX_DEPTH:
        raise UserError(f"{path}: nested more than {MAX_DEPTH} levels deep")
    return data


def read_run_spec(path: Path, *, trust_remote_code: bool = False) -> dict[str, Any]:
    """The spec a run folder holds (``path``: its ``spec.yaml``, or a folder holding one),
    for a command that reads the folder (``ppokit eval``, ``ppokit export``).

    Nothing a folder names runs unless the user says so: a spec with
    ``model.trust_remote_code: true`` or a ``python`` reward (a function of a file or module
    it would import) is refused (one line naming the flag) unless
    ``trust_remote_code`` (the command line's ``--trust-remote-code``). The other names a
    spec gives are components of installed plugins (by name) and data or model folders read
    as data."""
    file = path / SPEC if path.is_dir() else path
    data = read_spec_data(file)
    model = data.get("model")
    asks = isinstance(model, dict) and model.get("trust_remote_code") not in (None, False)
    if asks and not trust_remote_code:
        actor = model.get("actor") if isinstance(model, dict) else None
        raise UserError(
            f"{file}: the run's spec sets model.trust_remote_code, which would run the Python "
            f"code of its model ({actor!r}); ppokit runs no code a run folder names: pass "
            "--trust-remote-code if you trust this folder"
        )
    functions = _python_rewards(data.get("reward"))
    if functions and not trust_remote_code:
        raise UserError(
            f"{file}: the run's spec names a python reward function ({functions[0]!r}), which "
            "would run its code; ppokit runs no code a run folder names: pass "
            "--trust-remote-code if you trust this folder"
        )
    return data


def _python_rewards(reward: Any) -> list[str]:
    """The ``function`` of each ``python`` reward of a spec's ``reward`` value (a name, a
    mapping or a list of them); a bare ``python`` without one counts too."""
    items = reward if isinstance(reward, list) else [reward]
    found = []
    for item in items:
        name = item.get("name") if isinstance(item, dict) else item
        if name == "python":
            function = item.get("function") if isinstance(item, dict) else None
            found.append(str(function) if function is not None else "python")
    return found


# ---------------------------------------------------------------------- the metrics
def _records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(line, record)`` of each readable line of a JSON-lines file of a run (a line cut
    short by a crash, a foreign or too deeply nested one is skipped). Missing: nothing."""
    try:
        text = read_bytes(path).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return
    except OSError as exc:
        raise io_error(path, exc, "cannot read") from None
    for line in text.splitlines():
        try:
            record = load_json(line)
        except ValueError:
            continue
        round_no = record.get("round") if isinstance(record, dict) else None
        if isinstance(round_no, int) and not isinstance(round_no, bool) and round_no >= 0:
            yield line, record


def read_metrics(out: Path) -> list[dict[str, Any]]:
    """The records of ``out/metrics.jsonl``: JSON objects with an integer ``round`` >= 0
    (anything else is skipped; no file: [])."""
    return [record for _, record in _records(Path(out) / METRICS)]


def logged_rounds(path: Path) -> list[int] | None:
    """The round numbers of ``metrics.jsonl``'s readable lines (None: no such file)."""
    if not path.exists():
        return None
    return [record["round"] for _, record in _records(path)]


def truncate_jsonl(path: Path, rounds: int) -> None:
    """Keep only the lines of ``path`` with ``round <= rounds`` (atomically)."""
    if not path.exists():
        return
    kept = [line for line, record in _records(path) if record["round"] <= rounds]
    write_atomic(path, "".join(k + "\n" for k in kept))


def _gaps(rounds: set[int], last: int) -> list[tuple[int, int]]:
    """The spans ``(first, last)`` of 1..last missing from ``rounds`` (no range is built)."""
    gaps: list[tuple[int, int]] = []
    expected = 1
    for r in sorted(n for n in rounds if 1 <= n <= last):
        if r > expected:
            gaps.append((expected, r - 1))
        expected = r + 1
    if expected <= last:
        gaps.append((expected, last))
    return gaps


def _spans(gaps: list[tuple[int, int]]) -> str:
    shown = [str(a) if a == b else f"{a}-{b}" for a, b in gaps[:4]]
    return ", ".join(shown) + (" ..." if len(gaps) > 4 else "")


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
    logged = set(rounds)
    missing = _gaps(logged, checkpoint_round)
    if missing:
        last = max((r for r in logged if r <= checkpoint_round), default=0)
        # every round after ``last`` is missing: a cut file when nothing before it is
        what = (
            f"ends at round {last}"
            if missing[0][0] == last + 1
            else f"lacks round(s) {_spans(missing)}"
        )
        raise UserError(
            f"cannot resume: the checkpoint is at round {checkpoint_round} but {path} {what} "
            "(the metrics would have a gap); restore the file, or start again with --overwrite"
        )
    return sorted({r for r in logged if r > checkpoint_round})


# ---------------------------------------------------------------------- locks
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
            if _is_link(self.path):
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


def timestamp() -> str:
    """The local time as a run folder's records write it (ISO 8601, with its offset)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


# ---------------------------------------------------------------------- the folder
def _read_marker(folder: Path) -> dict[str, Any] | None:
    """The marker's JSON object, or None where the folder has no valid marker."""
    try:
        data = read_json(folder / MARKER)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "ppokit" in data else None


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def has_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds something to resume from (cheap: nothing is verified)."""
    return os.path.lexists(folder / CHECKPOINT) or any(
        (folder / name / "manifest.json").is_file() for name in (CHECKPOINT_TMP, CHECKPOINT_OLD)
    )


def links_in(folder: Path, names: tuple[str, ...] = RUN_FILES) -> list[Path]:
    """The symbolic links among ``folder``'s entries ``names`` and anywhere inside those
    that are folders (wandb's own links inside ``wandb/`` that stay inside it aside)."""
    found = []
    for name in names:
        top = folder / name
        if _is_link(top):
            found.append(top)
            continue
        if not top.is_dir():
            continue
        for root, dirs, files in os.walk(top):
            for entry in (*dirs, *files):
                path = Path(root) / entry
                if _is_link(path) and not (name == "wandb" and _inside(path, top)):
                    found.append(path)
    return found


def _inside(link: Path, top: Path) -> bool:
    try:
        return link.resolve().is_relative_to(top.resolve())
    except (OSError, RuntimeError):
        return False


class RunFolder:
    """The output folder of one run, prepared and locked (a context manager that releases
    the lock).

    - a folder that does not exist, is empty or holds only an empty run is (re)started;
    - a ppokit run (its marker) is resumed with ``resume``, replaced with ``overwrite``
      (only the names a run writes are removed; links themselves, never their targets),
      else refused;
    - a run in which a name it writes (or anything inside one) is a symbolic link is not
      resumed: one line names the link (temporary names are removed instead);
    - a non-empty folder without the marker was never a run: refused, never written into
      (resuming a folder with a checkpoint but no marker, a run of an older ppokit, is
      allowed);
    - a folder another run holds is refused.
    """

    def __init__(self, out: Path, *, resume: bool, overwrite: bool) -> None:
        self.out = out
        self.resume = resume
        self.overwrite = overwrite
        self.lock = FolderLock(out)

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
        if self.resume and has_checkpoint(out):
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
        with io_errors(out, "cannot remove"):
            for name in TEMP_FILES:  # a crash's leftovers, or links: made afresh
                if _is_link(out / name):
                    (out / name).unlink()
        if self.resume:
            if not has_checkpoint(out):
                raise UserError(
                    f"nothing to resume: {out / CHECKPOINT} does not exist (run without "
                    "--resume, with --overwrite to replace the run)"
                )
            with io_errors(out, "cannot read"):
                links = links_in(out, (*RUN_FILES, *TEMP_FILES))
            if links:
                raise link_error(links[0])
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
                with io_errors(out / name, "cannot remove"):
                    remove(out / name)
        self._write_marker()

    def _write_marker(self) -> None:
        marker = {"ppokit": __version__, "created": timestamp(), "pid": os.getpid()}
        write_atomic(self.out / MARKER, json.dumps(marker) + "\n")

    def close(self) -> None:
        self.lock.release()
