"""Reading a checkpoint: the manifest's checksums, the files it lists and nothing else, the
shards covering every tensor once, state.json's ranges; then the states restored."""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from ppokit import distributed
from ppokit.errors import UserError, one_line
from ppokit.runfolder import (
    CHECKPOINT,
    io_error,
    read_json,
)
from ppokit.trainer.checkpoint.layout import (
    AHEAD,
    DCP_FOLDERS,
    MANIFEST,
    NAME,
    OLD,
    REQUIRED,
    RNG,
    SHA256,
    TMP,
    fail,
    format_problem,
    rng_stem,
    state_of,
)
from ppokit.trainer.checkpoint.states import (
    dcp_load,
    decode,
    encode,
    load_optimizers,
    load_weights,
    optimizer_states,
    quiet_dcp,
    restore_rng,
    rng_from_files,
    weights_module,
)
from ppokit.trainer.checkpoint.write import discard, file_sha256, fsync_dir, nonfinite

if TYPE_CHECKING:
    from ppokit.trainer.models import Models
    from ppokit.trainer.optim import Optimizers
    from ppokit.trainer.setup import State


def _regular_files_only(path: Path) -> None:
    """A checkpoint holds folders and regular files: a link (which could lead a read
    anywhere, or a save's rename outside the run) or a device or pipe is refused."""
    for root, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            entry = Path(root) / name
            mode = os.lstat(entry).st_mode
            if stat.S_ISLNK(mode):
                raise fail(path, f"{entry} is a symbolic link (a checkpoint holds files only)")
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise fail(path, f"{entry} is not a regular file")


def _verify(path: Path) -> None:
    """Check ``path``'s manifest and every checksum in it, then that its shards are what
    its state says they are; ``UserError`` naming the file."""
    if os.path.islink(path):
        raise fail(path, "it is a symbolic link (a checkpoint holds files only)")
    try:
        _regular_files_only(path)
    except OSError as exc:
        raise io_error(path, exc, "cannot read") from None
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        try:
            old_format = read_json(path / "state.json").get("format")
        except (OSError, ValueError, AttributeError):
            old_format = None
        if old_format == 1:
            raise fail(
                path,
                "it was written by an older ppokit (format 1, which stored Python pickles) and "
                "is not read, as it could run code; start a new run",
            )
        problem = None if old_format is None else format_problem(old_format)
        if problem is not None:
            raise fail(path, problem)
        raise UserError(f"{manifest_file}: missing (an incomplete checkpoint?)")
    try:
        manifest = read_json(manifest_file)
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        files = manifest["files"]
        if not isinstance(files, dict):
            raise ValueError("'files' is not an object")
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{manifest_file}: unreadable ({one_line(exc)})") from None
    problem = format_problem(manifest.get("format"))
    if problem is not None:
        raise fail(path, problem)
    _check_names(path, manifest_file, files)
    for name, entry in files.items():
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("sha256"), str)
            or not SHA256.fullmatch(entry["sha256"])
            or not isinstance(entry.get("bytes"), int)
        ):
            raise UserError(f"{manifest_file}: malformed entry for {name}")
        file = path / name
        if not file.is_file():
            raise UserError(f"{file}: missing from the checkpoint")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise UserError(
                f"{file}: {size} bytes where the manifest says {entry['bytes']} "
                "(file truncated or corrupted?)"
            )
        if file_sha256(file) != entry["sha256"]:
            raise UserError(f"{file}: checksum mismatch (file corrupted?)")
    _check_shards(path, state_of(path))


#: A DCP shard file: the process (1-based) that wrote it.
_SHARD = re.compile(r"shard-(\d{5})-model-\d{5}-of-\d{5}\.safetensors")


def _check_shards(path: Path, state: dict[str, Any]) -> None:
    """What a checksum cannot tell (a manifest may be sealed again after a shard was
    deleted or a header rewritten): each DCP folder holds one shard set per process
    ``state.json`` records, and its shards cover every element of every tensor exactly
    once (no gap that would keep a fresh value, no overlap); each process's RNG files."""
    processes = int(state["processes"])
    expected = {f"{k:05d}" for k in range(1, processes + 1)}
    for folder in DCP_FOLDERS:
        if not (path / folder).is_dir():
            continue
        names = [f.name for f in (path / folder).iterdir()]
        sets = {m.group(1) for name in names if (m := _SHARD.fullmatch(name))}
        if sets != expected or len(names) != processes:
            raise fail(
                path,
                f"{folder}/ holds {len(names)} shard file(s) of {len(sets)} process(es) but "
                f"state.json records {processes} process(es) (a shard deleted or added?)",
            )
        _check_cover(path, folder)
    for rank in range(processes):
        for suffix in (".json", ".safetensors"):
            if not (path / f"{rng_stem(rank)}{suffix}").is_file():
                raise fail(
                    path,
                    f"{rng_stem(rank)}{suffix} is missing but state.json records "
                    f"{processes} process(es)",
                )


def _check_cover(path: Path, folder: str) -> None:
    """Every tensor of ``path/folder`` is covered exactly once by its shards' chunks."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        with quiet_dcp():
            metadata = HuggingFaceStorageReader(str(path / folder)).read_metadata()
    except Exception as exc:  # a header that is not JSON, or contradicts its file
        raise fail(path, f"unreadable shard files in {folder}/ ({one_line(exc)})") from None
    for name, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue  # not a tensor
        chunks = entry.chunks
        size = [int(n) for n in entry.size]
        boxes = []
        for chunk in chunks:
            offsets, sizes = [int(n) for n in chunk.offsets], [int(n) for n in chunk.sizes]
            if (
                len(offsets) != len(size)
                or len(sizes) != len(size)
                or any(
                    o < 0 or n < 0 or o + n > whole
                    for o, n, whole in zip(offsets, sizes, size, strict=True)
                )
            ):
                raise fail(path, f"{folder}/ {name}: a shard lies outside the tensor {size}")
            boxes.append((offsets, sizes))
        covered = sum(math.prod(sizes) for _, sizes in boxes)
        for i, (a_off, a_size) in enumerate(boxes):
            for b_off, b_size in boxes[i + 1 :]:
                if all(
                    ao < bo + bn and bo < ao + an and an and bn
                    for ao, an, bo, bn in zip(a_off, a_size, b_off, b_size, strict=True)
                ):
                    raise fail(path, f"{folder}/ {name}: two shards overlap")
        if covered != math.prod(size):
            raise fail(
                path,
                f"{folder}/ {name}: its shards cover {covered} of its {math.prod(size)} "
                "elements (a shard deleted or a header rewritten?)",
            )


def _check_names(path: Path, manifest_file: Path, files: dict[str, Any]) -> None:
    """The manifest lists the files a checkpoint has, and nothing else; no file in the
    checkpoint's folders is left unlisted (DCP reads every file of its folder)."""
    for name in REQUIRED:
        if name not in files:
            raise UserError(f"{manifest_file}: {name} is not listed (malformed manifest)")
    for name in files:
        if not NAME.fullmatch(name):
            raise UserError(f"{manifest_file}: unknown file {name!r} (malformed manifest)")
    for folder in ("actor", "optim"):
        if not any(name.startswith(f"{folder}/") for name in files):
            raise UserError(f"{manifest_file}: no {folder}/ file is listed (malformed manifest)")
    for folder in (*DCP_FOLDERS, RNG, AHEAD):
        if not (path / folder).is_dir():
            continue
        for file in (path / folder).iterdir():
            if f"{folder}/{file.name}" not in files:
                raise fail(path, f"{file} is not in its manifest (a file added after saving)")


def locate(out: Path) -> Path:
    """The verified checkpoint directory to resume from.

    ``out/checkpoint`` when it exists (an error in it is reported, never skipped). Without it
    (a crash between the two renames of :func:`save_checkpoint`): the newer
    ``.checkpoint.tmp`` when it is complete and verifies, else ``.checkpoint.old``.
    """
    final = out / CHECKPOINT
    if final.exists():
        if not final.is_dir():
            raise fail(final, "it is not a directory")
        _verify(final)
        return final
    problems = []
    for name in (TMP, OLD):
        candidate = out / name
        if not candidate.is_dir():
            continue
        try:
            _verify(candidate)
        except UserError as exc:
            problems.append(str(exc))
            continue
        return candidate
    if problems:
        raise UserError(
            f"nothing complete to resume: {final} does not exist and the leftover copies do "
            f"not verify ({problems[0]})"
        )
    raise UserError(f"nothing to resume: {final} does not exist (run without --resume)")


#: The most rounds a checkpoint may record (train.rounds' bound) and processes.
def read_state(out: Path) -> dict[str, Any]:
    """The verified checkpoint's ``state.json`` (round, KL coefficient, critic kind)."""
    return state_of(locate(out))


def load_checkpoint(
    out: Path, models: Models, run: State, source: Any, environment: Any = None
) -> int:
    """Restore everything from ``out/checkpoint`` into the ``models`` and the state ``run``
    of a run, the prompt ``source`` and the ``environment`` (its ``load_state_dict``, when
    the checkpoint holds its state); returns the number of rounds done.

    Every checksum is verified before anything is read. Raises :class:`UserError` (one line)
    for a missing, corrupt or incompatible checkpoint, before any file is changed. A
    checkpoint recovered from ``.checkpoint.tmp``/``.checkpoint.old`` is moved back to
    ``out/checkpoint`` once it has been restored.
    """
    path = _locate_once(out)
    state = state_of(path)
    check_critic(path, state, models)
    try:
        for stem, module in weights_module(models):
            load_weights(path, stem, module, models)
        optim = _read_sharded_optimizers(models, run.optimizers, path)
        rng_path = path / rng_stem(distributed.world().rank)
        if not Path(f"{rng_path}.json").is_file():  # more processes than saved it
            rng_path = path / rng_stem(0)
        load_optimizers(models, run.optimizers, optim)
        rng, source_state, env_state = rng_from_files(
            read_json(Path(f"{rng_path}.json")), load_file(f"{rng_path}.safetensors")
        )
        source.load_state_dict(source_state)
        if environment is not None and env_state is not None:
            environment.load_state_dict(env_state)
        kl_coef = float(state["kl_coef"])
        restore_rng(rng)
    except UserError:
        raise
    except Exception as exc:
        raise fail(path, one_line(exc)) from None
    problem = distributed.first_text(nonfinite(models, run.optimizers))  # the optimizers too
    if problem is not None:
        raise fail(path, problem)
    run.kl_coef = torch.tensor(kl_coef, dtype=torch.float32, device=models.runtime.device)
    distributed.barrier()  # every process has read it before it moves
    if path.name != CHECKPOINT and distributed.world().main:
        _promote(out, path)
    return int(state["round"])


def check_critic(path: Path, state: dict[str, Any], models: Models) -> None:
    """The checkpoint at ``path`` (its ``state.json``) has the models' kind of critic."""
    if state.get("critic") != models.critic_kind:
        raise fail(
            path, f"it has critic {state.get('critic')!r} but the spec has {models.critic_kind!r}"
        )


def _read_sharded_optimizers(models: Models, optimizers: Optimizers, path: Path) -> dict[str, Any]:
    """The optimizer and scheduler states of a checkpoint, this process's shards
    read by DCP into the shapes of the run's own (zero-initialised) states."""
    template: dict[str, torch.Tensor] = {}
    encode(optimizer_states(models, optimizers), template, "optim", keep=True)
    stored = read_json(path / "optim.json")
    named = set(_tensor_names(stored))
    if named != set(template):
        differ = sorted(named ^ set(template))
        raise fail(path, f"optim.json does not match the spec's optimizers ({differ[0]} ...)")
    dcp_load(template, path / "optim")
    return decode(stored, template)


def _tensor_names(obj: Any) -> Iterator[str]:
    """The ``{"$tensor": name}`` names in a JSON tree of :func:`encode`."""
    if isinstance(obj, dict):
        if set(obj) == {"$tensor"}:
            yield str(obj["$tensor"])
            return
        for value in obj.values():
            yield from _tensor_names(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _tensor_names(value)


def _locate_once(out: Path) -> Path:
    """:func:`locate` by the first process (which verifies every checksum once), its
    answer (or error) given to every process."""
    if not distributed.world().distributed:
        return locate(out)
    answer = None
    if distributed.world().main:
        try:
            answer = f"ok {locate(out)}"
        except UserError as exc:
            answer = f"error {exc}"
    answer = str(distributed.first_text(answer))
    kind, _, text = answer.partition(" ")
    if kind == "error":
        raise UserError(text)
    return Path(text)


def _promote(out: Path, path: Path) -> None:
    """Move a recovered copy back to ``out/checkpoint`` and drop the other leftover."""
    path.rename(out / CHECKPOINT)
    fsync_dir(out)
    for name in (TMP, OLD):
        discard(out / name)
