"""Dynamic sampling on two processes (gloo, CPU): the stopping rule is whole-round.

The second process's prompts of a and b score a constant (never informative) while every
prompt of the first process can pass, so the second needs more batches than the first: both
draw the same number of batches, end with the same number of groups (their share), and log
the same whole-round counts. The reward declares itself blocking, so each process scores a
batch on a thread while it generates the next ahead (rollout.overlap_scoring): the processes
decide alike when to generate ahead, and a batch that goes back leaves the data position as
the batches used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ppokit import distributed
from tests.helpers.ranks import as_process, written_by_two

PROMPTS, N, ROUNDS = 4, 4, 3
OVERRIDES = [
    "reward=rank_constant",
    "advantage=grpo",
    "critic=null",
    "rollout.filter=informative",
    f"rollout.prompts_per_round={PROMPTS}",
    f"rollout.n={N}",
    "rollout.max_new_tokens=6",
    "rollout.max_generation_batches=10",
    "train.minibatch_size=8",
]


def rank_constant() -> Any:
    """On process 1, prompts of a and b score 0.5; elsewhere the fraction of the response's
    characters in a-m."""

    def reward(
        prompts: list[str], responses: list[str], answer: list[str], **_: Any
    ) -> list[float]:
        rank = distributed.world().rank
        return [
            0.5
            if rank == 1 and symbol in "ab"
            else sum("a" <= ch <= "m" for ch in text) / max(1, len(text))
            for text, symbol in zip(responses, answer, strict=True)
        ]

    reward.blocking = True  # type: ignore[attr-defined]
    return reward


def _use_plugin() -> None:
    import ppokit.registry as registry_module
    from ppokit import components
    from ppokit.catalogue import NoParams
    from ppokit.registry import Registry, reset_registry
    from tests.helpers import Plugin

    registry = Registry()
    registry.load_plugin("ppokit", components, distribution="ppokit")
    plugin = Plugin().add("reward", "rank_constant", rank_constant, params=NoParams, summary="-")
    registry.load_plugin("test0", plugin, distribution="ppokit-test0")
    registry_module.build_registry = lambda strict=None: registry  # type: ignore[assignment]
    reset_registry()


def _worker(rank: int, port: int, folder: str) -> None:
    as_process(rank, port)
    _use_plugin()
    from ppokit.data import make_prompt_source
    from ppokit.trainer.prompts import format_prompts
    from tests.helpers.trainer import learner, small_spec

    with distributed.process_group("cpu", 120):
        spec = small_spec(None, *OVERRIDES)
        world = distributed.world()
        lrn = learner(spec)
        lrn.reshard()
        source = make_prompt_source(spec.data, spec.seed)

        def draw() -> tuple[list[dict[str, Any]], list[str]]:  # as the loop draws
            rows = source.next_rows(PROMPTS)[world.share(PROMPTS)]
            return rows, format_prompts(rows, lrn.setup.models.tokenizer, spec.data)

        def put_back() -> None:
            source.put_back(PROMPTS)

        own: list[int] = []
        records = []
        for r in range(1, ROUNDS + 1):
            rows, formatted = draw()
            result = lrn.round(rows, formatted, r, draw=draw, put_back=put_back)
            if result.data is not None:  # the round had an update
                own.append(result.data.batch.batch_size)
            record = {k: float(v) for k, v in result.metrics.items() if k.startswith("rollout/")}
            record.update(
                drawn=source.drawn,
                own_rows=own[-1],
                informative=bool(
                    (
                        result.scores.view(-1, N).max(1).values
                        > result.scores.view(-1, N).min(1).values
                    ).all()
                ),
                policy_loss=float(result.metrics["policy_loss"]),
                discarded="time_discarded" in result.timings,
            )
            records.append(record)
        Path(f"{folder}/rank{rank}.json").write_text(json.dumps(records))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return written_by_two(tmp_path_factory, "distributed-filter", _worker)


def test_whole_round_counts_and_equal_shares(two_processes: Path) -> None:
    ranks = [json.loads((two_processes / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == ROUNDS
    total_batches = 0
    for first, second in zip(*ranks, strict=True):
        for key in (
            "rollout/kept_groups",
            "rollout/passed_groups",
            "rollout/generated_groups",
            "rollout/generation_batches",
            "rollout/exhausted",
            "drawn",
            "own_rows",
            "policy_loss",  # the whole minibatch's loss, the same on both
            "discarded",  # a batch generated ahead went back on both or neither
        ):
            assert first[key] == second[key], key
        assert first["rollout/kept_groups"] == PROMPTS  # the whole round
        assert first["own_rows"] == PROMPTS // 2 * N  # each process its share
        assert first["rollout/generated_groups"] == first["rollout/generation_batches"] * PROMPTS
        assert first["rollout/passed_groups"] >= PROMPTS
        assert first["informative"] and second["informative"]
        total_batches += int(first["rollout/generation_batches"])
        assert first["drawn"] == total_batches * PROMPTS  # every process drew every batch
    assert total_batches > ROUNDS  # the second process's constant prompts needed more
    assert any(r["discarded"] for r in ranks[0])  # a batch was generated ahead, not needed
