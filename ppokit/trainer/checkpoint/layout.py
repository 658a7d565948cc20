"""The checkpoint's layout: its format number, folders and file names."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from ppokit.errors import UserError, one_line
from ppokit.runfolder import (
    CHECKPOINT_OLD,
    CHECKPOINT_TMP,
    read_json,
)

TMP = CHECKPOINT_TMP
OLD = CHECKPOINT_OLD
FORMAT = 4
MANIFEST = "manifest.json"
#: The folders DCP writes (one safetensors file per process each) and the RNG folder.
DCP_FOLDERS = ("actor", "critic", "optim")
RNG = "rng"


def rng_stem(rank: int) -> str:
    """Process ``rank``'s RNG files, without their suffix."""
    return f"{RNG}/process-{rank:05d}"


#: Files every checkpoint has (format 4; ``actor/`` and ``optim/`` hold at least one file).
REQUIRED = ("state.json", "spec.yaml", "optim.json", f"{rng_stem(0)}.json")
#: The batches generated ahead of the checkpoint's round (asynchronous rollouts).
AHEAD = "ahead"
NAME = re.compile(
    r"(state\.json|spec\.yaml|optim\.json"
    rf"|({'|'.join(DCP_FOLDERS)})/[A-Za-z0-9_-][A-Za-z0-9_.-]*\.safetensors"
    rf"|({RNG}|{AHEAD})/process-\d{{5}}\.(json|safetensors))"
)
SHA256 = re.compile(r"[0-9a-f]{64}")


def fail(path: Path, why: str) -> UserError:
    """The one-line error of a checkpoint at ``path`` that cannot be used, and why."""
    return UserError(f"checkpoint {path} cannot be used: {why}")


MAX_ROUND = 1 << 30
MAX_PROCESSES = 1 << 16


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def state_problem(state: Any) -> str | None:
    """What is wrong with a ``state.json`` object (explicit types and ranges), or None."""
    if not isinstance(state, dict):
        return "not a JSON object"
    problem = format_problem(state.get("format"))
    if problem is not None:
        return problem
    checks = {
        "round": _whole(state.get("round"), 0, MAX_ROUND),
        "kl_coef": _number(state.get("kl_coef")) and state["kl_coef"] >= 0,
        "critic": state.get("critic") is None or isinstance(state.get("critic"), str),
        "processes": _whole(state.get("processes"), 1, MAX_PROCESSES),
        "lora_base": state.get("lora_base") is None
        or (
            isinstance(state["lora_base"], list)
            and len(state["lora_base"]) == 2
            and all(_number(x) for x in state["lora_base"])
        ),
    }
    bad = [key for key, ok in checks.items() if not ok]
    if not bad:
        return None
    ranges = {
        "round": f"an integer from 0 to {MAX_ROUND}",
        "kl_coef": "a finite number >= 0",
        "critic": "a name or null",
        "processes": f"an integer from 1 to {MAX_PROCESSES}",
        "lora_base": "null or two finite numbers",
    }
    return f"{bad[0]} is {json.dumps(state.get(bad[0]))[:40]}, not {ranges[bad[0]]}"


def state_of(path: Path) -> dict[str, Any]:
    """The checkpoint's ``state.json``, every field checked (a one-line error naming it)."""
    try:
        state = read_json(path / "state.json")
    except (OSError, ValueError) as exc:
        raise fail(path, f"state.json is unreadable ({one_line(exc)})") from None
    problem = state_problem(state)
    if problem is not None:
        raise fail(path, f"state.json: {problem}")
    return state


def format_problem(form: Any) -> str | None:
    """Why a checkpoint of format ``form`` is not read (None: it is :data:`FORMAT`)."""
    if form == FORMAT and not isinstance(form, bool):
        return None
    if isinstance(form, int) and not isinstance(form, bool) and 1 < form < FORMAT:
        return (
            f"it was written by an older ppokit (format {form}), which is not read; start a new run"
        )
    return f"unknown checkpoint format {json.dumps(form)[:20]}"
