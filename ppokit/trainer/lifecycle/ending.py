"""How a run ends: stopped (:func:`stops`: Ctrl-C, SIGTERM or an error during the rounds,
the last finished round kept as :mod:`~ppokit.trainer.stopping` says) or finished
(:func:`finish`: the curves, the summary, where the results are, the summary returned)."""

from __future__ import annotations

import contextlib
import shlex
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ppokit import distributed
from ppokit.bounded import terminating_as_interrupt
from ppokit.errors import UserError
from ppokit.metrics_table import REWARD, ROUND
from ppokit.runfolder import CHECKPOINT, CURVES_PNG, METRICS, SAMPLES, how_to_continue
from ppokit.trainer.checkpoint import checkpoint_round
from ppokit.trainer.health import fired_signs
from ppokit.trainer.lifecycle.opening import Place
from ppokit.trainer.lifecycle.records import Records
from ppokit.trainer.lifecycle.resume import Resumed
from ppokit.trainer.lifecycle.smoke import ZERO_REWARDS
from ppokit.trainer.metrics import curves_title, plot_curves
from ppokit.trainer.run import Run, seed_all
from ppokit.trainer.stopping import Ends, Stopped

__all__ = ["RESULTS", "Interrupted", "Stops", "finish", "stops", "where_results"]

#: What a finished run leaves in its folder, and what each is for.
RESULTS = (
    (CURVES_PNG, "the curves"),
    (METRICS, "every round's metrics"),
    (SAMPLES, "sampled responses"),
    (f"{CHECKPOINT}/", "for --resume, eval and export"),
)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during the rounds: which round, the last checkpoint, and how to continue."""

    def __init__(
        self,
        out: Path,
        round_no: int,
        total: int,
        checkpoint: int | None,
        save_every: int,
        smoke: bool,
    ) -> None:
        self.out = out
        self.round = round_no
        self.total = total
        self.checkpoint = checkpoint
        self.save_every = save_every
        self.smoke = smoke
        super().__init__(" ".join(self.describe()))

    def describe(self, command: Sequence[str] | None = None) -> list[str]:
        """The lines to show; ``command`` is the ``ppokit train SPEC [--set ...]`` that
        started the run (``--out DIR --resume`` is added)."""
        where = f"interrupted during round {self.round}/{self.total}"
        if self.smoke:
            return [f"{where} of the smoke run"]
        base = list(command) if command else ["ppokit", "train", "SPEC"]
        state, then = how_to_continue(self.out, base, self.checkpoint)
        if not self.checkpoint:
            state += f" (output.save_every={self.save_every})"
        return [f"{where}; {state}", then]


class Stops:
    """The rounds' ends (:func:`stops`): ``current``, the round being run."""

    def __init__(self, place: Place, ends: Ends | None, start: int) -> None:
        self.place, self.ends, self.current = place, ends, start + 1

    @contextlib.contextmanager
    def round(self, round_no: int) -> Iterator[None]:
        """Round ``round_no``: its random streams on several processes (from the seed, the
        process and the round), its line on the display, a Ctrl-C after its first optimizer
        step held to its end; its end kept as the one a stop goes back to."""
        self.current = round_no
        spec, world = self.place.spec, distributed.world()
        if world.distributed:
            seed_all(distributed.round_seed(spec.seed, world.rank, round_no))
        self.place.display.start_round(round_no)
        ends = self.ends
        with ends.holding(self.place.display, round_no) if ends else contextlib.nullcontext():
            yield
            if ends:  # inside the hold: a Ctrl-C held to the round's end saves this round
                ends.round_ended(round_no)


@contextlib.contextmanager
def stops(place: Place, run: Run, at: Resumed, records: Records) -> Iterator[Stops]:
    """The rounds, stopped by Ctrl-C (:class:`Interrupted`), SIGTERM or an error: on one
    process with synchronous rollouts the last finished round is saved
    (:mod:`~ppokit.trainer.stopping`); the summary of the rounds run is shown; on one
    process a user's error carries how to go on (:class:`~ppokit.trainer.stopping.Stopped`:
    the last checkpoint, the saved round's or the last periodic one; on several, the
    launcher reads it from the folder)."""
    spec, out, display = place.spec, place.out, place.display
    world = distributed.world()
    # one process, synchronous rollouts: a stop keeps the last finished round (stopping.py)
    keeps = not world.distributed and not spec.rollout.max_staleness
    ends = Ends(run.setup, run.state, at.source, at.producer, at.start) if keeps else None
    stopping = Stops(place, ends, at.start)
    history = records.history
    try:
        with terminating_as_interrupt() if keeps else contextlib.nullcontext():
            yield stopping
    except KeyboardInterrupt:
        if ends:
            ends.save(out, spec.to_yaml(), display)
        display.close()
        if history and not place.temporary:
            display.summary(history, str(out))
        raise Interrupted(
            out,
            stopping.current,
            spec.train.rounds,
            checkpoint_round(out),
            spec.output.save_every,
            place.smoke,
        ) from None
    except Exception as exc:
        if place.smoke or world.distributed:
            raise
        if ends:
            ends.save(out, spec.to_yaml(), display)
        display.close()
        if history:
            display.summary(history, str(out))
        stopped = Stopped(str(exc), out, checkpoint_round(out))
        if isinstance(exc, UserError):  # the error as it is, with how to go on
            exc.stopped = stopped  # type: ignore[attr-defined]
            raise
        for line in stopped.describe():  # a bug's traceback follows
            display.message(line)
        raise
    finally:
        display.close()


def finish(place: Place, at: Resumed, records: Records) -> dict[str, Any]:
    """The end of a finished run: the curves (curves.png, and to the trackers), the
    summary, where the results are; returns the run's summary (``ppokit train --json``)."""
    spec, out, display = place.spec, place.out, place.display
    history, world = records.history, distributed.world()
    if history and world.main:
        curves = out / CURVES_PNG
        try:
            plot_curves(history, curves, title=curves_title(str(out), spec.seed))
        except UserError as exc:  # an OS error: the run's records are written
            display.message(f"warning: {exc}")
        else:
            records.trackers.log_image(curves)
    display.summary(history, "the smoke run" if place.temporary else str(out))
    if world.main and not place.smoke:
        for line in where_results(out):
            display.message(line)
    if place.smoke and not any(h.get(REWARD) for h in history):
        display.message(ZERO_REWARDS)
    rewards = [h[REWARD] for h in history if h.get(REWARD) is not None]
    first = rewards[0] if rewards else None  # round 0 (an evaluation only) has none
    tail = [h[REWARD] for h in history[-5:] if h.get(REWARD) is not None]
    return {
        "output_dir": None if place.temporary else str(out),
        "rounds": sum(1 for h in history if h[ROUND] > 0),  # not round 0
        "resumed_from": at.start if place.resume else None,
        "smoke": place.smoke,
        "threads": torch.get_num_threads(),
        "seconds": round(time.perf_counter() - place.wall, 3),
        "reward_first": first,
        "reward_last": sum(tail) / len(tail) if tail else None,
        "final": history[-1] if history else None,
        "health": {
            name: {"first_round": first, "rounds": rounds}
            for name, (first, rounds) in fired_signs(history).items()
        },
        "processes": world.size,
        "main": world.main,
    }


def where_results(out: Path) -> list[str]:
    """The lines that end a run: where its results are (those that exist) and what each way
    of looking at them shows, the folder named once per line (a 60-character path keeps
    each line under 160 columns)."""
    files = [f"{name} ({what})" for name, what in RESULTS if (out / name.rstrip("/")).exists()]
    if not files:
        return []
    lines = [f"results in {out}:", "  " + ", ".join(files)]
    if (out / CURVES_PNG).exists():
        lines.append(f"the curves: {shlex.quote(str(out / CURVES_PNG))}")
    lines.append(f"held-out accuracy: ppokit eval {shlex.quote(str(out))}")
    if (out / "tensorboard").is_dir():
        lines.append(f"every metric: tensorboard --logdir {shlex.quote(str(out / 'tensorboard'))}")
    return lines
