"""Generation on several processes (gloo, 2 CPU processes): with
``parallel.gather_for_generation`` the sharded actor's parameters are gathered once per
rollout, not at every decoding step, the responses are the same as without it, and every
block is sharded again afterwards."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from ppokit import distributed
from tests.helpers.ranks import as_process, written_by_two
from tests.helpers.trainer import demo_rows, learner, small_spec

STEPS = 6


def _gathers(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and how many all-gathers FSDP2 ran for it."""
    real = dist.all_gather_single
    calls = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_gather_single = counted  # what FSDP2's default all-gather calls
    try:
        return fn(), len(calls)
    finally:
        dist.all_gather_single = real


def _worker(rank: int, port: int, folder: str) -> None:
    as_process(rank, port)
    prompts = [row["prompt"] for row in demo_rows(4)][rank * 2 : rank * 2 + 2]
    results: dict[str, Any] = {}
    with distributed.process_group("cpu", 120):
        for gather in ("true", "false"):
            spec = small_spec(
                None,
                f"parallel.gather_for_generation={gather}",
                f"rollout.max_new_tokens={STEPS}",
            )
            lrn = learner(spec)
            lrn.setup.models.shard(spec.parallel)
            torch.manual_seed(3)
            ro, during = _gathers(lambda lrn=lrn: lrn.sample(prompts, 2))
            _, after = _gathers(
                lambda lrn=lrn, ro=ro: lrn.setup.forwards.actor(lrn.setup.models.actor, ro)
            )
            results[gather] = {
                "during": during,
                "after": after,
                "modules": sum(isinstance(m, FSDPModule) for m in lrn.setup.models.actor.modules()),
                "responses": ro.response_ids.tolist(),
            }
    Path(f"{folder}/generation{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def generations(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = written_by_two(tmp_path_factory, "distributed-generation", _worker)
    return [json.loads((folder / f"generation{r}.json").read_text()) for r in (0, 1)]


def test_gathered_once_per_rollout(generations: list[dict[str, Any]]) -> None:
    for result in generations:
        gathered, every_step = result["true"], result["false"]
        assert gathered["during"] == gathered["modules"]  # each FSDP module once
        # without it, every block is gathered again at every decoding step
        assert every_step["during"] >= (gathered["modules"] - 1) * STEPS


def test_same_responses_and_sharded_again(generations: list[dict[str, Any]]) -> None:
    for result in generations:
        assert result["true"]["responses"] == result["false"]["responses"]
        # the forward after the rollout gathers as many times: the blocks were resharded
        assert result["true"]["after"] == result["false"]["after"] > 0
