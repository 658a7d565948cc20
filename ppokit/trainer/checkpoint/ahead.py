"""The batches a checkpoint saves with asynchronous rollouts (``rollout.max_staleness`` S >
0, docs/async.md): after round r the rounds r + 1 ... r + S have their batches generated,
from weights the checkpoint does not hold (versions r − S ... r − 1), so each process saves
its own, and a resumed run trains on exactly what the uninterrupted one would::

    checkpoint/ahead/process-0000K.json          each batch's round, weights' version, data
                                                 rows and formatted prompts
    checkpoint/ahead/process-0000K.safetensors   its responses (every Rollout tensor, named
                                                 ``{i}.{field}``; the greedy baseline's
                                                 ``{i}.greedy.{field}``)

What is read back is checked as untrusted input: the rounds follow the checkpoint's, the
versions are older than its weights, every tensor has its field's dtype and a shape that
agrees with the others and the rows, token ids lie in the vocabulary and numbers are
finite; any failure is one line naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ppokit.runfolder import read_json
from ppokit.trainer.checkpoint.layout import AHEAD, fail
from ppokit.trainer.rollout import Rollout

__all__ = ["AHEAD", "Ahead", "ahead_stem", "read_ahead", "write_ahead"]

#: Each Rollout field's dtype and shape: ``BT`` a response position, ``BP`` a prompt
#: position, ``B`` a row; the fields every rollout has.
_FIELDS: dict[str, tuple[torch.dtype, str]] = {
    "prompt_ids": (torch.long, "BP"),
    "prompt_mask": (torch.long, "BP"),
    "response_ids": (torch.long, "BT"),
    "response_mask": (torch.bool, "BT"),
    "truncated": (torch.bool, "B"),
    "logp_rollout": (torch.float32, "BT"),
    "env_mask": (torch.bool, "BT"),
    "turn_rewards": (torch.float32, "BT"),
    "turns": (torch.long, "B"),
    "ended": (torch.long, "B"),
    "version": (torch.long, "B"),
}
_REQUIRED = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "truncated", "version")


def ahead_stem(rank: int) -> str:
    """Process ``rank``'s files of batches generated ahead, without their suffix."""
    return f"{AHEAD}/process-{rank:05d}"


@dataclass(frozen=True)
class Ahead:
    """A batch generated for a later round: the round, the weights' version, its data rows
    and formatted prompts, its responses and, with ReMax, the greedy baseline's."""

    round: int
    version: int
    rows: list[dict[str, Any]]
    formatted: list[str]
    rollout: Rollout
    greedy: Rollout | None = None


def write_ahead(stem: Path, batches: Sequence[Ahead]) -> list[Path]:
    """``stem.json`` and ``stem.safetensors`` of ``batches``; returns the files written."""
    tensors: dict[str, torch.Tensor] = {}
    records = []
    for i, b in enumerate(batches):
        for prefix, ro in ((f"{i}", b.rollout), (f"{i}.greedy", b.greedy)):
            if ro is None:
                continue
            for f in fields(ro):
                value = getattr(ro, f.name)
                if value is not None:
                    tensors[f"{prefix}.{f.name}"] = value.detach().contiguous().cpu()
        try:
            json.dumps(b.rows)
        except (TypeError, ValueError) as exc:
            raise fail(stem.parent.parent, f"a data row is not JSON ({exc})") from None
        records.append(
            {
                "round": b.round,
                "version": b.version,
                "rows": b.rows,
                "formatted": b.formatted,
                "greedy": b.greedy is not None,
            }
        )
    json_file, tensor_file = Path(f"{stem}.json"), Path(f"{stem}.safetensors")
    json_file.write_text(json.dumps({"batches": records}) + "\n")
    save_file(tensors, str(tensor_file))
    return [json_file, tensor_file]


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_ahead(
    path: Path,
    rank: int,
    processes: int,
    start: int,
    n: int,
    vocab: int,
    device: torch.device,
) -> list[Ahead]:
    """The batches of process ``rank`` of ``processes`` saved in the checkpoint at ``path``
    of round ``start``, with ``n`` responses a prompt and token ids below ``vocab``, on
    ``device`` (none when the checkpoint has none); a one-line error for anything
    malformed, or for batches that other processes than the run's generated."""
    folder = path / AHEAD
    if not folder.is_dir():
        return []
    names = {f.name for f in folder.iterdir()}
    mine = {
        Path(ahead_stem(k)).name + s for k in range(processes) for s in (".json", ".safetensors")
    }
    if names != mine:
        raise fail(
            path,
            f"{AHEAD}/ holds the batches generated ahead of {len(names) // 2} process(es), "
            f"not of this run's {processes}: resume on as many processes as saved them",
        )
    stem = path / ahead_stem(rank)
    json_file, tensor_file = Path(f"{stem}.json"), Path(f"{stem}.safetensors")
    where = f"{ahead_stem(rank)}.json/.safetensors"

    def bad(why: str) -> Exception:
        return fail(path, f"{where}: {why}")

    try:
        data = read_json(json_file)
        tensors = load_file(str(tensor_file))
    except (OSError, ValueError) as exc:
        raise bad(f"unreadable ({str(exc).splitlines()[0] if str(exc) else exc!r})") from None
    records = data.get("batches") if isinstance(data, dict) else None
    if not isinstance(records, list):
        raise bad("no list of batches")
    used: set[str] = set()
    out = []
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise bad(f"batch {i} is not an object")
        rows, formatted = record.get("rows"), record.get("formatted")
        version, round_no = record.get("version"), record.get("round")
        if not isinstance(round_no, int) or round_no != start + 1 + i or not _whole(round_no):
            raise bad(f"batch {i} is for round {round_no!r}, not {start + 1 + i}")
        if not isinstance(version, int) or not _whole(version) or not 0 <= version < start:
            raise bad(f"batch {i}: version {version!r} is not older than the weights ({start})")
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise bad(f"batch {i}: rows are not a list of objects")
        if (
            not isinstance(formatted, list)
            or len(formatted) != len(rows)
            or not all(isinstance(t, str) for t in formatted)
        ):
            raise bad(f"batch {i}: formatted prompts are not one string per row")
        prefixes = [(f"{i}", len(rows) * n, "rollout")]
        if record.get("greedy") is True:
            prefixes.append((f"{i}.greedy", len(rows), "greedy baseline"))
        made: list[Rollout] = []
        for prefix, rows_expected, what in prefixes:
            ro, names = _rollout(tensors, prefix, rows_expected, vocab, version, device)
            if isinstance(ro, str):
                raise bad(f"batch {i}'s {what}: {ro}")
            used |= names
            made.append(ro)
        greedy = made[1] if len(made) > 1 else None
        out.append(Ahead(round_no, version, rows, formatted, made[0], greedy))
    extra = sorted(set(tensors) - used)
    if extra:
        raise bad(f"unknown tensor {extra[0]!r}")
    return out


def _rollout(
    tensors: dict[str, torch.Tensor],
    prefix: str,
    rows: int,
    vocab: int,
    version: int,
    device: torch.device,
) -> tuple[Rollout | str, set[str]]:
    """The Rollout of the tensors named ``prefix.{field}`` (or what is wrong with them) and
    the names it used."""
    values: dict[str, torch.Tensor | None] = {}
    names: set[str] = set()
    for name, (dtype, shape) in _FIELDS.items():
        key = f"{prefix}.{name}"
        t = tensors.get(key)
        if t is None:
            if name in _REQUIRED:
                return f"{name} is missing", names
            values[name] = None
            continue
        names.add(key)
        if t.dtype != dtype:
            return f"{name} is {t.dtype}, not {dtype}", names
        prompt = tensors.get(f"{prefix}.prompt_ids")
        response = tensors.get(f"{prefix}.response_ids")
        width = {"BP": prompt, "BT": response}.get(shape)
        expected = [rows] if shape == "B" else [rows, -1 if width is None else width.shape[-1]]
        if list(t.shape) != expected:
            return f"{name} has shape {list(t.shape)}, not {expected}", names
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"{name} holds NaN or inf", names
        values[name] = t
    for name in ("prompt_ids", "response_ids"):
        ids = values[name]
        assert ids is not None
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            return f"{name} holds ids outside the vocabulary of {vocab}", names
    stamped = values["version"]
    assert stamped is not None
    if stamped.numel() and not bool((stamped == version).all()):
        return f"its rows' versions are not the batch's ({version})", names
    ro = Rollout(**{k: None if v is None else v.to(device) for k, v in values.items()})  # type: ignore[arg-type]
    return ro, names
