"""The two objects a run's rounds work on: :class:`Setup`, what a spec assembles once (the
spec, its components, the models, their forward passes, the scorer, the sampler and the
started rollout engine), and :class:`State`, what the rounds change (the optimizers and
their schedules, β of the KL term, the non-finite guard, the round number). A checkpoint
holds the models' weights and the state."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ppokit import distributed
from ppokit.spec import Spec
from ppokit.trainer.assembly import Assembly, CheckedEngine
from ppokit.trainer.checks import Guard
from ppokit.trainer.episodes import Sampler
from ppokit.trainer.flops import Passes, phase_peaks
from ppokit.trainer.forwards import Forwards
from ppokit.trainer.models import Models
from ppokit.trainer.objective import Objective
from ppokit.trainer.optim import Optimizers
from ppokit.trainer.report import Reporter, Silent
from ppokit.trainer.rollout import PromptEncoder, Rollout, engine_context, sampling
from ppokit.trainer.scoring import Scorer

__all__ = ["Setup", "State", "generation_progress"]

#: Who hears the engine's decoding steps in this context instead of the setup's reporter.
_PROGRESS: ContextVar[Callable[[int, int, int], None] | None] = ContextVar(
    "ppokit_generation_progress", default=None
)


@contextmanager
def generation_progress(listen: Callable[[int, int, int], None]) -> Iterator[None]:
    """The engine's decoding steps in this thread go to ``listen`` (step, steps, rows), not
    to the setup's reporter, until the block ends (a generation beside the rounds)."""
    token = _PROGRESS.set(listen)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


@dataclass
class Setup:
    """What a spec assembles once for a run (:meth:`start`); ``reporter`` hears the
    round's phases and the engine's decoding steps (a live display; replace it at will)."""

    spec: Spec
    assembly: Assembly
    models: Models
    forwards: Forwards
    objective: Objective
    scorer: Scorer
    encode: PromptEncoder
    sampler: Sampler
    #: log π_old from a forward pass (``rollout.logp_old``), else the engine's log μ
    recompute_logp_old: bool
    reporter: Reporter = field(default_factory=Silent)

    @classmethod
    def start(
        cls, spec: Spec, models: Models, assembly: Assembly, reporter: Reporter | None = None
    ) -> Setup:
        """The run's parts, with its rollout engine started (:meth:`close` ends it)."""
        device = models.runtime.device
        t = spec.train
        tokens = t.micro_batch_tokens is not None
        forwards = Forwards(models, spec.rollout.temperature, tokens, t.pack_sequences)
        forwards.check_packing()
        encode = PromptEncoder(models.tokenizer, models.actor, device)
        engine = assembly.engine
        mode = spec.rollout.logp_old
        asynchronous = spec.rollout.max_staleness > 0  # π_old is not the sampling weights
        # top-k/top-p: μ is the truncated distribution the engine sampled from, not π_old,
        # whose ratio π_θ/π_old must start at 1
        truncates = spec.rollout.top_k > 0 or spec.rollout.top_p < 1.0
        setup = cls(
            spec=spec,
            assembly=assembly,
            models=models,
            forwards=forwards,
            objective=Objective(spec, assembly, forwards),
            scorer=Scorer(assembly, models.tokenizer, device),
            encode=encode,
            sampler=Sampler(engine, assembly.environment, encode, models.tokenizer, spec.rollout),
            recompute_logp_old=mode == "forward"
            or (mode == "auto" and (asynchronous or truncates or not engine.samples_from_policy)),
            reporter=reporter if reporter is not None else Silent(),
        )
        world = distributed.world()

        def progress(*step: int) -> None:  # late-bound: the reporter may be replaced
            (_PROGRESS.get() or setup.reporter.generation)(*step)

        engine.start(
            engine_context(models, spec.model, world.rank, world.size, progress, asynchronous)
        )
        return setup

    @property
    def device(self) -> torch.device:
        return self.models.runtime.device

    @functools.cached_property
    def passes(self) -> Passes:
        """The shapes of the passes a round runs, for their model FLOPs."""
        return Passes.of(self.models, self.recompute_logp_old)

    @functools.cached_property
    def peaks(self) -> dict[str, float]:
        """Each phase's peak FLOP/s on this device (:func:`~ppokit.trainer.flops.phase_peaks`),
        measured at the first round's record (once per machine: it is cached)."""
        return phase_peaks(self.spec, self.models)

    @property
    def engine(self) -> CheckedEngine:
        return self.assembly.engine

    def sample(
        self,
        round_no: int,
        prompts: list[str],
        n: int,
        batch: int = 0,
        rows: list[dict[str, Any]] | None = None,
        *,
        version: int | None = None,
        sampler: Sampler | None = None,
        **changes: Any,
    ) -> Rollout:
        """``n`` responses per prompt (episodes with an environment, which reads the
        prompts' data ``rows``) under the spec's sampling settings (``changes``: e.g.
        ``greedy=True``), with the seed of (seed, process, ``round_no``) and, for the
        round's generation batch number ``batch`` > 0, that seed xor ``batch``. Each row
        records ``version``, the version of the weights that generate it (default
        ``round_no - 1``: the updates of the rounds before); ``sampler``: another than the
        setup's (a thread's own, with its own tokenizer)."""
        seed = distributed.round_seed(self.spec.seed, distributed.world().rank, round_no)
        asked = sampling(self.spec.rollout, n, seed ^ batch, **changes)
        ro = (sampler or self.sampler)(rows, prompts, self.spec.data, asked)
        ro.version = torch.full(
            ro.response_mask.shape[:1],
            round_no - 1 if version is None else version,
            dtype=torch.long,
            device=ro.response_mask.device,
        )
        return ro

    def close(self) -> None:
        """The end of the run: the engine closes, the components' worker processes end."""
        try:
            self.engine.close()
        finally:
            self.scorer.close()
            self.assembly.close()


@dataclass
class State:
    """What the rounds change: the optimizers with their schedules, β of the KL term (a
    0-d tensor on the device, adapted by a KL target), the non-finite guard and the number
    of the round being run (1-based; 0 before the first)."""

    optimizers: Optimizers
    kl_coef: Tensor
    guard: Guard
    round: int = 0

    @classmethod
    def create(cls, spec: Spec, models: Models) -> State:
        """The state of a run before its first round."""
        coef = spec.kl.coef if spec.kl is not None else 0.0
        device = models.runtime.device
        return cls(
            optimizers=Optimizers.create(spec, models),
            kl_coef=torch.tensor(coef, dtype=torch.float32, device=device),
            guard=Guard(spec.train.on_nonfinite, spec.train.max_skipped_steps),
        )
