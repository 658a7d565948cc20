"""What a resumed run may change of its spec: the keys that do not change what it optimises
(``FREE_KEYS``), the differences between the run's spec and the resuming one that do, the
refusal that names them, and their record in ``spec_changes.jsonl`` when
``--allow-spec-change`` lets them through. Torch-free, as :mod:`ppokit.runfolder`, whose
readers and writes it uses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ppokit.errors import UserError, clipped
from ppokit.runfolder import (
    CHECKPOINT,
    CHECKPOINT_OLD,
    CHECKPOINT_TMP,
    SPEC,
    SPEC_CHANGES,
    append_line,
    read_spec_data,
    timestamp,
)

__all__ = [
    "FREE_KEYS",
    "record_spec_changes",
    "resume_spec_changes",
    "run_spec_path",
    "spec_differences",
]

#: Spec keys whose change does not change what a run optimises (a resume may change them).
FREE_KEYS: tuple[str, ...] = ("output", "eval", "parallel", "health", "train.rounds")
FREE_KEYS += ("model.device", "model.threads", "rollout.engine_threads")


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


def run_spec_path(out: Path) -> Path | None:
    """The run's spec.yaml: ``out/spec.yaml``, else the checkpoint's copy (None: none)."""
    for path in (
        out / SPEC,
        out / CHECKPOINT / SPEC,
        *(out / name / SPEC for name in (CHECKPOINT_TMP, CHECKPOINT_OLD)),
    ):
        if path.is_file():
            return path
    return None


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return clipped(text, 40)


def resume_spec_changes(out: Path, new: dict[str, Any], allow: bool) -> list[tuple[str, Any, Any]]:
    """The objective-changing differences between the run's spec and ``new`` (a validated
    spec's ``model_dump()``); a ``UserError`` naming them unless ``allow``."""
    from ppokit.spec import SpecError, validate_spec

    path = run_spec_path(out)
    if path is None:
        return []  # nothing to compare with (the checkpoint check reports what is missing)
    try:
        data = read_spec_data(path)
    except (SpecError, UserError) as exc:
        if allow:
            return [("spec", "<unreadable>", "<this spec>")]
        why = exc.errors[0] if isinstance(exc, SpecError) and exc.errors else str(exc)
        raise UserError(
            f"{path}: unreadable ({why.splitlines()[0] if why else 'invalid'}); pass "
            "--allow-spec-change to resume with this spec anyway"
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
        "time": timestamp(),
        "keys": [k for k, _, _ in changes],
        "old": {k: a for k, a, _ in changes},
        "new": {k: b for k, _, b in changes},
    }
    append_line(out / SPEC_CHANGES, json.dumps(_plain(record)))
