"""The output folder of one run: started, resumed, replaced or refused, and locked."""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ppokit import __version__
from ppokit.errors import UserError
from ppokit.runfolder.documents import read_json
from ppokit.runfolder.files import is_link, link_error, remove, write_atomic
from ppokit.runfolder.lock import FolderLock
from ppokit.runfolder.names import (
    CHECKPOINT,
    CHECKPOINT_OLD,
    CHECKPOINT_TMP,
    LOCK,
    MARKER,
    RUN_FILES,
    TEMP_FILES,
)
from ppokit.runfolder.oserrors import io_errors


def timestamp() -> str:
    """The local time as a run folder's records write it (ISO 8601, with its offset)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


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
        if is_link(top):
            found.append(top)
            continue
        if not top.is_dir():
            continue
        for root, dirs, files in os.walk(top):
            for entry in (*dirs, *files):
                path = Path(root) / entry
                if is_link(path) and not (name == "wandb" and _inside(path, top)):
                    found.append(path)
    return found


def _inside(link: Path, top: Path) -> bool:
    try:
        return link.resolve().is_relative_to(top.resolve())
    except (OSError, RuntimeError):
        return False


def how_to_continue(out: Path, command: Sequence[str], checkpoint: int | None) -> tuple[str, str]:
    """What a stopped run left in ``out`` and the command that continues it: ``command``
    (``ppokit train SPEC [--set ...]``) with ``--out OUT --resume`` after a checkpoint of
    round ``checkpoint``, else with ``--out OUT --overwrite`` (it starts again)."""
    if checkpoint:
        return (
            f"the last checkpoint is round {checkpoint} ({out / CHECKPOINT})",
            "continue with: " + shlex.join([*command, "--out", str(out), "--resume"]),
        )
    return (
        f"no checkpoint was written yet in {out}",
        "start again with: " + shlex.join([*command, "--out", str(out), "--overwrite"]),
    )


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
                if is_link(out / name):
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
