"""``ppokit.build(spec)``: the run ``ppokit train`` builds, for rounds of one's own."""

from __future__ import annotations

from pathlib import Path

import torch

import ppokit
from ppokit.data import make_prompt_source
from ppokit.trainer.lifecycle.resume import drawer
from ppokit.trainer.metrics import TIMING, read_metrics, read_once
from ppokit.trainer.producers import Inline
from ppokit.trainer.round import run_round
from tests.helpers.trainer import small_spec


def test_a_round_on_the_built_run_is_the_first_round_of_ppokit_train(tmp_path: Path) -> None:
    """Nothing ``ppokit train`` does between its build and its first round (the prompts,
    the records, the evaluator, the producer) changes that round: a round on the built run is
    train's, to the bit; the run gets train's threads and closes at the end of the block."""
    spec = small_spec(tmp_path / "run", "rollout.n=4", "train.ppo_epochs=2")
    threads, closed = torch.get_num_threads(), []
    try:
        ppokit.train(spec)
        with ppokit.build(spec) as run:
            assert run.threads.startswith("1 CPU thread (automatic: ")
            source = make_prompt_source(spec.data, spec.seed)
            producer = Inline(run.setup, drawer(run.setup, source))
            result = run_round(run.setup, run.state, producer.next(1), round_no=1)
            producer.trained(1)
            mine = read_once(result.metrics)
            real_close = run.setup.close
            run.setup.close = lambda: closed.append(real_close())  # type: ignore[method-assign]
    finally:
        torch.set_num_threads(threads)
    [trained] = read_metrics(tmp_path / "run")
    mine.pop("tokens")
    assert mine and {k: trained[k] for k in mine if k not in TIMING} == {
        k: v for k, v in mine.items() if k not in TIMING
    }
    assert closed == [None]  # the end of the block closed the run
