"""The spec's sections that name no component: where a run writes (``output``), how
several processes share the models (``parallel``) and the signs of an unhealthy run
(``health``). Nothing here imports torch."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["HealthSpec", "OutputSpec", "ParallelSpec", "Strict"]


class Strict(BaseModel):
    """A spec section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class OutputSpec(Strict):
    dir: str = Field("runs/ppokit", description="where metrics, samples and checkpoints go")
    save_every: int = Field(10, ge=1, le=1 << 30, description="checkpoint every N rounds")
    sample_every: int = Field(
        5, ge=1, le=1 << 30, description="write sample completions every N rounds"
    )
    overwrite: bool = Field(False, description="replace a non-empty output directory")
    progress: bool = Field(True, description="show a live progress display")
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list,
        description="experiment trackers that receive every metric, the spec, samples and "
        "curves (metrics.jsonl is always written)",
    )


class ParallelSpec(Strict):
    """How a run on several processes (``torchrun``, ``ppokit train --nproc``) shares the
    models: FSDP2 over all processes. One process ignores it."""

    shard: bool = Field(
        True,
        description="shard parameters, gradients and optimizer state over the processes "
        "(FSDP2); false: every process holds them all (data parallel)",
    )
    reshard_after_forward: bool = Field(
        True, description="free the gathered parameters after each forward (less memory)"
    )
    gather_for_generation: bool = Field(
        True,
        description="keep the actor's whole parameters on every process while it generates "
        "(one gather a rollout, not one per block and token); false: a sharded forward's "
        "memory, for an actor too large for one device",
    )
    cpu_offload: bool = Field(
        False, description="keep the sharded parameters and optimizer state in CPU memory (GPUs)"
    )
    mixed_precision: Literal["bf16", "none"] = Field(
        "bf16",
        description="on GPUs: bf16 parameters in forward and backward, fp32 gradient "
        "reduction ('none': the model's dtype)",
    )
    timeout_s: float = Field(
        600.0,
        gt=0,
        le=1e6,
        description="seconds a process waits for the others before the run fails",
    )


class HealthSpec(Strict):
    """The signs of an unhealthy run (docs/health.md): each compares one metric of a round
    with its threshold, and fires once its condition has held for ``rounds`` rounds in a
    row. A sign's threshold set to null turns it off."""

    enabled: bool = Field(True, description="evaluate the signs each round (false: none)")
    rounds: int = Field(
        5,
        ge=1,
        le=1 << 20,
        description="consecutive rounds a sign's condition must hold before the sign fires",
    )
    zero_variance: float | None = Field(
        0.9,
        ge=0,
        le=1,
        description="fires when more than this fraction of the round's groups have rewards "
        "all equal (rollout/zero_variance_groups, reported when a component reads the groups)",
    )
    constant_reward: float | None = Field(
        1e-6,
        ge=0,
        le=1e9,
        description="fires when the standard deviation of the round's rewards (reward_std) "
        "is below this",
    )
    entropy: float | None = Field(
        0.001,
        ge=0,
        le=1e3,
        description="fires when the policy's entropy (entropy, nats per token) is below this",
    )
    clipfrac: float | None = Field(
        0.2,
        ge=0,
        le=1,
        description="fires when the fraction of clipped tokens (clipfrac) is above this",
    )
    approx_kl: float | None = Field(
        0.1,
        ge=0,
        le=1e3,
        description="fires when KL(π_old ‖ π) per token over the round's optimizer steps "
        "(approx_kl) is above this",
    )
    grad_spike: float | None = Field(
        10.0,
        gt=1,
        le=1e9,
        description="fires when the actor's gradient norm (grad_norm_actor) is above this "
        "multiple of its median over the health.grad_window rounds before",
    )
    grad_window: int = Field(
        10,
        ge=1,
        le=1 << 20,
        description="rounds of gradient norms the median of health.grad_spike is taken over "
        "(the sign is evaluated once that many rounds have one), and at most as many of "
        "rollout/mismatch_k3 the median of health.stale_push is taken over",
    )
    mismatch: float | None = Field(
        0.01,
        ge=0,
        le=1e3,
        description="fires when KL(μ ‖ π_old) per token between the engine's and the "
        "trainer's log-probs (rollout/mismatch_k3) is above this",
    )
    stale_push: float | None = Field(
        1e-3,
        ge=0,
        le=1e3,
        description="fires on a round whose rollout/mismatch_k3 is above its median over "
        "the health.grad_window rounds before by more than this (per token): the engine "
        "sampled from weights older than the last push's",
    )
    truncated: float | None = Field(
        0.9,
        ge=0,
        le=1,
        description="fires when more than this fraction of the responses were cut by a "
        "length limit (truncated_frac)",
    )
    flat_reward: float | None = Field(
        2.0,
        gt=0,
        le=1e3,
        description="from a quarter of train.rounds (and round 6) on, fires when the slope "
        "of reward_mean over the rounds so far is within this many standard errors of 0: "
        "the reward has not moved; its warning names the likely causes the records show",
    )
