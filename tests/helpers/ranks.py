"""Processes forked from multiprocessing's forkserver, with torch, transformers and the
trainer imported there once: two joined by gloo, as ``torchrun --nproc-per-node 2`` makes
them, for the tests of the distributed trainer; one ``ppokit`` command of its own."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from ppokit import workers
from ppokit.cli import app
from tests.helpers import built_once, free_port

#: What the forkserver imports once, so that a process forked from it starts with them
#: (``mp.spawn``'s fresh interpreters import them again, about 5 s of CPU a process): the
#: workers' own preload, and the trainer.
PRELOAD = (*workers.PRELOAD, "transformers", "ppokit.trainer.loop")


def as_process(rank: int, port: int) -> None:
    """Make this process process ``rank`` of 2, as torchrun would (one thread)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)


def _ppokit(rank: int | None, port: int, argv: list[str], environ: dict[str, str]) -> None:
    """``ppokit ARGV`` in this forked process, under the caller's ``environ`` (not the
    forkserver's from when it started), as process ``rank`` of 2 unless None."""
    os.environ.clear()
    os.environ.update(environ)
    if rank is not None:
        as_process(rank, port)
    app(args=argv, prog_name="ppokit")  # its exit status is the process's


def start_ppokit(*argv: str) -> multiprocessing.process.BaseProcess:
    """``ppokit ARGV`` in a process of its own (its pid, signals and exit status) forked from
    the forkserver, started: a fresh interpreter's start-up (about 8 s of CPU) saved where
    the start-up is not what a test is about."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    context = multiprocessing.get_context("forkserver")
    proc = context.Process(target=_ppokit, args=(None, 0, list(argv), dict(os.environ)))
    proc.start()
    return proc


def killed_mid_run(argv: list[str], out: Path, rounds: int, within: float = 300) -> int:
    """``ppokit ARGV``, a run into ``out``, in a process of its own (:func:`start_ppokit`),
    killed with SIGKILL once its metrics.jsonl holds ``rounds`` rounds: the rounds it holds
    then (the test is skipped when the run finished first)."""
    import signal
    import time

    from ppokit.trainer.metrics import read_metrics

    proc = start_ppokit(*argv)
    deadline = time.monotonic() + within
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline and proc.is_alive():
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rounds:
            break
        time.sleep(0.05)
    if not proc.is_alive():
        pytest.skip("the run finished before it could be killed")
    proc.kill()
    proc.join(timeout=60)
    assert proc.exitcode == -signal.SIGKILL
    return len(read_metrics(out))


def train_on_two(*argv: str) -> None:
    """``ppokit ARGV`` (a ``train`` command) on 2 processes forked from the forkserver: the
    run ``--nproc 2`` makes, without the launcher and the interpreters it starts (about 25 s
    of CPU), one OpenMP thread each as the launcher sets it. For a reference run; the
    launcher's own runs are the subject of other tests."""
    environ = {"OMP_NUM_THREADS": "1", **os.environ}
    run_two(_ppokit, free_port(), list(argv), environ)


def written_by_two(
    factory: pytest.TempPathFactory, name: str, fn: Callable[[int, int, str], None]
) -> Path:
    """The folder ``name`` that ``fn(rank, port, folder)`` fills on 2 processes
    (:func:`run_two`), once in a test run (:func:`tests.helpers.built_once`)."""
    return built_once(factory, name, lambda folder: run_two(fn, free_port(), str(folder)))


def run_two(fn: Callable[..., None], *args: Any) -> None:
    """``fn(rank, *args)`` on 2 processes forked from multiprocessing's forkserver (the one
    :mod:`ppokit.workers` shares; its preload is set by whoever starts it first), joined;
    a process's exception is raised here. ``fn`` must be importable by reference."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    mp.start_processes(fn, args=args, nprocs=2, join=True, start_method="forkserver")
