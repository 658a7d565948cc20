"""Checkpoints: ``OUT/checkpoint/`` with the actor and critic weights (safetensors), optimizer
and scheduler states, RNG states (python, numpy, torch, the prompt source), the round
counter, the adaptive KL state and the resolved spec. Written atomically: a temporary
directory is filled, then renamed over the previous checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from ppokit.errors import UserError

__all__ = [
    "CHECKPOINT",
    "capture_rng",
    "load_checkpoint",
    "restore_rng",
    "save_checkpoint",
    "truncate_jsonl",
]

CHECKPOINT = "checkpoint"
FORMAT = 1


def capture_rng() -> dict[str, Any]:
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
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out: Path, learner: Any, source: Any, round_done: int, spec_yaml: str) -> Path:
    """Write ``out/checkpoint`` atomically; returns its path."""
    final = out / CHECKPOINT
    tmp = out / f".{CHECKPOINT}.tmp"
    old = out / f".{CHECKPOINT}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    models = learner.models
    save_model(models.actor, str(tmp / "actor.safetensors"))
    if models.critic is not None:
        if models.shared_critic:
            save_model(models.critic.head, str(tmp / "critic.safetensors"))
        else:
            save_model(models.critic, str(tmp / "critic.safetensors"))
    optim = {
        "actor": learner.actor_opt.state_dict(),
        "actor_sched": learner.actor_sched.state_dict(),
    }
    if learner.critic_opt is not None:
        optim["critic"] = learner.critic_opt.state_dict()
        optim["critic_sched"] = learner.critic_sched.state_dict()
    torch.save(optim, tmp / "optim.pt")
    torch.save({"rng": pickle.dumps(capture_rng()), "source": source.state_dict()}, tmp / "rng.pt")
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
    _fsync_dir(tmp)
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def _fail(path: Path, why: str) -> UserError:
    return UserError(f"checkpoint {path} cannot be used: {why}")


def read_state(out: Path) -> dict[str, Any]:
    """The checkpoint's ``state.json`` (round, KL coefficient, critic kind)."""
    path = out / CHECKPOINT
    if not (path / "state.json").is_file():
        raise UserError(f"nothing to resume: {path} does not exist (run without --resume)")
    try:
        state = json.loads((path / "state.json").read_text())
        int(state["round"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _fail(path, f"state.json is unreadable ({exc})") from None
    if state.get("format") != FORMAT:
        raise _fail(path, f"unknown checkpoint format {state.get('format')!r}")
    return state


def load_checkpoint(out: Path, learner: Any, source: Any) -> int:
    """Restore everything from ``out/checkpoint``; returns the number of rounds done.

    Raises :class:`UserError` for a missing, corrupt or incompatible checkpoint (before any
    file is changed).
    """
    path = out / CHECKPOINT
    state = read_state(out)
    models = learner.models
    critic_kind = (
        None if models.critic is None else ("shared" if models.shared_critic else "separate")
    )
    if state.get("critic") != critic_kind:
        raise _fail(path, f"it has critic {state.get('critic')!r} but the spec has {critic_kind!r}")
    try:
        _load_weights(models.actor, path / "actor.safetensors")
        if models.critic is not None:
            target = models.critic.head if models.shared_critic else models.critic
            _load_weights(target, path / "critic.safetensors")
        optim = torch.load(path / "optim.pt", map_location=learner.device, weights_only=True)
        learner.actor_opt.load_state_dict(optim["actor"])
        learner.actor_sched.load_state_dict(optim["actor_sched"])
        if learner.critic_opt is not None:
            learner.critic_opt.load_state_dict(optim["critic"])
            learner.critic_sched.load_state_dict(optim["critic_sched"])
        extra = torch.load(path / "rng.pt", weights_only=False)
        rng = pickle.loads(extra["rng"])
        source.load_state_dict(extra["source"])
    except UserError:
        raise
    except Exception as exc:
        raise _fail(path, f"{type(exc).__name__}: {exc}".splitlines()[0]) from None
    learner.kl_coef = torch.tensor(
        float(state["kl_coef"]), dtype=torch.float32, device=learner.device
    )
    restore_rng(rng)
    return int(state["round"])


def _load_weights(module: torch.nn.Module, file: Path) -> None:
    missing, unexpected = load_model(
        module, str(file), strict=False, device=str(next(module.parameters()).device)
    )
    if missing or unexpected:
        names = ", ".join([*missing, *unexpected][:3])
        raise UserError(f"{file.name} does not match the spec's model ({names} ...)")


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
