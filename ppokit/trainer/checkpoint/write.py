"""Writing a checkpoint: every tensor finite, the files into ``.checkpoint.tmp``, a manifest
of checksums last, then the atomic swap."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from ppokit import distributed
from ppokit.errors import UserError
from ppokit.runfolder import (
    CHECKPOINT,
    io_error,
    is_os_error,
    read_json,
    remove,
)
from ppokit.trainer.checkpoint.ahead import Ahead, ahead_stem, write_ahead
from ppokit.trainer.checkpoint.layout import (
    AHEAD,
    FORMAT,
    MANIFEST,
    OLD,
    RNG,
    TMP,
    rng_stem,
    state_problem,
)
from ppokit.trainer.checkpoint.states import (
    base_fingerprint,
    capture_rng,
    dcp_save,
    encode,
    first_nonfinite,
    model_state,
    optimizer_states,
    rng_files,
    weights_module,
)

if TYPE_CHECKING:
    from ppokit.trainer.models import Models
    from ppokit.trainer.optim import Optimizers
    from ppokit.trainer.setup import State


class NonFiniteCheckpointError(UserError):
    """A model or optimizer tensor holds NaN or inf: such a state is never saved."""


def _named_tensors(models: Models, optimizers: Optimizers) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a checkpoint stores of the models and optimizers, with a readable name
    (this process's shards on several processes)."""
    names: dict[int, str] = {}
    for label, module in weights_module(models):
        for name, tensor in module.state_dict(keep_vars=True).items():
            names.setdefault(id(tensor), f"{label} {name}")
            yield f"{label} {name}", distributed.local_tensor(tensor)
    for label, opt, _ in optimizers.named():
        for param, state in opt.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    owner = names.get(id(param), f"{label} parameter")
                    yield f"the optimizer's {key} of {owner}", distributed.local_tensor(value)


def nonfinite(models: Models, optimizers: Optimizers) -> str | None:
    """``'NAME holds NaN or inf'`` for the first model or optimizer tensor (of this
    process's) that does, else None (one host read per device when all are finite)."""
    return first_nonfinite(_named_tensors(models, optimizers))


def check_finite(models: Models, optimizers: Optimizers) -> None:
    """Raise :class:`NonFiniteCheckpointError` naming the first model or optimizer tensor
    that holds a NaN or an inf."""
    problem = nonfinite(models, optimizers)
    if problem is not None:
        raise NonFiniteCheckpointError(problem)


def checkpoint_round(out: Path) -> int | None:
    """The round of the checkpoint a resume would read (unverified, cheap; None: none)."""
    for name in (CHECKPOINT, TMP, OLD):
        folder = out / name
        if name != CHECKPOINT and not (folder / MANIFEST).is_file():
            continue
        try:
            state = read_json(folder / "state.json")
            if state_problem(state) is None:
                return int(state["round"])
        except (OSError, ValueError):
            pass
        if name == CHECKPOINT and folder.exists():
            return None
    return None


def save_checkpoint(
    out: Path,
    models: Models,
    state: State,
    source: Any,
    round_done: int,
    spec_yaml: str,
    producer: Mapping[str, Any] | None = None,
    environment: Any = None,
) -> Path:
    """Write ``out/checkpoint`` atomically; returns its path. On several processes every
    process calls it: each writes its own shards, RNG states, source position and the
    ``environment``'s state (its ``state_dict()``, when it keeps one), the first one the
    rest. ``producer``: the state of the run's producer (its ``state_dict()``): its
    ``batches``, this process's batches generated for the rounds after ``round_done``
    (asynchronous rollouts; as many on every process), in ``ahead/``; the rest (JSON, the
    same on every process) in ``state.json`` as ``producer``.

    Refused (:class:`NonFiniteCheckpointError`) when a model or optimizer tensor is not
    finite on any process. On any error the partly written temporary folder is removed and
    the previous checkpoint is kept; an OS error (disk full, read-only folder, permission
    denied, also as safetensors reports it) on any process is one ``UserError`` line, on
    every process, naming the path and the cause.
    """
    world = distributed.world()
    final, tmp = out / CHECKPOINT, out / TMP
    own = dict(producer or {})
    ahead: Sequence[Ahead] = own.pop("batches", ())
    previous = checkpoint_round(out)
    kept = (
        f"the last good checkpoint (round {previous}) is kept in {final}"
        if previous is not None
        else "no checkpoint was written"
    )
    problem = distributed.first_text(nonfinite(models, state.optimizers))
    if problem is not None:
        raise NonFiniteCheckpointError(
            f"round {round_done}: not saving a checkpoint: {problem} (the training diverged: "
            f"lower the learning rate or set train.max_grad_norm); {kept}"
        )
    doing = f"cannot write the checkpoint of round {round_done}"
    error = None
    if world.main:
        try:
            remove(tmp)  # a leftover folder, or a link (itself): never written through
            tmp.mkdir(parents=True)  # afresh: it fails if something is there again
            (tmp / RNG).mkdir()
            if ahead:
                (tmp / AHEAD).mkdir()
        except OSError as exc:
            error = str(io_error(tmp, exc, doing))
    error = distributed.first_text(error)
    if error is None:
        try:
            env_state = None if environment is None else environment.state_dict()
            _write_tmp(tmp, models, state, source, round_done, spec_yaml, ahead, env_state, own)
        except BaseException as exc:
            if not is_os_error(exc):
                if world.main:
                    discard(tmp)
                raise  # not an OS error: a bug, a user error or an interrupt
            error = str(io_error(tmp, exc, doing))
        error = distributed.first_text(error)  # every process's files are written
        if error is not None and world.main:
            discard(tmp)
    if error is None:
        error = distributed.first_text(_seal_and_swap(out, doing) if world.main else None)
    if error is not None:
        raise UserError(f"{error}; {kept}")
    return final


def _write_tmp(
    tmp: Path,
    models: Models,
    state: State,
    source: Any,
    round_done: int,
    spec_yaml: str,
    ahead: Sequence[Ahead] = (),
    env_state: Any = None,
    producer: dict[str, Any] | None = None,
) -> None:
    """This process's part of a checkpoint in ``tmp`` (made by the first process): its
    shards of the weights and optimizer states (collectives), its RNG states and batches
    generated ahead; the first process also writes the JSON files. Everything is synced."""
    world = distributed.world()
    base = base_fingerprint(models)  # a collective: before the first process's own writes
    for stem, module in weights_module(models):
        dcp_save(model_state(stem, module, models), tmp / stem)
    tensors: dict[str, torch.Tensor] = {}
    optim = encode(optimizer_states(models, state.optimizers), tensors, "optim", keep=True)
    dcp_save(tensors, tmp / "optim")
    rng_data, rng_tensors = rng_files(capture_rng(), source.state_dict(), env_state)
    rng = tmp / rng_stem(world.rank)
    save_file(rng_tensors, f"{rng}.safetensors")
    Path(f"{rng}.json").write_text(json.dumps(rng_data) + "\n")
    mine = [Path(f"{rng}.safetensors"), Path(f"{rng}.json")]
    if ahead:
        mine += write_ahead(tmp / ahead_stem(world.rank), ahead)
    if world.main:
        record: dict[str, Any] = {
            "format": FORMAT,
            "round": round_done,
            "kl_coef": float(state.kl_coef),
            "critic": models.critic_kind,
            "processes": world.size,
            "lora_base": base,
        }
        if producer:  # what the producer keeps besides its batches (the lookahead's counts)
            record["producer"] = producer
        (tmp / "optim.json").write_text(json.dumps(optim) + "\n")
        (tmp / "state.json").write_text(json.dumps(record, indent=2) + "\n")
        (tmp / "spec.yaml").write_text(spec_yaml)
        mine += [tmp / "optim.json", tmp / "state.json", tmp / "spec.yaml"]
    for file in mine:  # DCP syncs its own files
        _fsync(file)


def _seal_and_swap(out: Path, doing: str) -> str | None:
    """The first process: the manifest of the complete ``.checkpoint.tmp``, then the two
    renames that make it ``checkpoint``; an OS error's line (None: done)."""
    final, tmp, old = out / CHECKPOINT, out / TMP, out / OLD
    try:
        files = {}
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            files[f.relative_to(tmp).as_posix()] = {
                "sha256": file_sha256(f),
                "bytes": f.stat().st_size,
            }
        manifest = {"format": FORMAT, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _fsync(tmp / MANIFEST)
        for folder in (tmp, *(p for p in tmp.iterdir() if p.is_dir())):
            fsync_dir(folder)
    except OSError as exc:
        discard(tmp)
        return str(io_error(tmp, exc, doing))
    try:
        remove(old)
        if os.path.lexists(final):
            final.rename(old)
        tmp.rename(final)
        fsync_dir(out)
    except OSError as exc:
        if not final.exists() and old.is_dir():
            with contextlib.suppress(OSError):
                old.rename(final)  # put the previous checkpoint back
        if final.is_dir():
            discard(tmp)
        return str(io_error(final, exc, doing))
    discard(old)
    return None


def discard(path: Path) -> None:
    """:func:`remove`, its errors ignored (a leftover is removed by the next save)."""
    with contextlib.suppress(OSError):
        remove(path)


def file_sha256(file: Path) -> str:
    """The SHA-256 of ``file``'s bytes, read in 1 MiB chunks (hex)."""
    digest = hashlib.sha256()
    with open(file, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(file: Path) -> None:
    with open(file, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    """Make renames in ``path`` durable (where the platform can open a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
