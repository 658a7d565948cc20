"""``train(spec)``: a run from its start to its end, written out as one round after another:
build the run, resume it (or start it), then for each round: produce its batch, run it
(:func:`~ppokit.trainer.round.run_round`), sync the engine, record it (the prompt source
hears its reward when it listens; its evaluation when due), save its checkpoint when due;
end. The pieces live in
:mod:`ppokit.trainer.lifecycle`: where the run runs (``opening``), where its rounds start
(``resume``), its records (``records``), how it stops or finishes (``ending``) and the
smoke run (``smoke``)."""

from __future__ import annotations

import time
from contextlib import closing
from typing import Any

from ppokit.runfolder import RUN_FILES
from ppokit.spec import Spec
from ppokit.trainer.checkpoint import save_checkpoint
from ppokit.trainer.lifecycle.ending import finish, stops
from ppokit.trainer.lifecycle.opening import opened, running
from ppokit.trainer.lifecycle.records import Records, evaluates, tracking
from ppokit.trainer.lifecycle.resume import restore
from ppokit.trainer.round import run_round

__all__ = ["RUN_FILES", "train"]


def train(
    spec: Spec,
    *,
    resume: bool = False,
    smoke: bool = False,
    overwrite: bool = False,
    smoke_out: str | None = None,
    allow_spec_change: bool = False,
) -> dict[str, Any]:
    """Run the PPO loop the spec describes; returns a JSON-serialisable summary.

    ``resume`` continues from ``output.dir/checkpoint`` (refused when the spec differs from
    the run's in what it optimises, unless ``allow_spec_change``: the change is recorded in
    ``spec_changes.jsonl``); ``smoke`` runs two small rounds on the tiny model in
    ``smoke_out`` (default: a temporary directory, removed when the run ends, Ctrl-C and
    errors included); ``overwrite`` replaces an existing run
    (only what a run wrote; a folder that is not a run is never emptied). The folder is
    locked for the run's life. Ctrl-C raises
    :class:`~ppokit.trainer.lifecycle.ending.Interrupted` (a KeyboardInterrupt).
    """
    with (
        opened(
            spec,
            resume=resume,
            smoke=smoke,
            overwrite=overwrite,
            smoke_out=smoke_out,
            allow_spec_change=allow_spec_change,
        ) as place,
        running(place) as run,  # build: the components, the models, the engine, the state
    ):
        spec, out, display = place.spec, place.out, place.display
        setup, state, yaml = run.setup, run.state, spec.to_yaml()
        at = restore(place, run)  # resume: the checkpoint's round, or round 0
        producer, total = at.producer, spec.train.rounds
        with tracking(place, at.start) as trackers, closing(producer):
            records = Records(place, setup, at, trackers)
            records.begin()  # the run's first lines, round 0's evaluation
            with stops(place, run, at, records) as stop:
                for round_no in range(at.start + 1, total + 1):
                    with stop.round(round_no):
                        began = time.perf_counter()
                        produced = producer.next(round_no)
                        trains_actor = round_no > spec.train.critic_warmup_rounds
                        result = run_round(
                            setup, state, produced, round_no=round_no, train_actor=trains_actor
                        )
                        result.timings.update(producer.trained(round_no))  # the engine's sync
                        record = records.of_round(round_no, result, began)
                        records.observed(record)  # the prompt source hears its reward
                        if evaluates(spec, round_no):  # after the update, into its record
                            producer.before_evaluation(round_no)  # the updated weights
                            records.evaluate(record)
                        records.write(record, result)
                        if round_no % spec.output.save_every == 0 or round_no == total:
                            save_checkpoint(
                                out, setup.models, state, at.source, round_no, yaml,
                                producer.state_dict(), setup.assembly.environment,
                            )  # fmt: skip
                        display.round(record.values, total)
            return finish(place, at, records)
