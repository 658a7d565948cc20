"""Small specs and trainees (a run's setup and state) on the tiny model for the trainer
tests."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ppokit.spec import Spec, load_spec
from ppokit.trainer.estimation import UpdateData
from ppokit.trainer.metrics import Meter
from ppokit.trainer.producers import (
    Asynchronous,
    Draw,
    Given,
    Inline,
    Overlapped,
    Producer,
    PutBack,
    starting_with,
)
from ppokit.trainer.report import Silent
from ppokit.trainer.rollout import Rollout
from ppokit.trainer.round import RoundResult, run_round
from ppokit.trainer.run import build
from ppokit.trainer.setup import Setup, State

DEMO = Path(__file__).resolve().parents[2] / "ppokit" / "specs" / "demo.yaml"

#: A small, fast version of the demo spec.
SMALL = [
    "output.progress=false",
    "train.rounds=1",
    "rollout.prompts_per_round=4",
    "rollout.n=2",
    "rollout.max_new_tokens=4",
    "train.minibatch_size=null",
    "model.tiny.hidden_size=32",
    "model.tiny.intermediate_size=64",
    # the resume tests lengthen a run; a schedule over the run's rounds would then change
    "train.lr_schedule=constant",
]


#: GRPO with dynamic sampling (the ``informative`` group filter, up to 8 generation batches a
#: round) on the small spec; the test names the reward.
GROUP_FILTERED = [
    "advantage=grpo",
    "critic=null",
    "rollout.filter=informative",
    "rollout.n=4",
    "rollout.max_new_tokens=6",
    "rollout.max_generation_batches=8",
    "train.minibatch_size=8",
]


def small_spec(tmp: Path | None = None, *overrides: str) -> Spec:
    out = [f"output.dir={tmp}"] if tmp is not None else []
    return load_spec(DEMO, [*SMALL, *out, *overrides])


class Progress(Silent):
    """A reporter that hands the engine's decoding steps to ``listen``."""

    def __init__(self, listen: Callable[[int, int, int], None]) -> None:
        self.listen = listen

    def generation(self, step: int, steps: int, rows: int) -> None:
        self.listen(step, steps, rows)


@dataclass
class Trainee:
    """A run's :class:`Setup` and :class:`State` as the trainer tests use them: ``sample``
    at the state's round, and rounds on given rows or batches."""

    setup: Setup
    state: State

    def listen(self, progress: Callable[[int, int, int], None]) -> None:
        """The engine's decoding steps go to ``progress``."""
        self.setup.reporter = Progress(progress)

    def sample(self, prompts: list[str], n: int, **kwargs: Any) -> Rollout:
        return self.setup.sample(self.state.round, prompts, n, **kwargs)

    def collect(
        self, rows: list[dict[str, Any]], formatted: list[str], round_no: int | None = None,
        rollout: Rollout | None = None, scores: torch.Tensor | None = None,
    ) -> tuple[UpdateData | None, RoundResult]:  # fmt: skip
        """Steps 1-4 of the next round (or round ``round_no``): (what the update would
        read, the round's result so far)."""
        round_no = round_no if round_no is not None else self.state.round + 1
        producer = self.producer(rows, formatted, rollout, scores)
        result = run_round(
            self.setup, self.state, producer.next(round_no), round_no=round_no, update=False
        )
        return result.data, result

    def producer(
        self, rows: list[dict[str, Any]], formatted: list[str], rollout: Rollout | None = None,
        scores: torch.Tensor | None = None, draw: Draw | None = None,
        put_back: PutBack | None = None,
    ) -> Producer:  # fmt: skip
        """A producer whose next batch starts with ``rows`` (``rollout``, ``scores``: its
        responses and rewards, already made; ``draw``: the batches after it, ``put_back``:
        the last one back, for scoring overlapped with generation)."""
        if rollout is not None:
            return Given.of(self.setup, rows, formatted, rollout, scores)
        first = starting_with(rows, formatted, draw)
        if put_back is not None and self.setup.spec.rollout.overlap_scoring:
            return Overlapped(self.setup, first, put_back)
        return Inline(self.setup, first, refills=draw is not None)

    def round(
        self, rows: list[dict[str, Any]], formatted: list[str], round_no: int | None = None,
        *, rollout: Rollout | None = None, scores: torch.Tensor | None = None,
        draw: Draw | None = None, put_back: PutBack | None = None, **kwargs: Any,
    ) -> RoundResult:  # fmt: skip
        """The whole next round (or round ``round_no``), the engine synced after it."""
        round_no = round_no if round_no is not None else self.state.round + 1
        producer = self.producer(rows, formatted, rollout, scores, draw, put_back)
        produced = producer.next(round_no)
        result = run_round(self.setup, self.state, produced, round_no=round_no, **kwargs)
        result.timings.update(producer.trained(round_no))
        return result

    def round_of(self, producer: Producer, round_no: int) -> RoundResult:
        """Round ``round_no`` on the batch ``producer`` makes for it, then what the producer
        does after an update."""
        result = run_round(self.setup, self.state, producer.next(round_no), round_no=round_no)
        result.timings.update(producer.trained(round_no))
        return result

    def reshard(self) -> None:
        """The models sharded over the processes, with optimizers over the shards."""
        self.setup.models.shard(self.setup.spec.parallel)
        self.state = State.create(self.setup.spec, self.setup.models)

    def close(self) -> None:
        self.setup.close()


def learner(spec: Spec) -> Trainee:
    """The run of ``spec`` as ``ppokit.build`` makes it, on the process's torch threads and
    with whole models on several processes (:meth:`Trainee.reshard` shards them)."""
    run = build(spec, threads=False, shard=False)
    return Trainee(run.setup, run.state)


def accumulate(
    lrn: Trainee, data: UpdateData, idx: torch.Tensor, micro: int, train_actor: bool
) -> torch.Tensor:
    """The round's gradient accumulation over the minibatch ``idx`` (run_round's step 5
    without the optimizer step): the gradients of the micro-batches of ``micro`` rows, and
    the minibatch loss, the sum of the micro-batch losses (detached)."""
    objective, processes = lrn.setup.objective, 1
    lrn.state.optimizers.zero_grad()
    denoms = objective.denominators(data, idx)
    total = torch.zeros(())
    for j in idx.split(micro):
        share = j.shape[0] / (idx.shape[0] * processes)
        loss = objective.micro_loss(data, j, denoms, share, lrn.state.kl_coef, train_actor, Meter())
        loss.backward()
        total = total + loss.detach()
    return total


def encode(lrn: Trainee, prompts: list[str], n: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The learner's left-padded prompt ids and mask, each prompt ``n`` times."""
    spec = lrn.setup.spec
    ids, attn = lrn.setup.encode(prompts, spec.data, spec.rollout.max_new_tokens)
    return ids.repeat_interleave(n, 0), attn.repeat_interleave(n, 0)


def demo_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    from ppokit.tasks.demo import make_row

    rng = random.Random(seed)
    return [make_row(rng) for _ in range(n)]


def with_observations(ro: Rollout) -> Rollout:
    """``ro`` as a multi-turn rollout: positions 1, 4, 7, ... inside each response (never
    its first or last token) become the environment's tokens (``env_mask``, out of the
    response mask, log μ 0), as observations between the model's turns."""
    mask = ro.response_mask
    t = torch.arange(mask.shape[1])
    last = mask.sum(1, keepdim=True) - 1
    env = mask & (t % 3 == 1) & (t < last)
    model = mask & ~env
    logp = None if ro.logp_rollout is None else ro.logp_rollout * model
    b = mask.shape[0]
    return Rollout(
        ro.prompt_ids,
        ro.prompt_mask,
        ro.response_ids,
        model,
        ro.truncated,
        logp,
        env_mask=env,
        turn_rewards=torch.zeros(mask.shape),
        turns=1 + env.sum(1),
        ended=torch.zeros(b, dtype=torch.long),
    )


def reseal_manifest(folder: Path) -> None:
    """Make a checkpoint's manifest match its files again (as someone who edited the files
    and rewrote the manifest would): the manifest proves nothing about who wrote them."""
    import hashlib
    import json

    manifest = json.loads((folder / "manifest.json").read_text())
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest["files"] = {
        p.relative_to(folder).as_posix(): {
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            "bytes": p.stat().st_size,
        }
        for p in files
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))


def run_fixtures(*overrides: str, symlinks: bool = False, after: Any = None) -> tuple[Any, Any]:
    """The ``trained`` (a run of ``small_spec(out, *overrides)``, trained once for the test
    module) and ``run`` (a fresh copy of it for each test; ``symlinks``: links copied as
    links; ``after(out)``: applied to the copy) fixtures: ``trained, run = run_fixtures(...)``
    at a test module's top level."""
    import shutil

    import pytest

    from ppokit.trainer import train

    @pytest.fixture(scope="module", name="trained")
    def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
        out = tmp_path_factory.mktemp("trained") / "run"
        train(small_spec(out, *overrides))
        return out

    @pytest.fixture(name="run")
    def run(trained: Path, tmp_path: Path) -> Path:
        out = tmp_path / "run"
        shutil.copytree(trained, out, symlinks=symlinks)
        if after is not None:
            after(out)
        return out

    return trained, run


def resume(out: Path, *overrides: str) -> int:
    """``load_checkpoint`` of ``out`` into a fresh learner of ``small_spec(out, *overrides)``:
    the round it resumes at."""
    from ppokit.data import make_prompt_source
    from ppokit.trainer.checkpoint import load_checkpoint

    spec = small_spec(out, *overrides)
    lrn = learner(spec)
    source = make_prompt_source(spec.data, spec.seed)
    return load_checkpoint(out, lrn.setup.models, lrn.state, source)


def untimed(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metrics lines without their timings and memory measurements (the metrics table's
    ``timing`` rows): what two runs of one spec must share to the bit."""
    from ppokit.metrics_table import metric

    return [{k: v for k, v in h.items() if not metric(k).timing} for h in history]


def one_line_error(fn: Any, *args: Any) -> str:
    """The message of the ``UserError`` that ``fn(*args)`` raises: one line, not empty."""
    import pytest

    from ppokit.errors import UserError

    with pytest.raises(UserError) as info:
        fn(*args)
    message = str(info.value)
    assert message and "\n" not in message
    return message


def check_one_update_behind(lrn: Trainee, rounds: int = 3, *, stale_differs: bool) -> None:
    """Asynchronous rounds at ``max_staleness: 1`` (the demo's rows, 4 a round): round k's
    batch records version max(0, k - 2) on every row, at most one update behind, and its log
    μ is the trainer's log-probs at exactly those weights (1e-4); with ``stale_differs``,
    a batch one update behind is also off the current weights (> 1e-3). Closes ``lrn``."""
    import copy

    weights = {0: copy.deepcopy(lrn.setup.models.actor)}
    seen = [0]

    def draw() -> tuple[list[dict], list[str]]:
        rows = demo_rows(4, seen[0])
        seen[0] += 1
        return rows, [r["prompt"] for r in rows]

    rollouts = Asynchronous(lrn.setup, draw, start=0)
    try:
        for k in range(1, rounds + 1):
            ro = lrn.round_of(rollouts, k).data.rollout
            versions = ro.version.tolist()
            version = max(0, k - 2)
            assert versions == [version] * len(versions)
            assert all(k - 1 - v <= 1 for v in versions)  # the staleness bound, row by row
            with torch.no_grad():
                sampler = lrn.setup.forwards.actor(weights[version], ro)[0] * ro.response_mask
                now = lrn.setup.forwards.actor(lrn.setup.models.actor, ro)[0] * ro.response_mask
            assert float((ro.logp_rollout - sampler).abs().max()) < 1e-4
            if stale_differs and version < k - 1:
                assert float((ro.logp_rollout - now).abs().max()) > 1e-3
            weights[k] = copy.deepcopy(lrn.setup.models.actor)
    finally:
        rollouts.close()
        lrn.close()
