"""Held-out evaluation (``spec.eval``) on a rollout engine and a scorer.

:class:`Evaluator` ``(spec, engine, scorer, encode).run()`` generates, for each of the
evaluation prompts, one greedy response and ``eval.n`` sampled ones (default: the largest
of ``eval.k``), scores them with the spec's rewards (summed with their weights) and returns:

=============================  =============================================================
``eval/accuracy``              fraction of prompts whose greedy response is correct
                               (combined reward ``>= eval.correct_at``)
``eval/accuracy_ci95``         half-width of the 95% Wilson score interval of that fraction
``eval/pass@{k}``              for each k of ``eval.k``: the unbiased pass@k (Chen et al.
                               2021) of the n samples of each prompt with c of them correct,
                               1 − C(n−c, k)/C(n, k) (:func:`ppokit.stats.pass_at_k`),
                               averaged over prompts
``eval/reward_mean``           mean combined reward of the sampled responses
``eval/response_length_mean``  mean length (tokens) of the sampled responses
``eval/prompts``               number of evaluation prompts
=============================  =============================================================

The prompts are the first ``eval.prompts`` rows of ``eval.data`` read in order (``shuffle``
off; a data file with fewer rows gives all of them, each once), its generator seeded with
:func:`eval_seed` ``(spec.seed)``: the same prompts at every evaluation of a run and in
``ppokit eval``, and for a generated source (``demo``, ``arithmetic``) not the rows the run
trains on. The sampling runs under a forked RNG seeded with :func:`eval_seed`, so an
evaluation does not move the training run's random streams (a run with evaluations trains
exactly like one without), every evaluation of a run draws the same sampling noise, and
``ppokit eval RUN`` reproduces the run's own evaluation at the checkpoint's round.

Generation is batched (``eval.batch_size`` prompts at a time) on the run's engine (episodes
with the run's environment, :class:`~ppokit.trainer.episodes.Sampler`);
``eval.max_new_tokens`` replaces ``rollout.max_new_tokens`` for the evaluation only;
sampling uses ``eval.temperature`` and ``eval.top_p`` (no top-k). Apart from the decoded
responses the rewards need, the metric tensors are read back to the host once, at the end.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from ppokit import distributed
from ppokit.components.rollout_engine import Sampling
from ppokit.errors import UserError
from ppokit.spec import ComponentSpec, DataSpec, EvalSpec, Spec
from ppokit.stats import pass_at_k, wilson_half_width
from ppokit.trainer.episodes import Sampler
from ppokit.trainer.rollout import Rollout
from ppokit.trainer.scoring import Scorer

if TYPE_CHECKING:
    from ppokit.trainer.setup import Setup

__all__ = ["Evaluator", "eval_rows", "eval_seed", "isolated_rng"]


def eval_seed(seed: int) -> int:
    """The seed of a run's evaluation, from ``(spec.seed, "eval")``: a 63-bit integer."""
    digest = hashlib.sha256(f"ppokit:{int(seed)}:eval".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _eval_data(settings: EvalSpec, spec: Spec) -> DataSpec:
    """``eval.data``; the spec's validator puts the spec's own data section where it is null."""
    return settings.data if settings.data is not None else spec.data


def in_order(data: DataSpec) -> DataSpec:
    """``data`` read in order: ``shuffle`` off where the source reads it (the data section's
    own setting, or the parameter of a source written as a mapping that has one)."""
    source = data.source
    if not isinstance(source, ComponentSpec):
        return data.model_copy(update={"shuffle": False})
    from ppokit.registry import get_registry

    registry = get_registry()
    known = registry.has("prompt_source", source.name)
    if (
        not known
        or "shuffle" not in registry.info("prompt_source", source.name).params.model_fields
    ):
        return data
    params = {**source.params, "shuffle": False}
    return data.model_copy(update={"source": source.model_copy(update={"params": params})})


def eval_rows(spec: Spec) -> list[dict[str, Any]]:
    """The evaluation prompts' data rows: the first ``eval.prompts`` rows of ``eval.data``,
    in order (at most one pass over a data file), the generator seeded with
    :func:`eval_seed`."""
    from ppokit.data import make_prompt_source

    settings = spec.eval
    if settings is None:
        raise UserError("the spec has no eval section")
    source = make_prompt_source(in_order(_eval_data(settings, spec)), eval_seed(spec.seed))
    size = getattr(source, "size", None)
    count = settings.prompts if size is None else min(settings.prompts, int(size))
    return source.next_rows(count)


@contextmanager
def isolated_rng(seed: int, device: torch.device | str) -> Iterator[None]:
    """Run the body with torch's RNG (CPU and the run's accelerator) seeded with ``seed``,
    then put every RNG state back, python's and numpy's too."""
    import numpy as np

    devices: list[int] = []
    device_type = getattr(device, "type", str(device))
    if device_type != "cpu":
        backend = getattr(torch, device_type, None)
        count = getattr(backend, "device_count", None)
        devices = list(range(count())) if callable(count) else []
    python_state, numpy_state = random.getstate(), np.random.get_state()
    kwargs = {"device_type": device_type} if device_type not in ("cpu", "cuda") else {}
    with torch.random.fork_rng(devices=devices, **kwargs):
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


class Evaluator:
    """The held-out evaluation of ``spec.eval``: responses from ``sampler`` (the run's
    engine, and its environment), scored by ``scorer``.

    The prompts are read and formatted once, here; :meth:`run` evaluates the policy the
    engine samples from now. ``seconds`` is the duration of the last :meth:`run`.
    """

    def __init__(self, spec: Spec, sampler: Sampler, scorer: Scorer) -> None:
        from ppokit.trainer.prompts import format_prompts

        if spec.eval is None:
            raise UserError("the spec has no eval section")
        self.spec = spec
        self.settings = spec.eval
        self.data = _eval_data(spec.eval, spec)
        self.sampler = sampler
        self.scorer = scorer
        self.seed = eval_seed(spec.seed)
        self.rows = eval_rows(spec)
        self.formatted = format_prompts(self.rows, scorer.tokenizer, self.data)
        self.max_new_tokens = self.settings.max_new_tokens or spec.rollout.max_new_tokens
        self.seconds = 0.0

    @classmethod
    def of(cls, spec: Spec, setup: Setup) -> Evaluator:
        """The evaluation of a training run's ``setup`` (its sampler and scorer)."""
        return cls(spec, setup.sampler, setup.scorer)

    # ------------------------------------------------------------------ generation
    def _generate(
        self, rows: list[dict[str, Any]], prompts: list[str], n: int, greedy: bool, seed: int
    ) -> Rollout:
        sampling = Sampling(
            n=n,
            max_new_tokens=self.max_new_tokens,
            temperature=self.settings.temperature,
            top_p=self.settings.top_p,
            greedy=greedy,
            seed=seed,
        )
        return self.sampler(rows, prompts, self.data, sampling)

    def _batch(
        self, rows: list[dict[str, Any]], prompts: list[str], seed: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(greedy rewards [b], sampled rewards [b, n], sampled lengths [b, n])."""
        n = self.settings.samples
        greedy = self.scorer.rollout(rows, self._generate(rows, prompts, 1, True, seed))[0].total
        sampled = self._generate(rows, prompts, n, False, seed)
        scores = self.scorer.rollout(rows, sampled)[0].total.float().view(len(rows), n)
        lengths = sampled.response_mask.float().sum(1).view(len(rows), n)
        return greedy.float(), scores, lengths

    # ------------------------------------------------------------------ metrics
    def run(self) -> dict[str, float | None]:
        """Evaluate the engine's policy: the ``eval/...`` metrics (None for a non-finite
        mean)."""
        start = time.perf_counter()
        size = self.settings.batch_size
        rows, formatted = self.rows, self.formatted
        world = distributed.world()
        if world.distributed:  # equal contiguous shares (the last padded with its last prompt)
            each = -(-len(rows) // world.size)
            pad = each * world.size - len(rows)
            share = slice(world.rank * each, (world.rank + 1) * each)
            rows = (rows + rows[-1:] * pad)[share]
            formatted = (formatted + formatted[-1:] * pad)[share]
        parts = []
        seed = self.seed ^ world.rank
        with isolated_rng(seed, self.scorer.device), torch.no_grad():
            for i in range(0, len(rows), size):
                batch_seed = (seed + i) % 2**63
                parts.append(self._batch(rows[i : i + size], formatted[i : i + size], batch_seed))
        greedy = torch.cat([p[0] for p in parts])
        sampled = torch.cat([p[1] for p in parts])
        lengths = torch.cat([p[2] for p in parts])
        if world.distributed:  # every process's prompts, in order, without the padding
            n = len(self.rows)
            greedy = distributed.gather_rows(greedy)[:n]
            sampled = distributed.gather_rows(sampled)[:n]
            lengths = distributed.gather_rows(lengths)[:n]
        metrics = self.metrics(greedy, sampled, lengths)
        self.seconds = time.perf_counter() - start
        return metrics

    def metrics(
        self, greedy: torch.Tensor, sampled: torch.Tensor, lengths: torch.Tensor
    ) -> dict[str, float | None]:
        """The metrics of greedy rewards ``[P]``, sampled rewards ``[P, n]`` and sampled
        lengths ``[P, n]`` (one host read); pass@k for each k of ``eval.k`` (at most n)."""
        threshold = self.settings.correct_at
        prompts, n = sampled.shape
        packed = torch.cat(
            [
                (greedy >= threshold).float(),
                (sampled >= threshold).sum(1).float(),
                sampled.mean().reshape(1),
                lengths.mean().reshape(1),
            ]
        ).tolist()
        correct = [int(x) for x in packed[:prompts]]
        counts = [int(x) for x in packed[prompts : 2 * prompts]]
        reward_mean, length_mean = packed[-2], packed[-1]
        solved = sum(correct)
        return {
            "eval/accuracy": solved / prompts,
            "eval/accuracy_ci95": wilson_half_width(solved, prompts),
            **{
                f"eval/pass@{k}": math.fsum(pass_at_k(n, c, k) for c in counts) / prompts
                for k in self.settings.ks
                if k <= n
            },
            "eval/reward_mean": reward_mean if math.isfinite(reward_mean) else None,
            "eval/response_length_mean": length_mean,
            "eval/prompts": float(prompts),
        }
