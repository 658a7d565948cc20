"""JSON and spec files read from a run folder: bounded in depth, and a run's spec refused
where it would run code the user did not allow."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

from ppokit.errors import UserError
from ppokit.runfolder.files import read_bytes
from ppokit.runfolder.names import MAX_DEPTH, SPEC
from ppokit.runfolder.oserrors import io_error


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
    ``model.trust_remote_code: true``, a ``python`` reward (a function of a file or module
    it would import) or a reward that contacts a server it names (``http``, ``judge``: any
    component whose catalogue entry declares a ``consent`` parameter) is refused (one line
    naming the flag) unless ``trust_remote_code`` (the command line's
    ``--trust-remote-code``). The other names a spec gives are components of installed
    plugins (by name) and data or model folders read as data."""
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
    named = _consented(data.get("reward"))
    if named and not trust_remote_code:
        what, key, value = named[0]
        raise UserError(
            f"{file}: the run's spec names a {what} reward {key} ({value!r}), which would "
            f"{_WOULD.get(key, 'run code or contact a server')}; ppokit runs no code and "
            "contacts no server a run folder names: pass --trust-remote-code if you trust "
            "this folder"
        )
    return data


#: What a component that needs consent would do, by its consent parameter (the message's).
_WOULD = {"function": "run its code", "url": "contact that server"}


def _consented(reward: Any) -> list[tuple[str, str, str]]:
    """(name, consent parameter, value) of each reward of a spec's ``reward`` value (a name, a mapping or a
    list of them) whose catalogue entry names a ``consent`` parameter (a python reward's
    function, an http reward's URL), in every plugin installed; one named bare counts too."""
    from ppokit.registry import get_registry

    registry = get_registry()
    items = reward if isinstance(reward, list) else [reward]
    found = []
    for item in items:
        name = item.get("name") if isinstance(item, dict) else item
        if not isinstance(name, str) or not registry.has("reward", name):
            continue
        key = registry.info("reward", name).entry.consent
        if key:
            value = item.get(key) if isinstance(item, dict) else None
            found.append((name, key, str(value) if value is not None else name))
    return found
