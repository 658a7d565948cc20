"""``build(spec)``: a run of a spec, ready for its rounds, as ``ppokit train`` builds it.

In order: the spec's shares of the processes are checked; the random streams are seeded
from ``seed``; the components are assembled (:class:`~ppokit.trainer.assembly.Assembly`);
the models are built (:func:`~ppokit.trainer.models.build_models`); torch gets the run's CPU
threads (:func:`~ppokit.trainer.threads.set_threads`); on several processes the models are
sharded; the rollout engine starts (:meth:`Setup.start`); the rounds' state is created
(:meth:`State.create`). What comes back is a :class:`Run`, the two objects
:func:`~ppokit.trainer.round.run_round` works on, closed by :meth:`Run.close` or a ``with``
block."""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from types import TracebackType

import numpy as np
import torch

from ppokit import distributed
from ppokit.errors import UserError
from ppokit.spec import Spec
from ppokit.trainer.assembly import Assembly
from ppokit.trainer.models import build_models, quiet_progress_bars
from ppokit.trainer.report import Reporter, Silent
from ppokit.trainer.setup import Setup, State
from ppokit.trainer.threads import set_threads, threads_text

__all__ = ["Run", "build", "check_shares", "seed_all"]


@dataclass
class Run:
    """A built run: the :class:`Setup` a spec assembled once and the :class:`State` its
    rounds change; ``threads``: the CPU threads torch was given, as ``ppokit train`` says
    them. :meth:`close` (or the end of a ``with`` block) stops the engine and the
    components' worker processes."""

    setup: Setup
    state: State
    threads: str

    def close(self) -> None:
        self.setup.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if error is None:
            self.close()
            return
        with contextlib.suppress(Exception):  # the block's own error is the one to tell
            self.close()


def seed_all(seed: int) -> None:
    """Python's, numpy's and torch's random streams from ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def check_shares(spec: Spec, processes: int) -> None:
    """Equal shares of prompts and minibatch rows for each of ``processes``."""
    r, t = spec.rollout, spec.train
    if r.prompts_per_round % processes:
        raise UserError(
            f"rollout.prompts_per_round ({r.prompts_per_round}) must be divisible by the "
            f"number of processes ({processes})"
        )
    if t.minibatch_size and t.minibatch_size % processes:
        raise UserError(
            f"train.minibatch_size ({t.minibatch_size}) must be divisible by the number of "
            f"processes ({processes})"
        )


def build(
    spec: Spec, reporter: Reporter | None = None, *, threads: bool = True, shard: bool = True
) -> Run:
    """The run of ``spec`` (module docstring), its engine started; ``reporter`` hears the
    steps (a model that takes a minute to load says so) and then the rounds' phases.
    ``threads`` False: torch's threads are left as they are; ``shard`` False: the models
    stay whole on several processes (shard them with ``models.shard`` and create the
    state again)."""
    report = reporter if reporter is not None else Silent()
    world = distributed.world()
    check_shares(spec, world.size)
    seed_all(spec.seed)
    assembly = Assembly.from_spec(spec)
    try:
        with quiet_progress_bars():
            models = build_models(spec, assembly.head_size, report=reporter)
        if threads:
            said = set_threads(spec, models)
        else:
            said = threads_text(torch.get_num_threads(), "as the process set them")
        if shard and world.distributed:
            report.step(f"sharding the models over {world.size} processes")
            models.shard(spec.parallel)
        report.step(f"starting the rollout engine ({spec.rollout.engine.name})")
        setup = Setup.start(spec, models, assembly, reporter)
    except BaseException:
        assembly.close()
        raise
    try:
        state = State.create(spec, models)
    except BaseException:
        with contextlib.suppress(Exception):
            setup.close()
        raise
    return Run(setup, state, said)
