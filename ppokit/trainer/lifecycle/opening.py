"""Where a run runs, opened before its first round and closed after its last:
:func:`opened` (the processes, the output folder and its lock, the display) and
:func:`running` (the built run, closed at the end)."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ppokit import distributed
from ppokit.bounded import counting_interrupts
from ppokit.errors import UserError
from ppokit.runfolder import LIBRARY_LOG, RunFolder
from ppokit.spec import Spec
from ppokit.spec_changes import resume_spec_changes
from ppokit.trainer.display import Display, folded_logs
from ppokit.trainer.lifecycle.smoke import SMOKE_NOTE, smoke_folder, smoke_spec
from ppokit.trainer.models import resolve_device
from ppokit.trainer.report import Reporter, Silent
from ppokit.trainer.run import Run, build

__all__ = ["Place", "opened", "running"]


@dataclass
class Place:
    """A run's spec (a smoke run's: :func:`~.smoke.smoke_spec`), its output folder ``out``,
    how it was started (``resume``, ``smoke``; ``temporary``: the folder is removed when the
    run ends, so no line names it), the spec's ``changes`` on a resume (path, old, new),
    its display (a silent one on every process but the first) and its start (``wall``:
    ``time.perf_counter()``)."""

    spec: Spec
    out: Path
    resume: bool
    smoke: bool
    temporary: bool
    changes: list[tuple[str, Any, Any]]
    display: Reporter
    wall: float


@contextlib.contextmanager
def opened(
    spec: Spec,
    *,
    resume: bool,
    smoke: bool,
    overwrite: bool,
    smoke_out: str | None,
    allow_spec_change: bool,
) -> Iterator[Place]:
    """The run's place (:func:`~ppokit.trainer.loop.train`'s options): the process group,
    the output folder, locked by the first process (a smoke run's temporary one removed at
    the end, errors and Ctrl-C included), torch's threads put back at the end, the display
    and the library's log lines folded into it."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    resume = resume and not smoke
    model = spec.model
    device, dtype = ("auto", "auto") if smoke else (model.device, model.dtype)  # smoke_spec's
    device_type = resolve_device(device, dtype).device.type
    with (
        counting_interrupts(),
        distributed.process_group(device_type, spec.parallel.timeout_s) as world,
    ):
        temporary = smoke and smoke_out is None  # removed when the run ends
        if smoke:
            spec = smoke_spec(spec, smoke_folder(world.main) if temporary else smoke_out)
        out = Path(spec.output.dir).expanduser()
        ended = False
        try:
            folder: Any = contextlib.nullcontext()
            if world.main:  # one process owns the folder: the lock, the overwrite, the files
                overwrite = overwrite or spec.output.overwrite
                folder = RunFolder(out, resume=resume, overwrite=overwrite)
            with folder:
                distributed.barrier()
                changes = (
                    resume_spec_changes(out, spec.model_dump(), allow_spec_change) if resume else []
                )
                threads = torch.get_num_threads()
                try:
                    wall = time.perf_counter()
                    with _displayed(spec, out, smoke) as display:
                        yield Place(spec, out, resume, smoke, temporary, changes, display, wall)
                finally:
                    torch.set_num_threads(threads)
            ended = True
        finally:
            if temporary:
                if ended:  # every process is done with the folder
                    distributed.barrier()
                if world.main:
                    shutil.rmtree(out, ignore_errors=True)


@contextlib.contextmanager
def _displayed(spec: Spec, out: Path, smoke: bool) -> Iterator[Reporter]:
    """The run's display (the first process's; silent on the others), from the first second:
    a model that takes a minute to load says so; the libraries' log lines go to the run's
    library.log, their warnings once each through the display."""
    world = distributed.world()
    display: Reporter = (
        Display(spec.train.rounds, 0, spec.output.progress) if world.main else Silent()
    )
    logs = out / LIBRARY_LOG if world.main else None
    try:
        with folded_logs(display, logs):
            if smoke:
                display.message(SMOKE_NOTE)
            yield display
    finally:
        display.close()


@contextlib.contextmanager
def running(place: Place) -> Iterator[Run]:
    """The run of the place's spec (:func:`~ppokit.trainer.run.build`), closed at the end;
    a failure to close after a finished run is a warning (its work is saved)."""
    run = build(place.spec, place.display)
    try:
        yield run
    except BaseException:
        with contextlib.suppress(Exception):  # the run's own error is the one to tell
            run.close()
        raise
    try:
        run.close()
    except UserError as exc:  # the run finished and saved: a success all the same
        place.display.message(f"warning: after the run ended: {exc}")
