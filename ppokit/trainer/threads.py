"""The CPU threads a run gives torch: ``model.threads``, else one thread for a small model on
the CPU (more only contend), else the cores shared between the sides of an asynchronous run
(:func:`choose_threads`); :func:`set_threads` applies it."""

from __future__ import annotations

import os

import torch

from ppokit.spec import Spec
from ppokit.trainer.models import Models

__all__ = ["SMALL_MODEL", "choose_threads", "cpu_cores", "engine_threads", "set_threads"]

#: Below this many actor parameters a CPU run uses one thread (more only contend).
SMALL_MODEL = 10_000_000


def cpu_cores() -> int:
    """The CPU cores this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def choose_threads(
    setting: int | None,
    device: str,
    parameters: int,
    sides: int = 1,
    setting_name: str = "model.threads",
) -> tuple[int | None, str]:
    """(threads for torch's intra-op pool, why): the ``setting`` when set; one thread for a
    model under SMALL_MODEL parameters on the CPU, where more threads only contend; on the
    CPU with ``sides`` > 1 (generation beside the update) the cores divided between the
    sides; else None (torch's default)."""
    if setting is not None:
        return setting, setting_name
    if device == "cpu" and parameters < SMALL_MODEL:
        return 1, f"automatic: a {parameters / 1e6:.2g}M-parameter model on the CPU"
    if device == "cpu" and sides > 1:
        cores = cpu_cores()
        return max(1, cores // sides), f"automatic: {cores} cores shared by {sides} sides"
    return None, "torch's default"


def threads_text(n: int, why: str) -> str:
    """``1 CPU thread (why)``."""
    return f"{n} CPU thread{'s' if n != 1 else ''} ({why})"


def set_threads(spec: Spec, models: Models) -> str:
    """Apply ``ppokit train``'s thread rule (:func:`choose_threads`) to torch's intra-op pool
    for a run of ``spec`` on ``models`` (what ``build_models`` returned; the pool is left so
    for the rest of the process); returns what it chose, e.g. ``1 CPU thread (automatic: a
    0.095M-parameter model on the CPU)``. With asynchronous rollouts these are the trainer's
    threads (:func:`engine_threads` the generation's)."""
    parameters = sum(p.numel() for p in models.actor.parameters())
    sides = 2 if spec.rollout.max_staleness else 1
    threads, why = choose_threads(spec.model.threads, models.runtime.device.type, parameters, sides)
    if threads is not None:
        torch.set_num_threads(threads)
    return threads_text(torch.get_num_threads(), why)


def engine_threads(spec: Spec, models: Models) -> tuple[int | None, str]:
    """(the generation thread's torch threads, what the display says) of an asynchronous
    run: ``rollout.engine_threads``, or :func:`choose_threads`' share of the cores."""
    parameters = sum(p.numel() for p in models.actor.parameters())
    threads, why = choose_threads(
        spec.rollout.engine_threads,
        models.runtime.device.type,
        parameters,
        2,
        "rollout.engine_threads",
    )
    return threads, threads_text(threads or torch.get_num_threads(), why)
