"""Checkpoints: ``OUT/checkpoint/`` with the actor and critic weights, the optimizer and
scheduler states, the RNG states (python, numpy, torch, CUDA, the prompt source), the round
counter, the adaptive KL state and the resolved spec.

Reading a checkpoint never runs code: nothing is unpickled. Tensors are stored as
safetensors, everything else as JSON::

    checkpoint/
      manifest.json        {"format": 3, "files": {name: {"sha256": ..., "bytes": ...}}}
      state.json           format, round, KL coefficient, critic kind
      spec.yaml            the resolved spec of the run
      actor.safetensors    actor weights
      critic.safetensors   critic weights (the value head only for a shared critic)
      optim.json           optimizer states keyed by parameter name (torch.distributed.
                           checkpoint's form) and scheduler states, tensors as
                           {"$tensor": name}
      optim.safetensors    ... and those tensors
      rng.json             python and numpy RNG states, the prompt source's state
      rng.safetensors      torch CPU and CUDA RNG states (uint8)

A run on several processes writes the same files: the model and optimizer states are
gathered whole from every process's shards (``torch.distributed.checkpoint.state_dict``)
and process 0 writes them; on loading, every process reads them and keeps its own shards.
So a checkpoint resumes on any number of processes, and ``ppokit export`` reads it as any
other. (The first process holds the whole state in CPU memory while it saves.)

The manifest is written last and holds a SHA-256 of every other file; a checkpoint is read
only once every checksum verifies. Writing is atomic: a temporary directory
``.checkpoint.tmp`` is filled and synced, the previous checkpoint is renamed to
``.checkpoint.old``, the temporary one to ``checkpoint``, and the old one is removed. A crash
between the two renames leaves no ``checkpoint``; resuming then reads the complete copy (the
newer ``.checkpoint.tmp`` when its manifest verifies, else ``.checkpoint.old``) and moves it
back into place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from ppokit import distributed
from ppokit.errors import UserError
from ppokit.runfiles import CHECKPOINT
from ppokit.trainer.rundir import io_error, is_os_error

__all__ = [
    "CHECKPOINT",
    "NonFiniteCheckpointError",
    "capture_rng",
    "checkpoint_round",
    "has_checkpoint",
    "load_checkpoint",
    "read_state",
    "restore_rng",
    "save_checkpoint",
    "truncate_jsonl",
]

TMP = f".{CHECKPOINT}.tmp"
OLD = f".{CHECKPOINT}.old"
FORMAT = 3
#: Formats this version reads (2: optimizer states keyed by parameter index).
READABLE = (2, 3)
MANIFEST = "manifest.json"
#: Files every checkpoint has, and the one it may have.
REQUIRED = (
    "state.json",
    "spec.yaml",
    "actor.safetensors",
    "optim.json",
    "optim.safetensors",
    "rng.json",
    "rng.safetensors",
)
OPTIONAL = ("critic.safetensors",)
_SHA256 = re.compile(r"[0-9a-f]{64}")


# --------------------------------------------------------------------------- RNG
def capture_rng() -> dict[str, Any]:
    """The python, numpy, torch (and CUDA) RNG states."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)


def _rng_files(rng: dict[str, Any], source_state: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(rng.json object, rng.safetensors tensors) of an RNG capture and a source state."""
    version, internal, gauss_next = rng["python"]
    bit_generator, key, pos, has_gauss, cached_gaussian = rng["numpy"]
    tensors: dict[str, torch.Tensor] = {"torch": rng["torch"]}
    cuda = list(rng.get("cuda", ()))
    for index, cuda_state in enumerate(cuda):
        tensors[f"cuda.{index}"] = cuda_state
    data = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": str(bit_generator),
            "key": [int(k) for k in np.asarray(key).tolist()],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "cuda_devices": len(cuda),
        "source": _encode(source_state, tensors, "source"),
    }
    return data, tensors


def _ints(values: Any, what: str) -> list[int]:
    if not isinstance(values, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    ):
        raise ValueError(f"{what} is not a list of integers")
    return values


def _rng_from_files(data: Any, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any], Any]:
    """(RNG state for :func:`restore_rng`, prompt source state) from rng.json/.safetensors."""
    if not isinstance(data, dict):
        raise ValueError("rng.json is not an object")
    py, npy = data["python"], data["numpy"]
    gauss = py["gauss_next"]
    python = (
        int(py["version"]),
        tuple(_ints(py["state"], "python.state")),
        None if gauss is None else float(gauss),
    )
    key = np.asarray(_ints(npy["key"], "numpy.key"), dtype=np.int64)
    if key.size and (key.min() < 0 or key.max() > 0xFFFFFFFF):
        raise ValueError("numpy.key is out of range")
    numpy_state = (
        str(npy["bit_generator"]),
        key.astype(np.uint32),
        int(npy["pos"]),
        int(npy["has_gauss"]),
        float(npy["cached_gaussian"]),
    )
    state: dict[str, Any] = {"python": python, "numpy": numpy_state, "torch": tensors["torch"]}
    devices = int(data.get("cuda_devices", 0))
    if devices:
        state["cuda"] = [tensors[f"cuda.{i}"] for i in range(devices)]
    return state, _decode(data["source"], tensors)


# ------------------------------------------------------------ state trees as JSON
def _encode(obj: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    """``obj`` (nested dicts, lists, tuples, scalars, tensors) as JSON; its tensors are added
    to ``tensors`` and referenced as ``{"$tensor": name}``. Tuples and dicts whose keys are
    not plain strings are tagged (``$tuple``, ``$items``) so they come back as they were."""
    if isinstance(obj, torch.Tensor):
        name = path if path not in tensors else f"{path}#{len(tensors)}"
        tensor = obj.detach().to("cpu").contiguous()
        if any(t.data_ptr() == tensor.data_ptr() for t in tensors.values() if t.numel()):
            tensor = tensor.clone()  # safetensors refuses tensors sharing memory
        tensors[name] = tensor
        return {"$tensor": name}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"$tuple": [_encode(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: _encode(v, tensors, f"{path}/{k}") for k, v in obj.items()}
        return {
            "$items": [
                [_encode(k, tensors, f"{path}/key"), _encode(v, tensors, f"{path}/{k}")]
                for k, v in obj.items()
            ]
        }
    raise TypeError(f"cannot store a {type(obj).__name__} in a checkpoint ({path})")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`_encode`; ``ValueError``/``KeyError`` on anything malformed."""
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        tags = [k for k in obj if k.startswith("$")]
        if not tags:
            return {k: _decode(v, tensors) for k, v in obj.items()}
        if len(obj) != 1:
            raise ValueError(f"malformed tagged value {sorted(obj)[:3]}")
        tag, value = next(iter(obj.items()))
        if tag == "$tensor" and isinstance(value, str):
            if value not in tensors:
                raise ValueError(f"tensor {value!r} is missing")
            return tensors[value]
        if tag == "$tuple" and isinstance(value, list):
            return tuple(_decode(v, tensors) for v in value)
        if tag == "$items" and isinstance(value, list):
            items = {}
            for item in value:
                if not isinstance(item, list) or len(item) != 2:
                    raise ValueError("malformed $items entry")
                items[_decode(item[0], tensors)] = _decode(item[1], tensors)
            return items
        raise ValueError(f"unknown tag {tag!r}")
    return obj


def _write_tree(obj: Any, folder: Path, stem: str) -> None:
    """``stem.json`` + ``stem.safetensors``."""
    tensors: dict[str, torch.Tensor] = {}
    data = _encode(obj, tensors, stem)
    save_file(tensors, str(folder / f"{stem}.safetensors"))
    (folder / f"{stem}.json").write_text(json.dumps(data) + "\n")


def _read_json(file: Path) -> Any:
    return json.loads(file.read_text(encoding="utf-8"))


# ------------------------------------------------------------ model and optimizer states
def _whole() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _weights_module(models: Any) -> list[tuple[str, torch.nn.Module]]:
    """(file stem, module) of the weights a checkpoint stores."""
    out = [("actor", models.actor)]
    if models.critic is not None:
        out.append(("critic", models.critic.head if models.shared_critic else models.critic))
    return out


def _optimizers(learner: Any) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer]]:
    """(name, module holding its parameters, optimizer) of each optimizer."""
    out = [("actor", learner.models.actor, learner.actor_opt)]
    if learner.critic_opt is not None:
        out.append(("critic", learner.models.critic, learner.critic_opt))
    return out


def _tied(module: torch.nn.Module) -> set[str]:
    """Names of parameters that are another name's parameter (tied weights): stored once."""
    seen: set[int] = set()
    drop = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            drop.add(name)
        seen.add(id(p))
    return drop


def _whole_weights(stem: str, module: torch.nn.Module, models: Any) -> dict[str, torch.Tensor]:
    """``module``'s whole weights gathered from every process's shards (a collective; the
    first process gets them, the others an empty dict)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    owner = models.critic if stem == "critic" and models.shared_critic else module
    state = get_model_state_dict(owner, options=_whole())
    if owner is not module:  # a shared critic stores its head alone
        state = {k.removeprefix("head."): v for k, v in state.items()}
    drop = _tied(module)
    return {k: v.detach().contiguous() for k, v in state.items() if k not in drop}


def _optimizer_states(learner: Any) -> dict[str, Any]:
    """Optimizer states keyed by parameter name (whole, gathered on several processes) and
    the schedulers'."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optim: dict[str, Any] = {}
    for name, module, opt in _optimizers(learner):
        optim[name] = get_optimizer_state_dict(module, opt, options=_whole())
        sched = learner.actor_sched if name == "actor" else learner.critic_sched
        optim[f"{name}_sched"] = sched.state_dict()
    return optim


def _load_optimizers(learner: Any, optim: dict[str, Any], form: int) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    for name, module, opt in _optimizers(learner):
        if form == 2:  # keyed by parameter index: one process only
            if distributed.world().distributed:
                raise UserError(
                    "this checkpoint (format 2) resumes on one process only: resume it "
                    "without a launcher, then continue on several"
                )
            opt.load_state_dict(optim[name])
        else:
            options = StateDictOptions(full_state_dict=True)
            set_optimizer_state_dict(module, opt, optim[name], options=options)
            for group in opt.param_groups:  # it gives tuples (AdamW's betas) back as lists
                for key, default in opt.defaults.items():
                    if isinstance(default, tuple) and isinstance(group.get(key), list):
                        group[key] = tuple(group[key])
        sched = learner.actor_sched if name == "actor" else learner.critic_sched
        sched.load_state_dict(optim[f"{name}_sched"])


def _load_whole_weights(stem: str, module: torch.nn.Module, models: Any, file: Path) -> None:
    """Every process reads the whole weights and keeps its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = load_file(str(file))
    owner = module
    if stem == "critic" and models.shared_critic:
        owner = models.critic
        state = {f"head.{k}": v for k, v in state.items()}
    options = StateDictOptions(full_state_dict=True, strict=False)
    missing, unexpected = set_model_state_dict(owner, state, options=options)
    missing = [k for k in missing if k not in _tied(owner)]
    if missing or unexpected:
        names = ", ".join([*missing, *unexpected][:3])
        raise UserError(f"{file}: does not match the spec's model ({names} ...)")


# -------------------------------------------------------------------------- write
class NonFiniteCheckpointError(UserError):
    """A model or optimizer tensor holds NaN or inf: such a state is never saved."""


def _named_tensors(learner: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a checkpoint stores of the models and optimizers, with a readable name."""
    models = learner.models
    modules: list[tuple[str, torch.nn.Module]] = [("actor", models.actor)]
    if models.critic is not None:
        modules.append(("critic", models.critic.head if models.shared_critic else models.critic))
    names: dict[int, str] = {}
    for label, module in modules:
        for name, tensor in module.state_dict(keep_vars=True).items():
            names.setdefault(id(tensor), f"{label} {name}")
            yield f"{label} {name}", tensor
    for label, opt in (("actor", learner.actor_opt), ("critic", learner.critic_opt)):
        if opt is None:
            continue
        for param, state in opt.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    owner = names.get(id(param), f"{label} parameter")
                    yield f"the optimizer's {key} of {owner}", value


def check_finite(learner: Any) -> None:
    """Raise :class:`NonFiniteCheckpointError` naming the first model or optimizer tensor
    that holds a NaN or an inf (one host read per device when all are finite)."""
    tensors = [
        (name, t) for name, t in _named_tensors(learner) if t.is_floating_point() or t.is_complex()
    ]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, t in tensors:
        by_device.setdefault(t.device, []).append(torch.isfinite(t.detach()).all())
    if all(bool(torch.stack(flags).all()) for flags in by_device.values()):
        return
    for name, t in tensors:
        if not bool(torch.isfinite(t.detach()).all()):
            raise NonFiniteCheckpointError(f"{name} holds NaN or inf")
    raise NonFiniteCheckpointError("a tensor holds NaN or inf")  # pragma: no cover


def _check_finite_states(
    states: tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]],
) -> None:
    """:func:`check_finite` on gathered states."""
    weights, optim = states
    named = [(f"{stem} {k}", t) for stem, ts in weights.items() for k, t in ts.items()]
    for name in ("actor", "critic"):
        for param, state in optim.get(name, {}).get("state", {}).items():
            named += [
                (f"the optimizer's {key} of {name} {param}", v)
                for key, v in state.items()
                if isinstance(v, torch.Tensor)
            ]
    for name, t in named:
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            raise NonFiniteCheckpointError(f"{name} holds NaN or inf")


def checkpoint_round(out: Path) -> int | None:
    """The round of the checkpoint a resume would read (unverified, cheap; None: none)."""
    for name in (CHECKPOINT, TMP, OLD):
        folder = out / name
        if name != CHECKPOINT and not (folder / MANIFEST).is_file():
            continue
        try:
            return int(_read_json(folder / "state.json")["round"])
        except (OSError, ValueError, KeyError, TypeError):
            if name == CHECKPOINT and folder.exists():
                return None
    return None


def save_checkpoint(out: Path, learner: Any, source: Any, round_done: int, spec_yaml: str) -> Path:
    """Write ``out/checkpoint`` atomically; returns its path.

    Refused (:class:`NonFiniteCheckpointError`) when a model or optimizer tensor is not
    finite. On any error the partly written temporary folder is removed and the previous
    checkpoint is kept; an OS error (disk full, read-only folder, permission denied, also as
    safetensors reports it) is one ``UserError`` line naming the path and the cause.
    """
    world = distributed.world()
    if world.distributed:  # every process takes part in gathering; the first one writes
        models = learner.models
        weights = {stem: _whole_weights(stem, m, models) for stem, m in _weights_module(models)}
        states = (weights, _optimizer_states(learner))
        problem = None
        if world.main:
            try:
                return _save_gathered(out, learner, source, round_done, spec_yaml, states)
            except UserError as exc:
                problem = str(exc)
                raise
            finally:
                distributed.broadcast_text(problem)
        problem = distributed.broadcast_text(None)
        if problem is not None:
            raise UserError(problem)
        return out / CHECKPOINT
    return _save_gathered(out, learner, source, round_done, spec_yaml, None)


def _save_gathered(
    out: Path,
    learner: Any,
    source: Any,
    round_done: int,
    spec_yaml: str,
    states: tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]] | None,
) -> Path:
    final = out / CHECKPOINT
    tmp = out / TMP
    old = out / OLD
    previous = checkpoint_round(out)
    kept = (
        f"the last good checkpoint (round {previous}) is kept in {final}"
        if previous is not None
        else "no checkpoint was written"
    )
    try:
        if states is None:
            check_finite(learner)
        else:
            _check_finite_states(states)
    except NonFiniteCheckpointError as exc:
        raise NonFiniteCheckpointError(
            f"round {round_done}: not saving a checkpoint: {exc} (the training diverged: "
            f"lower the learning rate or set train.max_grad_norm); {kept}"
        ) from None
    try:
        _write_tmp(tmp, learner, source, round_done, spec_yaml, states)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_os_error(exc):
            raise  # not an OS error: a bug, a user error or an interrupt
        error = io_error(tmp, exc, f"cannot write the checkpoint of round {round_done}")
        raise UserError(f"{error}; {kept}") from None
    try:
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        _fsync_dir(out)
    except OSError as exc:
        if not final.exists() and old.is_dir():
            with contextlib.suppress(OSError):
                old.rename(final)  # put the previous checkpoint back
        if final.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        error = io_error(final, exc, f"cannot write the checkpoint of round {round_done}")
        raise UserError(f"{error}; {kept}") from None
    shutil.rmtree(old, ignore_errors=True)
    return final


def _write_tmp(
    tmp: Path,
    learner: Any,
    source: Any,
    round_done: int,
    spec_yaml: str,
    states: tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]] | None = None,
) -> None:
    """Fill ``tmp`` with a complete, synced checkpoint (manifest last). ``states``: the
    whole weights and optimizer states gathered from several processes (else read from the
    models and optimizers)."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    models = learner.models
    if states is None:
        for stem, module in _weights_module(models):
            save_model(module, str(tmp / f"{stem}.safetensors"))
        optim = _optimizer_states(learner)
    else:
        weights, optim = states
        for stem, tensors in weights.items():
            save_file(tensors, str(tmp / f"{stem}.safetensors"))
    _write_tree(optim, tmp, "optim")
    rng_data, rng_tensors = _rng_files(capture_rng(), source.state_dict())
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    (tmp / "rng.json").write_text(json.dumps(rng_data) + "\n")
    state = {
        "format": FORMAT,
        "round": round_done,
        "kl_coef": float(learner.kl_coef),
        "critic": None
        if models.critic is None
        else ("shared" if models.shared_critic else "separate"),
    }
    (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
    (tmp / "spec.yaml").write_text(spec_yaml)
    _fsync_files(tmp)
    files = {}
    for f in sorted(tmp.iterdir()):
        files[f.name] = {"sha256": _sha256(f), "bytes": f.stat().st_size}
    manifest = {"format": FORMAT, "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    _fsync_files(tmp, MANIFEST)
    _fsync_dir(tmp)


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_files(path: Path, only: str | None = None) -> None:
    for f in path.iterdir():
        if only is None or f.name == only:
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
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


# --------------------------------------------------------------------------- read
def _fail(path: Path, why: str) -> UserError:
    return UserError(f"checkpoint {path} cannot be used: {why}")


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _verify(path: Path) -> None:
    """Check ``path``'s manifest and every checksum in it; ``UserError`` naming the file."""
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        try:
            old_format = _read_json(path / "state.json").get("format")
        except (OSError, ValueError, AttributeError):
            old_format = None
        if old_format == 1:
            raise _fail(
                path,
                "it was written by an older ppokit (format 1, which stored Python pickles) and "
                "is not read, as it could run code; start a new run",
            )
        raise UserError(f"{manifest_file}: missing (an incomplete checkpoint?)")
    try:
        manifest = _read_json(manifest_file)
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        files = manifest["files"]
        if not isinstance(files, dict):
            raise ValueError("'files' is not an object")
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{manifest_file}: unreadable ({_one_line(exc)})") from None
    if manifest.get("format") not in READABLE:
        raise _fail(path, f"unknown checkpoint format {manifest.get('format')!r}")
    for name in REQUIRED:
        if name not in files:
            raise UserError(f"{manifest_file}: {name} is not listed (malformed manifest)")
    for name, entry in files.items():
        if name not in REQUIRED and name not in OPTIONAL:
            raise UserError(f"{manifest_file}: unknown file {name!r} (malformed manifest)")
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("sha256"), str)
            or not _SHA256.fullmatch(entry["sha256"])
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
        if _sha256(file) != entry["sha256"]:
            raise UserError(f"{file}: checksum mismatch (file corrupted?)")


def has_checkpoint(out: Path) -> bool:
    """Whether ``out`` holds something to resume from (cheap: nothing is verified)."""
    return (out / CHECKPOINT).exists() or any(
        (out / name / MANIFEST).is_file() for name in (TMP, OLD)
    )


def _locate(out: Path) -> Path:
    """The verified checkpoint directory to resume from.

    ``out/checkpoint`` when it exists (an error in it is reported, never skipped). Without it
    (a crash between the two renames of :func:`save_checkpoint`): the newer
    ``.checkpoint.tmp`` when it is complete and verifies, else ``.checkpoint.old``.
    """
    final = out / CHECKPOINT
    if final.exists():
        if not final.is_dir():
            raise _fail(final, "it is not a directory")
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


def _state_of(path: Path) -> dict[str, Any]:
    try:
        state = _read_json(path / "state.json")
        int(state["round"])
        float(state["kl_coef"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _fail(path, f"state.json is unreadable ({_one_line(exc)})") from None
    if state.get("format") not in READABLE:
        raise _fail(path, f"unknown checkpoint format {state.get('format')!r}")
    return state


def read_state(out: Path) -> dict[str, Any]:
    """The verified checkpoint's ``state.json`` (round, KL coefficient, critic kind)."""
    return _state_of(_locate(out))


def load_checkpoint(out: Path, learner: Any, source: Any) -> int:
    """Restore everything from ``out/checkpoint``; returns the number of rounds done.

    Every checksum is verified before anything is read. Raises :class:`UserError` (one line)
    for a missing, corrupt or incompatible checkpoint, before any file is changed. A
    checkpoint recovered from ``.checkpoint.tmp``/``.checkpoint.old`` is moved back to
    ``out/checkpoint`` once it has been restored.
    """
    path = _locate(out)
    state = _state_of(path)
    models = learner.models
    critic_kind = (
        None if models.critic is None else ("shared" if models.shared_critic else "separate")
    )
    if state.get("critic") != critic_kind:
        raise _fail(path, f"it has critic {state.get('critic')!r} but the spec has {critic_kind!r}")
    try:
        for stem, module in _weights_module(models):
            if distributed.world().distributed:
                _load_whole_weights(stem, module, models, path / f"{stem}.safetensors")
            else:
                _load_weights(module, path / f"{stem}.safetensors")
        optim = _decode(_read_json(path / "optim.json"), load_file(path / "optim.safetensors"))
        _load_optimizers(learner, optim, int(state["format"]))
        rng, source_state = _rng_from_files(
            _read_json(path / "rng.json"), load_file(path / "rng.safetensors")
        )
        source.load_state_dict(source_state)
        kl_coef = float(state["kl_coef"])
        restore_rng(rng)
    except UserError:
        raise
    except Exception as exc:
        raise _fail(path, _one_line(exc)) from None
    learner.kl_coef = torch.tensor(kl_coef, dtype=torch.float32, device=learner.device)
    distributed.barrier()  # every process has read it before it moves
    if path.name != CHECKPOINT and distributed.world().main:
        _promote(out, path)
    return int(state["round"])


def _promote(out: Path, path: Path) -> None:
    """Move a recovered copy back to ``out/checkpoint`` and drop the other leftover."""
    path.rename(out / CHECKPOINT)
    _fsync_dir(out)
    for name in (TMP, OLD):
        shutil.rmtree(out / name, ignore_errors=True)


def _load_weights(module: torch.nn.Module, file: Path) -> None:
    missing, unexpected = load_model(
        module, str(file), strict=False, device=str(next(module.parameters()).device)
    )
    if missing or unexpected:
        names = ", ".join([*missing, *unexpected][:3])
        raise UserError(f"{file}: does not match the spec's model ({names} ...)")


def truncate_jsonl(path: Path, rounds: int) -> None:
    """Keep only the lines of ``path`` with ``round <= rounds`` (atomically)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line)["round"]) <= rounds:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    tmp.replace(path)
