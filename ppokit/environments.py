"""Multi-turn rollouts: the contract of an environment (``rollout.environment``).

An episode is one row of the round's batch. Its prompt is the data row's prompt as the data
formats it (with ``data.chat_template``: ending with the assistant's header), followed by the
text :meth:`Environment.reset` returns; then the model answers (a turn of at most
``rollout.max_new_tokens`` tokens), the environment replies (:meth:`Environment.step`: an
observation, a reward, whether the episode is done), the model answers again, and so on,
until the environment says ``done``, ``rollout.max_turns`` turns have been played or the
episode's token budget (``rollout.max_episode_tokens``) is spent.

The response is the model's tokens and the environment's tokens in order; only the model's
are trained: the environment's are outside the actor's loss mask, the critic's positions,
the KL and entropy terms, and recorded in the batch as ``env_mask`` (docs/design.md). A
turn's reward is placed on the last token of that model turn, where it happens; the spec's
rewards score the whole transcript and add their R on the episode's last token.

Each episode gets its own copy of its data row (a dict): the same object is passed to
``reset`` and every ``step`` of that episode, so an environment may keep an episode's state
in it under keys of its own. Both run under ``rollout.environment_timeout``.

This module is torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["ENDS", "Environment", "Step"]

#: How an episode ends, in the order of the metrics ``rollout/ended_<end>``: the environment
#: said ``done``; ``rollout.max_turns`` turns were played; the token budget was spent.
ENDS: tuple[str, ...] = ("done", "max_turns", "budget")


@dataclass(frozen=True)
class Step:
    """What the environment answers to one model turn."""

    #: text the environment adds before the model's next turn (None: nothing)
    observation: str | None
    #: this turn's reward, placed on the turn's last token
    reward: float = 0.0
    #: the episode ends here
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    """``reset(row)`` once per episode, then ``step(row, response, turn)`` after each model
    turn (``turn`` counts from 0; ``response`` is that turn's decoded text)."""

    def reset(self, row: dict[str, Any]) -> str | None: ...

    def step(self, row: dict[str, Any], response: str, turn: int) -> Step: ...
