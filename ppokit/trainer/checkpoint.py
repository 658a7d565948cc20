"""Checkpoints: ``OUT/checkpoint/`` with the actor and critic weights, the optimizer and
scheduler states, every process's RNG states (python, numpy, torch, CUDA) and the prompt
source's position, the round counter, the adaptive KL state and the resolved spec.

Reading a checkpoint never runs code: nothing is unpickled. Tensors are stored as
safetensors, everything else as JSON::

    checkpoint/
      manifest.json        {"format": 4, "files": {path: {"sha256": ..., "bytes": ...}}}
      state.json           format, round, KL coefficient, critic kind, processes, the
                           LoRA base weights' sums
      spec.yaml            the resolved spec of the run
      actor/               actor weights: shard-0000K-model-00001-of-00001.safetensors, one
                           file per process holding its shards (one file: the whole state);
                           with LoRA the trained parameters alone (the adapters): the frozen
                           base weights are the spec's model's, checked against two sums
                           recorded in state.json
      critic/              critic weights, the same way (the value head only for a shared
                           critic)
      optim/               the optimizer states' tensors, the same way
      optim.json           the optimizer states keyed by parameter name (torch.distributed.
                           checkpoint's form) and the scheduler states, tensors as
                           {"$tensor": name} (a name in optim/)
      rng/process-0000K.json         process K's python and numpy RNG states and the
      rng/process-0000K.safetensors  prompt source's state; its torch and CUDA RNG states

The weights and optimizer states are written and read by ``torch.distributed.checkpoint``
(DCP) through its Hugging Face storage: every process writes its own shards (nothing is
gathered on one process) and reads back the parts its shards need, so a checkpoint resumes
on any number of processes, including one without a launcher, and the same DCP reader
gives ``ppokit export`` the whole weights. The files are plain safetensors whose header
carries DCP's shard offsets as JSON; a single-process run's ``actor/`` file is an ordinary
state dict.

The manifest is written last and holds a SHA-256 of every other file; a checkpoint is read
only once every checksum verifies and no file in its folders is unlisted. Writing is
atomic: a temporary directory ``.checkpoint.tmp`` is filled and synced, the previous
checkpoint is renamed to ``.checkpoint.old``, the temporary one to ``checkpoint``, and the
old one is removed. A crash between the two renames leaves no ``checkpoint``; resuming then
reads the complete copy (the newer ``.checkpoint.tmp`` when its manifest verifies, else
``.checkpoint.old``) and moves it back into place.

A checkpoint of an older format is not read: one line says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import random
import re
import stat
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ppokit import distributed
from ppokit.errors import UserError
from ppokit.runfolder import (
    CHECKPOINT,
    CHECKPOINT_OLD,
    CHECKPOINT_TMP,
    has_checkpoint,
    io_error,
    is_os_error,
    read_json,
    remove,
)

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
]

TMP = CHECKPOINT_TMP
OLD = CHECKPOINT_OLD
FORMAT = 4
MANIFEST = "manifest.json"
#: The folders DCP writes (one safetensors file per process each) and the RNG folder.
DCP_FOLDERS = ("actor", "critic", "optim")
RNG = "rng"


def _rng_stem(rank: int) -> str:
    """Process ``rank``'s RNG files, without their suffix."""
    return f"{RNG}/process-{rank:05d}"


#: Files every checkpoint has (format 4; ``actor/`` and ``optim/`` hold at least one file).
REQUIRED = ("state.json", "spec.yaml", "optim.json", f"{_rng_stem(0)}.json")
_NAME = re.compile(
    r"(state\.json|spec\.yaml|optim\.json"
    rf"|({'|'.join(DCP_FOLDERS)})/[A-Za-z0-9_-][A-Za-z0-9_.-]*\.safetensors"
    rf"|{RNG}/process-\d{{5}}\.(json|safetensors))"
)
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
def _encode(obj: Any, tensors: dict[str, torch.Tensor], path: str, keep: bool = False) -> Any:
    """``obj`` (nested dicts, lists, tuples, scalars, tensors) as JSON; its tensors are added
    to ``tensors`` and referenced as ``{"$tensor": name}`` (names follow the path, so the
    same tree gives the same names). Tuples and dicts whose keys are not plain strings are
    tagged (``$tuple``, ``$items``) so they come back as they were. ``keep``: the tensors
    themselves (DTensors included, for DCP), not contiguous CPU copies (for safetensors)."""
    if isinstance(obj, torch.Tensor):
        name = path if path not in tensors else f"{path}#{len(tensors)}"
        if keep:
            tensors[name] = obj.detach()
            return {"$tensor": name}
        tensor = obj.detach().to("cpu").contiguous()
        if any(t.data_ptr() == tensor.data_ptr() for t in tensors.values() if t.numel()):
            tensor = tensor.clone()  # safetensors refuses tensors sharing memory
        tensors[name] = tensor
        return {"$tensor": name}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"$tuple": [_encode(v, tensors, f"{path}/{i}", keep) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{path}/{i}", keep) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: _encode(v, tensors, f"{path}/{k}", keep) for k, v in obj.items()}
        return {
            "$items": [
                [_encode(k, tensors, f"{path}/key", keep), _encode(v, tensors, f"{path}/{k}", keep)]
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


# ------------------------------------------------------------ model and optimizer states
def _weights_module(models: Any) -> list[tuple[str, torch.nn.Module]]:
    """(folder or file stem, module) of the weights a checkpoint stores."""
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


def _model_state(stem: str, module: torch.nn.Module, models: Any) -> dict[str, torch.Tensor]:
    """``module``'s state dict as this process holds it (its DTensor shards on several
    processes), tied duplicates left out; the tensors are the module's own, so DCP loads
    into them in place."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    owner = models.critic if stem == "critic" and models.shared_critic else module
    state = get_model_state_dict(owner)
    if owner is not module:  # a shared critic stores its head alone
        state = {k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")}
    drop = _tied(module)
    if models.lora:  # the trained parameters alone: the base weights are the spec's model's
        trained = {name for name, p in module.named_parameters() if p.requires_grad}
        return {k: v for k, v in state.items() if k in trained}
    return {k: v for k, v in state.items() if k not in drop}


def base_fingerprint(models: Any) -> list[float] | None:
    """With LoRA: the sum and the sum of squares (float64) of the actor's frozen weights over
    every process (a collective), which a checkpoint of the adapters alone records: the
    base weights it is read onto must be those it was trained on. None without LoRA."""
    if not models.lora:
        return None
    if models.actor in _BASE_SUMS:  # the frozen weights never change during a run
        return _BASE_SUMS[models.actor]
    params = list(models.actor.parameters())
    sums = torch.zeros(2, dtype=torch.float64, device=params[0].device)
    for p in params:
        if not p.requires_grad:  # a DTensor's sums are whole-tensor ones (collectives)
            t = p.detach().to(torch.float64)
            sums += torch.stack(
                [distributed.full_tensor(t.sum()), distributed.full_tensor((t * t).sum())]
            )
    _BASE_SUMS[models.actor] = [float(x) for x in sums]
    return _BASE_SUMS[models.actor]


#: :func:`base_fingerprint` of each LoRA actor, computed once.
_BASE_SUMS: weakref.WeakKeyDictionary[torch.nn.Module, list[float]] = weakref.WeakKeyDictionary()


def _set_model_state(
    stem: str, module: torch.nn.Module, models: Any, state: dict[str, torch.Tensor]
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    owner = module
    if stem == "critic" and models.shared_critic:
        owner = models.critic
        state = {f"head.{k}": v for k, v in state.items()}
    set_model_state_dict(owner, state, options=StateDictOptions(strict=False))


def _optimizer_states(learner: Any) -> dict[str, Any]:
    """Optimizer states keyed by parameter name (this process's shards on several) and the
    schedulers'. An optimizer that has not stepped gets zero states first (DCP's
    ``get_optimizer_state_dict``), the shapes a checkpoint is read into."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optim: dict[str, Any] = {}
    for name, module, opt in _optimizers(learner):
        optim[name] = get_optimizer_state_dict(module, opt)
        sched = learner.actor_sched if name == "actor" else learner.critic_sched
        optim[f"{name}_sched"] = sched.state_dict()
    return optim


def _load_optimizers(learner: Any, optim: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    for name, module, opt in _optimizers(learner):
        set_optimizer_state_dict(module, opt, optim[name])  # this process's shards
        for group in opt.param_groups:  # it gives tuples (AdamW's betas) back as lists
            for key, default in opt.defaults.items():
                if isinstance(default, tuple) and isinstance(group.get(key), list):
                    group[key] = tuple(group[key])
        sched = learner.actor_sched if name == "actor" else learner.critic_sched
        sched.load_state_dict(optim[f"{name}_sched"])


# ------------------------------------------------------------------- DCP storage
def _cause(exc: BaseException) -> BaseException:
    """The error behind DCP's ``CheckpointException`` (the first failing process's)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) else first
    return exc


@contextlib.contextmanager
def _dcp() -> Iterator[None]:
    """DCP without its one-process notice and its log lines (it logs a failed read with a
    traceback on the root logger); its errors as their cause, on one line."""
    disabled = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*assuming the intent is to (save|load) in a single")
            yield
    except BaseException as exc:
        cause = _cause(exc)
        _, found, why = str(cause).partition("metadata read failed: ")
        if found:  # DCP read no shard file's header
            raise ValueError(f"unreadable shard files ({why})") from None
        if cause is exc:
            raise
        raise cause from None
    finally:
        logging.disable(disabled)


def _dcp_save(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Every process writes its shards of ``tensors`` to ``folder`` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    with _dcp():
        dcp.save(
            tensors, storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True)
        )


def _dcp_load(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Fill ``tensors`` (this process's shards) in place from ``folder`` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    with _dcp():
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(folder)))


def load_weights(path: Path, stem: str, module: torch.nn.Module, models: Any) -> None:
    """Read the weights ``stem`` (``actor``, ``critic``) of the verified checkpoint folder
    ``path`` into ``module`` (the actor, the critic or a shared critic's head), whatever
    the number of processes that wrote it.

    Every load (resume, export, eval) goes through here: a file that does not match the
    spec's model is a one-line ``UserError``, and so is a weight that is not finite (it
    names the tensor)."""
    saved = _state_of(path)
    try:
        if models.lora and stem == "actor":
            _check_base(path, saved.get("lora_base"), base_fingerprint(models))
        state = _model_state(stem, module, models)
        _dcp_load(state, path / stem)
        _set_model_state(stem, module, models, state)
    except UserError:
        raise
    except Exception as exc:
        raise _fail(path, _one_line(exc)) from None
    problem = distributed.first_text(_first_nonfinite((f"{stem} {k}", v) for k, v in state.items()))
    if problem is not None:
        raise _fail(path, problem)


def _first_nonfinite(tensors: Iterator[tuple[str, torch.Tensor]]) -> str | None:
    """``'NAME holds NaN or inf'`` for the first of ``tensors`` (this process's shards)
    that does, else None (one host read per device when all are finite)."""
    named = [
        (name, distributed.local_tensor(t).detach())
        for name, t in tensors
        if t.is_floating_point() or t.is_complex()
    ]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, t in named:
        by_device.setdefault(t.device, []).append(torch.isfinite(t).all())
    if all(bool(torch.stack(flags).all()) for flags in by_device.values()):
        return None
    for name, t in named:
        if not bool(torch.isfinite(t).all()):
            return f"{name} holds NaN or inf"
    return "a tensor holds NaN or inf"  # pragma: no cover


def _check_base(path: Path, saved: Any, current: list[float] | None) -> None:
    """A checkpoint of LoRA adapters is read onto the base weights it was trained on."""
    if current is None:
        return
    numbers = isinstance(saved, list) and len(saved) == 2
    if not numbers or not all(
        isinstance(x, float | int) and not isinstance(x, bool) for x in saved
    ):
        raise _fail(path, "it does not record the base weights its LoRA adapters were trained on")
    if not all(
        math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9) for a, b in zip(current, saved, strict=True)
    ):
        raise _fail(
            path,
            "its LoRA adapters were trained on other base weights than those of the spec's "
            "model.actor (a checkpoint stores the adapters, not the base model)",
        )


# -------------------------------------------------------------------------- write
class NonFiniteCheckpointError(UserError):
    """A model or optimizer tensor holds NaN or inf: such a state is never saved."""


def _named_tensors(learner: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a checkpoint stores of the models and optimizers, with a readable name
    (this process's shards on several processes)."""
    models = learner.models
    names: dict[int, str] = {}
    for label, module in _weights_module(models):
        for name, tensor in module.state_dict(keep_vars=True).items():
            names.setdefault(id(tensor), f"{label} {name}")
            yield f"{label} {name}", distributed.local_tensor(tensor)
    for label, opt in (("actor", learner.actor_opt), ("critic", learner.critic_opt)):
        if opt is None:
            continue
        for param, state in opt.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    owner = names.get(id(param), f"{label} parameter")
                    yield f"the optimizer's {key} of {owner}", distributed.local_tensor(value)


def nonfinite(learner: Any) -> str | None:
    """``'NAME holds NaN or inf'`` for the first model or optimizer tensor (of this
    process's) that does, else None (one host read per device when all are finite)."""
    return _first_nonfinite(_named_tensors(learner))


def check_finite(learner: Any) -> None:
    """Raise :class:`NonFiniteCheckpointError` naming the first model or optimizer tensor
    that holds a NaN or an inf."""
    problem = nonfinite(learner)
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
            if _state_problem(state) is None:
                return int(state["round"])
        except (OSError, ValueError):
            pass
        if name == CHECKPOINT and folder.exists():
            return None
    return None


def save_checkpoint(out: Path, learner: Any, source: Any, round_done: int, spec_yaml: str) -> Path:
    """Write ``out/checkpoint`` atomically; returns its path. On several processes every
    process calls it: each writes its own shards and RNG states, the first one the rest.

    Refused (:class:`NonFiniteCheckpointError`) when a model or optimizer tensor is not
    finite on any process. On any error the partly written temporary folder is removed and
    the previous checkpoint is kept; an OS error (disk full, read-only folder, permission
    denied, also as safetensors reports it) on any process is one ``UserError`` line, on
    every process, naming the path and the cause.
    """
    world = distributed.world()
    final, tmp = out / CHECKPOINT, out / TMP
    previous = checkpoint_round(out)
    kept = (
        f"the last good checkpoint (round {previous}) is kept in {final}"
        if previous is not None
        else "no checkpoint was written"
    )
    problem = distributed.first_text(nonfinite(learner))
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
        except OSError as exc:
            error = str(io_error(tmp, exc, doing))
    error = distributed.first_text(error)
    if error is None:
        try:
            _write_tmp(tmp, learner, source, round_done, spec_yaml)
        except BaseException as exc:
            if not is_os_error(exc):
                if world.main:
                    _discard(tmp)
                raise  # not an OS error: a bug, a user error or an interrupt
            error = str(io_error(tmp, exc, doing))
        error = distributed.first_text(error)  # every process's files are written
        if error is not None and world.main:
            _discard(tmp)
    if error is None:
        error = distributed.first_text(_seal_and_swap(out, doing) if world.main else None)
    if error is not None:
        raise UserError(f"{error}; {kept}")
    return final


def _write_tmp(tmp: Path, learner: Any, source: Any, round_done: int, spec_yaml: str) -> None:
    """This process's part of a checkpoint in ``tmp`` (made by the first process): its
    shards of the weights and optimizer states (collectives), its RNG states; the first
    process also writes the JSON files. Everything is synced."""
    world = distributed.world()
    models = learner.models
    base = base_fingerprint(models)  # a collective: before the first process's own writes
    for stem, module in _weights_module(models):
        _dcp_save(_model_state(stem, module, models), tmp / stem)
    tensors: dict[str, torch.Tensor] = {}
    optim = _encode(_optimizer_states(learner), tensors, "optim", keep=True)
    _dcp_save(tensors, tmp / "optim")
    rng_data, rng_tensors = _rng_files(capture_rng(), source.state_dict())
    stem = tmp / _rng_stem(world.rank)
    save_file(rng_tensors, f"{stem}.safetensors")
    Path(f"{stem}.json").write_text(json.dumps(rng_data) + "\n")
    mine = [Path(f"{stem}.safetensors"), Path(f"{stem}.json")]
    if world.main:
        state = {
            "format": FORMAT,
            "round": round_done,
            "kl_coef": float(learner.kl_coef),
            "critic": models.critic_kind,
            "processes": world.size,
            "lora_base": base,
        }
        (tmp / "optim.json").write_text(json.dumps(optim) + "\n")
        (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
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
            files[f.relative_to(tmp).as_posix()] = {"sha256": _sha256(f), "bytes": f.stat().st_size}
        manifest = {"format": FORMAT, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _fsync(tmp / MANIFEST)
        for folder in (tmp, *(p for p in tmp.iterdir() if p.is_dir())):
            _fsync_dir(folder)
    except OSError as exc:
        _discard(tmp)
        return str(io_error(tmp, exc, doing))
    try:
        remove(old)
        if os.path.lexists(final):
            final.rename(old)
        tmp.rename(final)
        _fsync_dir(out)
    except OSError as exc:
        if not final.exists() and old.is_dir():
            with contextlib.suppress(OSError):
                old.rename(final)  # put the previous checkpoint back
        if final.is_dir():
            _discard(tmp)
        return str(io_error(final, exc, doing))
    _discard(old)
    return None


def _discard(path: Path) -> None:
    """:func:`remove`, its errors ignored (a leftover is removed by the next save)."""
    with contextlib.suppress(OSError):
        remove(path)


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(file: Path) -> None:
    with open(file, "rb") as fh:
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


def _regular_files_only(path: Path) -> None:
    """A checkpoint holds folders and regular files: a link (which could lead a read
    anywhere, or a save's rename outside the run) or a device or pipe is refused."""
    for root, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            entry = Path(root) / name
            mode = os.lstat(entry).st_mode
            if stat.S_ISLNK(mode):
                raise _fail(path, f"{entry} is a symbolic link (a checkpoint holds files only)")
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise _fail(path, f"{entry} is not a regular file")


def _verify(path: Path) -> None:
    """Check ``path``'s manifest and every checksum in it, then that its shards are what
    its state says they are; ``UserError`` naming the file."""
    if os.path.islink(path):
        raise _fail(path, "it is a symbolic link (a checkpoint holds files only)")
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
            raise _fail(
                path,
                "it was written by an older ppokit (format 1, which stored Python pickles) and "
                "is not read, as it could run code; start a new run",
            )
        problem = None if old_format is None else _format_problem(old_format)
        if problem is not None:
            raise _fail(path, problem)
        raise UserError(f"{manifest_file}: missing (an incomplete checkpoint?)")
    try:
        manifest = read_json(manifest_file)
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        files = manifest["files"]
        if not isinstance(files, dict):
            raise ValueError("'files' is not an object")
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{manifest_file}: unreadable ({_one_line(exc)})") from None
    problem = _format_problem(manifest.get("format"))
    if problem is not None:
        raise _fail(path, problem)
    _check_names(path, manifest_file, files)
    for name, entry in files.items():
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
    _check_shards(path, _state_of(path))


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
            raise _fail(
                path,
                f"{folder}/ holds {len(names)} shard file(s) of {len(sets)} process(es) but "
                f"state.json records {processes} process(es) (a shard deleted or added?)",
            )
        _check_cover(path, folder)
    for rank in range(processes):
        for suffix in (".json", ".safetensors"):
            if not (path / f"{_rng_stem(rank)}{suffix}").is_file():
                raise _fail(
                    path,
                    f"{_rng_stem(rank)}{suffix} is missing but state.json records "
                    f"{processes} process(es)",
                )


def _check_cover(path: Path, folder: str) -> None:
    """Every tensor of ``path/folder`` is covered exactly once by its shards' chunks."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    try:
        with _dcp():
            metadata = HuggingFaceStorageReader(str(path / folder)).read_metadata()
    except Exception as exc:  # a header that is not JSON, or contradicts its file
        raise _fail(path, f"unreadable shard files in {folder}/ ({_one_line(exc)})") from None
    for name, entry in metadata.state_dict_metadata.items():
        chunks = getattr(entry, "chunks", None)
        if chunks is None:
            continue  # not a tensor
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
                raise _fail(path, f"{folder}/ {name}: a shard lies outside the tensor {size}")
            boxes.append((offsets, sizes))
        covered = sum(math.prod(sizes) for _, sizes in boxes)
        for i, (a_off, a_size) in enumerate(boxes):
            for b_off, b_size in boxes[i + 1 :]:
                if all(
                    ao < bo + bn and bo < ao + an and an and bn
                    for ao, an, bo, bn in zip(a_off, a_size, b_off, b_size, strict=True)
                ):
                    raise _fail(path, f"{folder}/ {name}: two shards overlap")
        if covered != math.prod(size):
            raise _fail(
                path,
                f"{folder}/ {name}: its shards cover {covered} of its {math.prod(size)} "
                "elements (a shard deleted or a header rewritten?)",
            )


def _format_problem(form: Any) -> str | None:
    """Why a checkpoint of format ``form`` is not read (None: it is :data:`FORMAT`)."""
    if form == FORMAT and not isinstance(form, bool):
        return None
    if isinstance(form, int) and not isinstance(form, bool) and 1 < form < FORMAT:
        return (
            f"it was written by an older ppokit (format {form}), which is not read; start a new run"
        )
    return f"unknown checkpoint format {json.dumps(form)[:20]}"


def _check_names(path: Path, manifest_file: Path, files: dict[str, Any]) -> None:
    """The manifest lists the files a checkpoint has, and nothing else; no file in the
    checkpoint's folders is left unlisted (DCP reads every file of its folder)."""
    for name in REQUIRED:
        if name not in files:
            raise UserError(f"{manifest_file}: {name} is not listed (malformed manifest)")
    for name in files:
        if not _NAME.fullmatch(name):
            raise UserError(f"{manifest_file}: unknown file {name!r} (malformed manifest)")
    for folder in ("actor", "optim"):
        if not any(name.startswith(f"{folder}/") for name in files):
            raise UserError(f"{manifest_file}: no {folder}/ file is listed (malformed manifest)")
    for folder in (*DCP_FOLDERS, RNG):
        if not (path / folder).is_dir():
            continue
        for file in (path / folder).iterdir():
            if f"{folder}/{file.name}" not in files:
                raise _fail(path, f"{file} is not in its manifest (a file added after saving)")


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


#: The most rounds a checkpoint may record (train.rounds' bound) and processes.
MAX_ROUND = 1 << 30
MAX_PROCESSES = 1 << 16


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _state_problem(state: Any) -> str | None:
    """What is wrong with a ``state.json`` object (explicit types and ranges), or None."""
    if not isinstance(state, dict):
        return "not a JSON object"
    problem = _format_problem(state.get("format"))
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


def _state_of(path: Path) -> dict[str, Any]:
    """The checkpoint's ``state.json``, every field checked (a one-line error naming it)."""
    try:
        state = read_json(path / "state.json")
    except (OSError, ValueError) as exc:
        raise _fail(path, f"state.json is unreadable ({_one_line(exc)})") from None
    problem = _state_problem(state)
    if problem is not None:
        raise _fail(path, f"state.json: {problem}")
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
    path = _locate_once(out)
    state = _state_of(path)
    models = learner.models
    check_critic(path, state, models)
    try:
        for stem, module in _weights_module(models):
            load_weights(path, stem, module, models)
        optim = _read_sharded_optimizers(learner, path)
        rng_stem = path / _rng_stem(distributed.world().rank)
        if not Path(f"{rng_stem}.json").is_file():  # more processes than saved it
            rng_stem = path / _rng_stem(0)
        _load_optimizers(learner, optim)
        rng, source_state = _rng_from_files(
            read_json(Path(f"{rng_stem}.json")), load_file(f"{rng_stem}.safetensors")
        )
        source.load_state_dict(source_state)
        kl_coef = float(state["kl_coef"])
        restore_rng(rng)
    except UserError:
        raise
    except Exception as exc:
        raise _fail(path, _one_line(exc)) from None
    problem = distributed.first_text(nonfinite(learner))  # the optimizer states too
    if problem is not None:
        raise _fail(path, problem)
    learner.kl_coef = torch.tensor(kl_coef, dtype=torch.float32, device=learner.device)
    distributed.barrier()  # every process has read it before it moves
    if path.name != CHECKPOINT and distributed.world().main:
        _promote(out, path)
    return int(state["round"])


def check_critic(path: Path, state: dict[str, Any], models: Any) -> None:
    """The checkpoint at ``path`` (its ``state.json``) has the models' kind of critic."""
    if state.get("critic") != models.critic_kind:
        raise _fail(
            path, f"it has critic {state.get('critic')!r} but the spec has {models.critic_kind!r}"
        )


def _read_sharded_optimizers(learner: Any, path: Path) -> dict[str, Any]:
    """The optimizer and scheduler states of a checkpoint, this process's shards
    read by DCP into the shapes of the learner's own (zero-initialised) states."""
    template: dict[str, torch.Tensor] = {}
    _encode(_optimizer_states(learner), template, "optim", keep=True)
    stored = read_json(path / "optim.json")
    named = set(_tensor_names(stored))
    if named != set(template):
        differ = sorted(named ^ set(template))
        raise _fail(path, f"optim.json does not match the spec's optimizers ({differ[0]} ...)")
    _dcp_load(template, path / "optim")
    return _decode(stored, template)


def _tensor_names(obj: Any) -> Iterator[str]:
    """The ``{"$tensor": name}`` names in a JSON tree of :func:`_encode`."""
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
    """:func:`_locate` by the first process (which verifies every checksum once), its
    answer (or error) given to every process."""
    if not distributed.world().distributed:
        return _locate(out)
    answer = None
    if distributed.world().main:
        try:
            answer = f"ok {_locate(out)}"
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
    _fsync_dir(out)
    for name in (TMP, OLD):
        _discard(out / name)
