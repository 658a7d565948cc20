"""Sampling responses: one model turn per prompt, or multi-turn episodes with an environment
(``rollout.environment``, :mod:`ppokit.environments`).

:class:`Sampler` is what the round and the evaluation call: prompts in, a
:class:`~ppokit.trainer.rollout.Rollout` out. Without an environment (``none``) it encodes the
prompts and asks the engine once. With one, each response is an episode played turn by turn:

1. every episode gets its own copy of its data row; ``reset(row)``'s text follows the prompt;
2. the engine answers every running episode at once (a context of prompt + transcript so
   far, left-padded; at most ``max_new_tokens`` tokens and what the episode's budget leaves);
3. the turns are decoded (one host read a turn) and ``step(row, text, turn)`` answers each;
4. the turn reward goes on the turn's last token; the observation's tokens (the chat
   template's user or tool message when the data uses one) follow it, marked as the
   environment's; an episode ends when the environment says ``done``, after ``max_turns``
   turns, or when its next observation and one more token would not fit the budget.

The transcripts grow as right-padded tensors on the device, appended to by scatter: no loop
over rows or positions in tensor code; the loops are over turns and, for the environment's
Python calls and the tokenizer, over episodes' texts.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ppokit import distributed
from ppokit.components.rollout_engine import Sampling
from ppokit.environments import ENDS
from ppokit.errors import UserError
from ppokit.spec import DataSpec, RolloutSpec
from ppokit.trainer.assembly import CheckedEngine, CheckedEnvironment
from ppokit.trainer.prompts import TextBounds, chat_text, encodable
from ppokit.trainer.rollout import PromptEncoder, Rollout, decode_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Limits", "ObservationFormat", "Sampler", "Transcript", "episode_metrics"]

_DONE, _MAX_TURNS, _BUDGET = (ENDS.index(e) for e in ("done", "max_turns", "budget"))
#: What sets an episode's budget, for messages.
_BUDGET_SETTINGS = (
    "the episode's budget (rollout.max_episode_tokens, or max_turns, max_new_tokens and "
    "max_observation_tokens)"
)
#: Placeholders for the chat template's rendering of a message (private-use characters).
_CONTENT, _ANSWER = "\ue000", "\ue001"


@dataclass(frozen=True)
class Limits:
    """How long an episode may run: turns, tokens a turn, tokens of one observation's
    text, and the budget of response tokens (the model's and the environment's)."""

    max_turns: int
    max_new_tokens: int
    max_observation_tokens: int
    budget: int

    @classmethod
    def of(cls, rollout: RolloutSpec, max_new_tokens: int, markup: int) -> Limits:
        """The limits of a spec's ``rollout`` section for turns of ``max_new_tokens`` and
        observations wrapped in ``markup`` tokens of chat template; the default budget is
        ``max_turns`` full turns and the observations between them."""
        budget = rollout.episode_budget(max_new_tokens, markup)
        return cls(rollout.max_turns, max_new_tokens, rollout.max_observation_tokens, budget)


class ObservationFormat:
    """An observation's text to token ids after a model turn.

    Without a chat template the text is tokenized as it is. With one (``data.chat_template``),
    it is written as a ``role`` message: the template's rendering of an assistant message
    followed by that message tells what closes the model's turn (after its EOS, e.g. a
    newline; all of it when the turn was cut before EOS) and what surrounds the content
    (``<|im_start|>user\\n`` ... ``<|im_end|>\\n<|im_start|>assistant\\n``). The content is
    cut to ``max_tokens`` tokens (by characters first, :class:`TextBounds`: a megabyte of
    tool output is never tokenized whole; what UTF-8 cannot encode is replaced); the markup
    never is.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, chat: bool, role: str, max_tokens: int
    ) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.bounds = TextBounds(tokenizer)
        self.after_eos: list[int] = []
        self.after_cut: list[int] = []
        self.before: list[int] = []
        self.after: list[int] = []
        if chat:
            self._chat(role)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _chat(self, role: str) -> None:
        tok = self.tokenizer
        answer = [{"role": "assistant", "content": _ANSWER}]
        try:
            base = chat_text(tok, answer, False)
            full = chat_text(tok, [*answer, {"role": role, "content": _CONTENT}], True)
        except Exception as exc:
            raise UserError(
                f"rollout.observation_role: the chat template cannot write a {role!r} message "
                f"after an assistant message ({str(exc).splitlines()[0] if str(exc) else exc!r})"
            ) from None
        if not full.startswith(base) or _ANSWER not in base or _CONTENT not in full:
            raise UserError(
                "data.chat_template: the tokenizer's chat template does not render an "
                "observation as a message appended to the conversation; set "
                "data.chat_template: false and format observations in the environment"
            )
        closing = base[base.rindex(_ANSWER) + 1 :]
        before, after = full[len(base) :].split(_CONTENT, 1)
        eos = tok.eos_token or ""
        self.after_cut = self._ids(closing)
        self.after_eos = self._ids(
            closing[len(eos) :] if eos and closing.startswith(eos) else closing
        )
        self.before, self.after = self._ids(before), self._ids(after)

    @property
    def markup(self) -> int:
        """The most tokens the template adds around one observation's content."""
        return max(len(self.after_cut), len(self.after_eos)) + len(self.before) + len(self.after)

    def __call__(self, texts: list[str], cut: list[bool]) -> list[list[int]]:
        """Token ids of each observation, after a turn that ended with EOS (``cut`` False)
        or was cut by a length limit."""
        texts = [self.bounds.head(t, self.max_tokens) for t in texts]
        contents = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [
            [
                *(self.after_cut if c else self.after_eos),
                *self.before,
                *ids[: self.max_tokens],
                *self.after,
            ]
            for ids, c in zip(contents, cut, strict=True)
        ]


class Transcript:
    """The episodes' responses as they grow: right-padded ``[B, W]`` tensors on ``device``
    (token ids, the model's and the environment's masks, log μ, turn rewards) and each
    episode's length, on the device and on the host."""

    def __init__(self, rows: int, pad_id: int, device: torch.device, with_logp: bool) -> None:
        self.pad_id = pad_id
        self.device = device
        self.ids = torch.full((rows, 0), pad_id, dtype=torch.long, device=device)
        self.model = torch.zeros((rows, 0), dtype=torch.bool, device=device)
        self.env = torch.zeros((rows, 0), dtype=torch.bool, device=device)
        self.logp = torch.zeros((rows, 0), device=device) if with_logp else None
        self.rewards = torch.zeros((rows, 0), device=device)
        self.length = torch.zeros(rows, dtype=torch.long, device=device)
        self.lengths = [0] * rows

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    def _grow(self, width: int) -> None:
        room = width - self.width
        if room <= 0:
            return

        def grow(x: Tensor, value: float) -> Tensor:
            return torch.cat([x, x.new_full((x.shape[0], room), value)], 1)

        self.ids = grow(self.ids, self.pad_id)
        self.model = grow(self.model, False)
        self.env = grow(self.env, False)
        self.logp = None if self.logp is None else grow(self.logp, 0.0)
        self.rewards = grow(self.rewards, 0.0)

    def append(
        self,
        index: list[int],
        rows: Tensor,
        tokens: Tensor,
        keep: Tensor,
        counts: list[int],
        *,
        model: bool,
        logp: Tensor | None = None,
    ) -> None:
        """Append the kept prefix ``keep`` (bool ``[R, t]``, ``counts`` True each, on the
        host) of ``tokens`` to episodes ``index`` (``rows``: the same on the device), as the
        model's tokens (with their ``logp``) or the environment's."""
        if not counts:
            return
        new = [self.lengths[i] + c for i, c in zip(index, counts, strict=True)]
        width = max(self.width, max(new))
        self._grow(width + 1)  # the last column takes what is not kept
        t = tokens.shape[1]
        at = self.length[rows][:, None] + torch.arange(t, device=self.device)
        at = torch.where(keep, at, width)
        r = rows[:, None].expand_as(at)
        self.ids[r, at] = tokens
        (self.model if model else self.env)[r, at] = keep
        if self.logp is not None and logp is not None:
            self.logp[r, at] = torch.where(keep, logp.float(), 0.0)
        self.ids, self.model, self.env, self.rewards = (
            x[:, :width] for x in (self.ids, self.model, self.env, self.rewards)
        )
        if self.logp is not None:
            self.logp = self.logp[:, :width]
        self.length[rows] += keep.sum(1)
        for i, n in zip(index, new, strict=True):
            self.lengths[i] = n

    def reward_last(self, rows: Tensor, rewards: Tensor) -> None:
        """Add ``rewards`` [R] on the last token of episodes ``rows`` (their turn's end)."""
        self.rewards[rows, self.length[rows] - 1] += rewards

    def context(
        self, rows: Tensor, prompt_ids: Tensor, prompt_mask: Tensor, longest: int
    ) -> tuple[Tensor, Tensor]:
        """(ids, mask) of prompt + transcript of episodes ``rows``, left-padded to
        ``longest`` tokens (the longest of them): each row rolled right by its trailing
        padding."""
        ids = torch.cat([prompt_ids[rows], self.ids[rows]], 1)
        mask = torch.cat([prompt_mask[rows].bool(), (self.model | self.env)[rows]], 1)
        width = ids.shape[1]
        shift = width - (self.length[rows] + prompt_ids.shape[1])
        source = (torch.arange(width, device=self.device) - shift[:, None]) % width
        ids, mask = ids.gather(1, source), mask.gather(1, source)
        return ids[:, width - longest :], mask[:, width - longest :].long()


class Sampler:
    """Responses from ``engine`` for prompts encoded by ``encode``: one turn each, or with
    an ``environment`` that is not single-turn, episodes (module docstring) under the
    ``rollout`` section's limits."""

    def __init__(
        self,
        engine: CheckedEngine,
        environment: CheckedEnvironment | None,
        encode: PromptEncoder,
        tokenizer: PreTrainedTokenizerBase,
        rollout: RolloutSpec,
    ) -> None:
        self.engine = engine
        self.environment = environment
        self.encode = encode
        self.tokenizer = tokenizer
        self.rollout = rollout
        self.multi_turn = environment is not None and not environment.single_turn
        self._formats: dict[bool, ObservationFormat] = {}

    def format(self, chat: bool) -> ObservationFormat:
        """The observations' format for data with (or without) a chat template."""
        if chat not in self._formats:
            spec = self.rollout
            self._formats[chat] = ObservationFormat(
                self.tokenizer, chat, spec.observation_role, spec.max_observation_tokens
            )
        return self._formats[chat]

    def limits(self, data: DataSpec, max_new_tokens: int) -> Limits:
        return Limits.of(self.rollout, max_new_tokens, self.format(data.chat_template).markup)

    def __call__(
        self,
        rows: list[dict[str, Any]] | None,
        prompts: list[str],
        data: DataSpec,
        sampling: Sampling,
    ) -> Rollout:
        """``sampling.n`` responses for each prompt (``rows``: their data rows, which an
        environment reads), each prompt's together."""
        if not self.multi_turn:
            ids, attn = self.encode(prompts, data, sampling.max_new_tokens)
            out = self.engine.generate(ids, attn, sampling)
            return Rollout.of(ids, attn, sampling.n, out)
        if rows is None or len(rows) != len(prompts):
            raise ValueError("multi-turn sampling needs the data row of every prompt")
        return self.episodes(rows, prompts, data, sampling)

    def episodes(
        self, rows: list[dict[str, Any]], prompts: list[str], data: DataSpec, sampling: Sampling
    ) -> Rollout:
        """``sampling.n`` episodes for each prompt (module docstring)."""
        env, n = self.environment, sampling.n
        assert env is not None  # multi-turn: an environment answers
        limits = self.limits(data, sampling.max_new_tokens)
        fmt = self.format(data.chat_template)
        episodes = [copy.deepcopy(row) for row in rows for _ in range(n)]
        openings = env.resets(episodes)
        texts = [prompts[i // n] + encodable(opening or "") for i, opening in enumerate(openings)]
        prompt_ids, prompt_mask = self.encode(texts, data, limits.budget, _BUDGET_SETTINGS)
        device = prompt_ids.device
        b = len(episodes)
        script = Transcript(
            b, int(self.tokenizer.pad_token_id or 0), device, with_logp=not sampling.greedy
        )
        ended, turns, cut = [_MAX_TURNS] * b, [0] * b, [False] * b
        prompt_lengths = prompt_mask.sum(1).tolist()
        running = list(range(b))
        for turn in range(limits.max_turns):
            if not running:
                break
            at = torch.tensor(running, device=device)
            room = [limits.budget - script.lengths[i] for i in running]
            seed = None if sampling.seed is None else sampling.seed ^ (turn << 20)
            asked = dataclasses.replace(
                sampling, n=1, seed=seed, max_new_tokens=min(limits.max_new_tokens, max(room))
            )
            longest = max(prompt_lengths[i] + script.lengths[i] for i in running)
            context = script.context(at, prompt_ids, prompt_mask, longest)
            out = self.engine.generate(*context, asked)
            width = out.response_ids.shape[1]
            fits = torch.arange(width, device=device) < torch.tensor(room, device=device)[:, None]
            keep = out.response_mask & fits
            over = out.truncated | (keep != out.response_mask).any(1)
            said, counts, was_cut, _ = decode_rows(
                self.tokenizer, out.response_ids, keep, keep, over
            )
            script.append(running, at, out.response_ids, keep, counts, model=True, logp=out.logp)
            steps = env.steps([episodes[i] for i in running], said, turn)
            script.reward_last(at, torch.tensor([s.reward for s in steps], device=device))
            going: list[int] = []
            observed: list[tuple[int, str, bool]] = []
            for i, step, c in zip(running, steps, was_cut, strict=True):
                turns[i], cut[i] = turn + 1, c
                if step.done:
                    ended[i] = _DONE
                elif turn + 1 == limits.max_turns:
                    ended[i] = _MAX_TURNS
                elif step.observation is not None:
                    observed.append((i, step.observation, c))
                elif script.lengths[i] < limits.budget:
                    going.append(i)
                else:
                    ended[i] = _BUDGET
            fit: list[tuple[int, list[int]]] = []
            if observed:
                tokens = fmt([o for _, o, _ in observed], [c for *_, c in observed])
                for (i, _, _), ids in zip(observed, tokens, strict=True):
                    if script.lengths[i] + len(ids) + 1 > limits.budget:
                        ended[i] = _BUDGET
                    else:
                        fit.append((i, ids))
                        going.append(i)
            if fit:
                self._append_env(script, fit, device)
            running = sorted(going)
        ended_t = torch.tensor(ended, device=device)
        truncated = (ended_t != _DONE) | torch.tensor(cut, device=device)
        return Rollout(
            prompt_ids,
            prompt_mask,
            script.ids,
            script.model,
            truncated,
            script.logp,
            env_mask=script.env,
            turn_rewards=script.rewards,
            turns=torch.tensor(turns, device=device),
            ended=ended_t,
        )

    def _append_env(
        self, script: Transcript, fit: list[tuple[int, list[int]]], device: torch.device
    ) -> None:
        """The observations' tokens after their episodes' turns."""
        from torch.nn.utils.rnn import pad_sequence

        counts = [len(ids) for _, ids in fit]
        tokens = pad_sequence(
            [torch.tensor(ids, dtype=torch.long) for _, ids in fit],
            batch_first=True,
            padding_value=script.pad_id,
        ).to(device)
        keep = (
            torch.arange(tokens.shape[1], device=device)
            < torch.tensor(counts, device=device)[:, None]
        )
        index = [i for i, _ in fit]
        rows = torch.tensor(index, device=device)
        script.append(index, rows, tokens, keep, counts, model=False)


def episode_metrics(ro: Rollout) -> dict[str, Tensor]:
    """``rollout/turns_mean``, ``rollout/env_tokens_mean`` and the share of episodes that
    ended each way (``rollout/ended_done``, ``_max_turns``, ``_budget``), over the whole
    round's episodes (gathered on several processes); empty for a single-turn rollout."""
    if ro.turns is None or ro.ended is None or ro.env_mask is None:
        return {}
    turns, env_tokens, ended = ro.turns, ro.env_mask.sum(1), ro.ended
    if distributed.world().distributed:
        turns, env_tokens, ended = (distributed.gather_rows(x) for x in (turns, env_tokens, ended))
    out = {
        "rollout/turns_mean": turns.float().mean(),
        "rollout/env_tokens_mean": env_tokens.float().mean(),
    }
    for code, end in enumerate(ENDS):
        out[f"rollout/ended_{end}"] = (ended == code).float().mean()
    return out
