"""The asynchronous schedule on a scripted engine: staleness bounded by admission, nothing
lost or trained twice, the data stream consumed in order, no push during a generation, and
a result that does not depend on how long generating and updating take."""

from __future__ import annotations

import hashlib
import random
import threading
import time
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.trainer.producers.schedule import Job, Ready, Schedule, version_of


@dataclass
class Scripted:
    """An engine with weights of its own (a digest, and the version they are), a trainer
    whose weights after an update are a digest of what it trained on, and latencies drawn
    from ``seed`` (in milliseconds up to ``slowest``)."""

    seed: int
    slowest: float
    rows_per_batch: int = 3
    trainer: str = "w0"
    version: int = 0
    engine: tuple[int, str] = (0, "w0")
    drawn: int = 0
    generating: threading.Event = field(default_factory=threading.Event)
    pushes_during_generation: int = 0

    def __post_init__(self) -> None:
        self.latency = random.Random(self.seed)

    def sleep(self) -> None:
        time.sleep(self.latency.random() * self.slowest / 1000)

    def draw(self) -> tuple[list[dict], list[str]]:
        rows = [{"i": self.drawn + k} for k in range(self.rows_per_batch)]
        self.drawn += self.rows_per_batch
        return rows, [f"p{r['i']}" for r in rows]

    def generate(self, job: Job) -> tuple[int, str, list[int]]:
        self.generating.set()
        version, weights = self.engine
        self.sleep()
        self.generating.clear()
        return version, _digest(weights, job.formatted), [r["i"] for r in job.rows]

    def push(self) -> None:
        if self.generating.is_set():
            self.pushes_during_generation += 1
        self.engine = (self.version, self.trainer)

    def update(self, out: tuple[int, str, list[int]]) -> None:
        self.sleep()
        self.trainer = _digest(self.trainer, [out[1]])
        self.version += 1


def _digest(weights: str, parts: list[str]) -> str:
    return hashlib.sha256("|".join([weights, *parts]).encode()).hexdigest()[:16]


def _run(s: int, rounds: int, seed: int, slowest: float, stop: int | None = None) -> dict:
    """A run of ``rounds`` rounds at staleness ``s`` (``stop``: only up to that round, and
    what a checkpoint there would save)."""
    engine = Scripted(seed, slowest)
    schedule: Schedule[tuple[int, str, list[int]]] = Schedule(
        max_staleness=s,
        last_round=rounds,
        start=0,
        draw=engine.draw,
        generate=engine.generate,
        push=engine.push,
    )
    consumed: list[tuple[int, int, int, list[int]]] = []  # round, trainer's and row's version
    try:
        for k in range(1, (stop or rounds) + 1):
            ready = schedule.take(k, engine.version)
            version, _, rows = ready.out
            assert version == ready.job.version  # the weights it says it came from
            consumed.append((k, engine.version, version, rows))
            engine.update(ready.out)
        pending = schedule.pending() if stop else []
    finally:
        schedule.close()
    return {
        "consumed": consumed,
        "weights": engine.trainer,
        "pushes_during_generation": engine.pushes_during_generation,
        "pending": pending,
        "engine": engine,
    }


@settings(max_examples=25, deadline=None)
@given(
    s=st.integers(1, 3),
    rounds=st.integers(1, 7),
    seeds=st.tuples(st.integers(0, 2**16), st.integers(0, 2**16)),
)
def test_bounded_complete_in_order_and_independent_of_latencies(s, rounds, seeds) -> None:
    runs = [_run(s, rounds, seed, slowest) for seed, slowest in zip(seeds, (3.0, 1.0), strict=True)]
    a = runs[0]
    rows = [i for *_, batch in a["consumed"] for i in batch]
    assert rows == list(range(3 * rounds))  # nothing lost, nothing twice, in order
    for k, trainer_version, version, _ in a["consumed"]:
        assert trainer_version == k - 1
        assert 0 <= trainer_version - version <= s  # the bound
        assert version == version_of(k, s)  # exactly the admitted weights
    assert a["pushes_during_generation"] == 0
    b = runs[1]  # other latencies: the same batches from the same weights, the same result
    assert a["consumed"] == b["consumed"] and a["weights"] == b["weights"]


def test_versions_by_hand() -> None:
    """S = 1: round k trains on the weights before round k − 1's update (the first two
    rounds on the initial ones); S = 2 one more behind; S = 0 is the synchronous order."""
    for s, versions in ((0, [0, 1, 2, 3, 4]), (1, [0, 0, 1, 2, 3]), (2, [0, 0, 0, 1, 2])):
        got = [version for *_, version, _ in _run(s, 5, 0, 0.0)["consumed"]]
        assert got == versions, s
        assert [version_of(k, s) for k in range(1, 6)] == versions


def test_a_resumed_schedule_continues_the_uninterrupted_one() -> None:
    """Stopped after round 3 (what a checkpoint holds: the trainer's weights and the S
    batches generated ahead), then started again from them: the same batches and result."""
    s, rounds = 2, 7
    whole = _run(s, rounds, 1, 1.0)
    part = _run(s, rounds, 2, 2.0, stop=3)
    pending: list[Ready] = part["pending"]
    assert [r.job.round for r in pending] == [4, 5]
    assert [r.job.version for r in pending] == [1, 2]  # older than the checkpoint's weights
    engine: Scripted = part["engine"]
    engine.engine = (99, "stale")  # a restarted engine: the run pushes the restored weights
    engine.push()
    schedule = Schedule(
        max_staleness=s,
        last_round=rounds,
        start=3,
        draw=engine.draw,
        generate=engine.generate,
        push=engine.push,
        ready=pending,
    )
    consumed = list(part["consumed"])
    try:
        for k in range(4, rounds + 1):
            ready = schedule.take(k, engine.version)
            consumed.append((k, engine.version, ready.out[0], ready.out[2]))
            engine.update(ready.out)
    finally:
        schedule.close()
    assert consumed == whole["consumed"] and engine.trainer == whole["weights"]


def test_an_engine_error_reaches_the_trainer() -> None:
    def fail(job: Job) -> None:
        raise ValueError(f"engine broke on round {job.round}")

    schedule: Schedule[None] = Schedule(
        max_staleness=1,
        last_round=3,
        start=0,
        draw=lambda: ([], []),
        generate=fail,
        push=lambda: None,
    )
    with pytest.raises(ValueError, match="round 1"):
        schedule.take(1, 0)
    schedule.close()
