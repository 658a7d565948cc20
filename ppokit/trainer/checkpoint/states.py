"""What a checkpoint holds, as tensors and JSON: every process's RNG states, state trees
(optimizer and scheduler states) with their tensors named, the models' weights and the
optimizer states through torch.distributed.checkpoint's Hugging Face storage, and the
LoRA base weights' fingerprint."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ppokit import distributed
from ppokit.errors import UserError, one_line
from ppokit.trainer.checkpoint.layout import (
    fail,
    state_of,
)

if TYPE_CHECKING:
    from ppokit.trainer.models import Models
    from ppokit.trainer.optim import Optimizers


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


def rng_files(
    rng: dict[str, Any], source_state: Any, environment_state: Any = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(rng.json object, rng.safetensors tensors) of an RNG capture, a source state and the
    environment's state (what it keeps across episodes; None: nothing)."""
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
        "source": encode(source_state, tensors, "source"),
    }
    if environment_state is not None:
        data["environment"] = encode(environment_state, tensors, "environment")
    return data, tensors


def _ints(values: Any, what: str) -> list[int]:
    if not isinstance(values, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    ):
        raise ValueError(f"{what} is not a list of integers")
    return values


def rng_from_files(data: Any, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any], Any, Any]:
    """(RNG state for :func:`restore_rng`, prompt source state, environment state or None)
    from rng.json/.safetensors."""
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
    environment = data.get("environment")
    env_state = None if environment is None else decode(environment, tensors)
    return state, decode(data["source"], tensors), env_state


# ------------------------------------------------------------ state trees as JSON
def encode(obj: Any, tensors: dict[str, torch.Tensor], path: str, keep: bool = False) -> Any:
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
        return {"$tuple": [encode(v, tensors, f"{path}/{i}", keep) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, tensors, f"{path}/{i}", keep) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: encode(v, tensors, f"{path}/{k}", keep) for k, v in obj.items()}
        return {
            "$items": [
                [encode(k, tensors, f"{path}/key", keep), encode(v, tensors, f"{path}/{k}", keep)]
                for k, v in obj.items()
            ]
        }
    raise TypeError(f"cannot store a {type(obj).__name__} in a checkpoint ({path})")


def decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode`; ``ValueError``/``KeyError`` on anything malformed."""
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        tags = [k for k in obj if k.startswith("$")]
        if not tags:
            return {k: decode(v, tensors) for k, v in obj.items()}
        if len(obj) != 1:
            raise ValueError(f"malformed tagged value {sorted(obj)[:3]}")
        tag, value = next(iter(obj.items()))
        if tag == "$tensor" and isinstance(value, str):
            if value not in tensors:
                raise ValueError(f"tensor {value!r} is missing")
            return tensors[value]
        if tag == "$tuple" and isinstance(value, list):
            return tuple(decode(v, tensors) for v in value)
        if tag == "$items" and isinstance(value, list):
            items = {}
            for item in value:
                if not isinstance(item, list) or len(item) != 2:
                    raise ValueError("malformed $items entry")
                items[decode(item[0], tensors)] = decode(item[1], tensors)
            return items
        raise ValueError(f"unknown tag {tag!r}")
    return obj


# ------------------------------------------------------------ model and optimizer states
def weights_module(models: Models) -> list[tuple[str, torch.nn.Module]]:
    """(folder or file stem, module) of the weights a checkpoint stores."""
    out = [("actor", models.actor)]
    if models.critic is not None:
        out.append(("critic", models.critic.head if models.shared_critic else models.critic))
    return out


def _optimizers(models: Models, optimizers: Optimizers) -> list[tuple[str, Any, Any, Any]]:
    """(name, module holding its parameters, optimizer, schedule) of each optimizer."""
    modules = {"actor": models.actor, "critic": models.critic}
    return [(name, modules[name], opt, sched) for name, opt, sched in optimizers.named()]


def _tied(module: torch.nn.Module) -> set[str]:
    """Names of parameters that are another name's parameter (tied weights): stored once."""
    seen: set[int] = set()
    drop = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            drop.add(name)
        seen.add(id(p))
    return drop


def model_state(stem: str, module: torch.nn.Module, models: Models) -> dict[str, torch.Tensor]:
    """``module``'s state dict as this process holds it (its DTensor shards on several
    processes), tied duplicates left out; the tensors are the module's own, so DCP loads
    into them in place."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    shared = models.critic if stem == "critic" and models.shared_critic else None
    owner = module if shared is None else shared  # a shared critic: the module is its head
    state: dict[str, Any] = get_model_state_dict(owner)  # a model's: tensors only
    if owner is not module:  # a shared critic stores its head alone
        state = {k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")}
    drop = _tied(module)
    if models.lora:  # the trained parameters alone: the base weights are the spec's model's
        trained = {name for name, p in module.named_parameters() if p.requires_grad}
        return {k: v for k, v in state.items() if k in trained}
    return {k: v for k, v in state.items() if k not in drop}


def base_fingerprint(models: Models) -> list[float] | None:
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
    stem: str, module: torch.nn.Module, models: Models, state: dict[str, torch.Tensor]
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    owner = module
    if stem == "critic" and models.shared_critic and models.critic is not None:
        owner = models.critic
        state = {f"head.{k}": v for k, v in state.items()}
    values: dict[str, Any] = dict(state)  # DCP's type of a state dict: any value
    set_model_state_dict(owner, values, options=StateDictOptions(strict=False))


def optimizer_states(models: Models, optimizers: Optimizers) -> dict[str, Any]:
    """Optimizer states keyed by parameter name (this process's shards on several) and the
    schedulers'. An optimizer that has not stepped gets zero states first (DCP's
    ``get_optimizer_state_dict``), the shapes a checkpoint is read into."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optim: dict[str, Any] = {}
    for name, module, opt, sched in _optimizers(models, optimizers):
        optim[name] = get_optimizer_state_dict(module, opt)
        optim[f"{name}_sched"] = sched.state_dict()
    return optim


def load_optimizers(models: Models, optimizers: Optimizers, optim: dict[str, Any]) -> None:
    """Put the checkpoint's optimizer and scheduler states ``optim`` (this process's
    shards) into the run's ``optimizers``."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    for name, module, opt, sched in _optimizers(models, optimizers):
        set_optimizer_state_dict(module, opt, optim[name])  # this process's shards
        for group in opt.param_groups:  # it gives tuples (AdamW's betas) back as lists
            for key, default in opt.defaults.items():
                if isinstance(default, tuple) and isinstance(group.get(key), list):
                    group[key] = tuple(group[key])
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
def quiet_dcp() -> Iterator[None]:
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


def dcp_save(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Every process writes its shards of ``tensors`` to ``folder`` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    with quiet_dcp():
        dcp.save(
            tensors, storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True)
        )


def dcp_load(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Fill ``tensors`` (this process's shards) in place from ``folder`` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    with quiet_dcp():
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(folder)))


def load_weights(path: Path, stem: str, module: torch.nn.Module, models: Models) -> None:
    """Read the weights ``stem`` (``actor``, ``critic``) of the verified checkpoint folder
    ``path`` into ``module`` (the actor, the critic or a shared critic's head), whatever
    the number of processes that wrote it.

    Every load (resume, export, eval) goes through here: a file that does not match the
    spec's model is a one-line ``UserError``, and so is a weight that is not finite (it
    names the tensor)."""
    saved = state_of(path)
    try:
        if models.lora and stem == "actor":
            _check_base(path, saved.get("lora_base"), base_fingerprint(models))
        state = model_state(stem, module, models)
        dcp_load(state, path / stem)
        _set_model_state(stem, module, models, state)
    except UserError:
        raise
    except Exception as exc:
        raise fail(path, one_line(exc)) from None
    problem = distributed.first_text(first_nonfinite((f"{stem} {k}", v) for k, v in state.items()))
    if problem is not None:
        raise fail(path, problem)


def first_nonfinite(tensors: Iterator[tuple[str, torch.Tensor]]) -> str | None:
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
        raise fail(path, "it does not record the base weights its LoRA adapters were trained on")
    if not all(
        math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9) for a, b in zip(current, saved, strict=True)
    ):
        raise fail(
            path,
            "its LoRA adapters were trained on other base weights than those of the spec's "
            "model.actor (a checkpoint stores the adapters, not the base model)",
        )
