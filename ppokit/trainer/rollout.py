"""Sampling responses with ``model.generate`` (KV cache, left padding) and recording their
log-probabilities under the sampling distribution as they are drawn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LogProbRecorder", "Rollout", "eos_ids", "filter_logits", "generate", "response_mask"]


def filter_logits(scaled: Tensor, top_k: int, top_p: float) -> Tensor:
    """Top-k (0 = off) then nucleus (top-p = 1 = off) filtering: removed logits become -inf."""
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly above each token
        remove_sorted = before > top_p
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        scaled = scaled.masked_fill(remove, float("-inf"))
    return scaled


class LogProbRecorder:
    """A logits processor that samples from softmax(logits / temperature) after top-k/top-p
    filtering, and records log π(a_t) = log_softmax(logits / temperature)[a_t] of each sampled
    token: it keeps the previous step's log-softmax and gathers the token that step drew
    (the last column of ``input_ids``) when the next step begins, so nothing is recomputed.
    """

    def __init__(self, temperature: float, top_k: int, top_p: float) -> None:
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.prev: Tensor | None = None
        self.steps: list[Tensor] = []

    def _take_previous(self, input_ids: Tensor) -> None:
        if self.prev is not None:
            self.steps.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
            self.prev = None

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        self._take_previous(input_ids)
        scaled = scores.float() / self.temperature
        self.prev = F.log_softmax(scaled, dim=-1)
        return filter_logits(scaled, self.top_k, self.top_p)

    def finish(self, sequences: Tensor, width: int) -> Tensor:
        """``[B, width]`` log-probs of the sampled tokens (the last one gathered here)."""
        self._take_previous(sequences)
        out = (
            torch.stack(self.steps, 1) if self.steps else sequences.new_zeros(sequences.shape[0], 0)
        )
        self.steps = []
        return out.float()[:, :width]


def eos_ids(tokenizer: Any, model: nn.Module) -> list[int]:
    """The token ids that end a response (tokenizer EOS plus the model's configured ones)."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        ids.update(configured)
    return sorted(i for i in ids if i is not None)


def response_mask(response_ids: Tensor, eos: Tensor) -> tuple[Tensor, Tensor]:
    """(mask True up to and including the first EOS, truncated = no EOS) for ``[B, T]`` ids."""
    is_eos = torch.isin(response_ids, eos)
    before = is_eos.long().cumsum(1) - is_eos.long()
    mask = before == 0
    return mask, ~is_eos.any(1)


@dataclass
class Rollout:
    """Prompts and sampled responses, all on the run's device."""

    prompt_ids: Tensor  # [B, P] left-padded
    prompt_mask: Tensor  # [B, P] long
    response_ids: Tensor  # [B, T]
    response_mask: Tensor  # [B, T] bool
    truncated: Tensor  # [B] bool
    logp_old: Tensor | None  # [B, T] float32 (0 where masked)

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.shape[1]

    def inputs(self) -> tuple[Tensor, Tensor]:
        """(input_ids, attention_mask) of prompt + response, ``[B, P+T]``."""
        ids = torch.cat([self.prompt_ids, self.response_ids], 1)
        attn = torch.cat([self.prompt_mask, self.response_mask.long()], 1)
        return ids, attn

    def rows(self, index: Tensor) -> Rollout:
        return Rollout(
            self.prompt_ids[index],
            self.prompt_mask[index],
            self.response_ids[index],
            self.response_mask[index],
            self.truncated[index],
            None if self.logp_old is None else self.logp_old[index],
        )


def generate(
    model: nn.Module,
    tokenizer: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
) -> Rollout:
    """Sample (or greedily decode) one response per prompt row; stop at EOS. A model
    sharded over several processes decodes in step with the others (as many steps as the
    longest: each takes part in the others' forwards)."""
    from transformers import GenerationConfig, LogitsProcessorList

    eos = eos_ids(tokenizer, model)
    config = GenerationConfig(
        do_sample=not greedy,
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
        use_cache=True,
    )
    recorder = None if greedy else LogProbRecorder(temperature, top_k, top_p)
    processors = LogitsProcessorList([] if recorder is None else [recorder])
    was_training = model.training
    model.eval()

    from ppokit.distributed import as_forward, gathered, sharded

    def run() -> Tensor:
        return model.generate(  # type: ignore[operator]
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            generation_config=config,
            logits_processor=processors,
            synced_gpus=sharded(model),
        )

    # peft's generate calls the wrapped model's forward, not its own: under FSDP2 it runs as
    # the sharded model's forward, which gathers the parameters it owns
    with torch.no_grad(), gathered(model):
        sequences = as_forward(model, run) if hasattr(model, "peft_config") else run()
    model.train(was_training)
    response_ids = sequences[:, prompt_ids.shape[1] :]
    mask, truncated = response_mask(response_ids, torch.tensor(eos, device=response_ids.device))
    logp = None
    if recorder is not None:
        logp = recorder.finish(sequences, response_ids.shape[1]) * mask
    return Rollout(prompt_ids, prompt_mask, response_ids, mask, truncated, logp)
