"""The ``hf`` rollout engine: the actor's own ``model.generate`` (KV cache, left padding),
recording the log-probability of each sampled token as it is drawn.

Unlike the other kinds' tensor modules this one imports ``transformers`` and
:mod:`ppokit.distributed`: a sharded actor generates under FSDP2 (gathered once a rollout,
``parallel.gather_for_generation``), and peft's generate runs as the sharded model's forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppokit.components.rollout_engine import HF, EngineContext, Generation, Sampling

__all__ = ["HFEngine", "LogProbRecorder", "filter_logits", "generate"]


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


class _Steps:
    """A stopping criterion that stops nothing: it reports each decoding step to
    ``progress(step, steps, rows)`` (:class:`EngineContext`'s ``progress``); a host-side
    count of the sequence length, no tensor read."""

    def __init__(self, progress: Callable[[int, int, int], None], start: int, steps: int) -> None:
        self.progress = progress
        self.start = start
        self.steps = steps

    def __call__(self, input_ids: Tensor, scores: Any, **kwargs: Any) -> Tensor:
        rows = input_ids.shape[0]
        self.progress(input_ids.shape[1] - self.start, self.steps, rows)
        return torch.zeros(rows, dtype=torch.bool, device=input_ids.device)


def generate(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    sampling: Sampling,
    eos_ids: Sequence[int],
    pad_id: int,
    progress: Callable[[int, int, int], None] | None = None,
) -> Generation:
    """``sampling.n`` responses per prompt row from ``model.generate``; stop at EOS. A model
    sharded over several processes decodes in step with the others (as many steps as the
    longest: each takes part in the others' forwards). ``progress(step, steps, rows)`` is
    called before the first step (step 0) and after each decoding step."""
    from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

    from ppokit.distributed import as_forward, gathered, sharded

    if sampling.n > 1:
        prompt_ids = prompt_ids.repeat_interleave(sampling.n, 0)
        prompt_mask = prompt_mask.repeat_interleave(sampling.n, 0)
    config = GenerationConfig(
        do_sample=not sampling.greedy,
        max_new_tokens=sampling.max_new_tokens,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=pad_id,
        eos_token_id=list(eos_ids),
        use_cache=True,
    )
    recorder = (
        None
        if sampling.greedy
        else LogProbRecorder(sampling.temperature, sampling.top_k, sampling.top_p)
    )
    processors = LogitsProcessorList([] if recorder is None else [recorder])
    steps = None
    if progress is not None:  # step 0: the prompts' forward pass begins
        progress(0, sampling.max_new_tokens, prompt_ids.shape[0])
        steps = StoppingCriteriaList(
            [_Steps(progress, prompt_ids.shape[1], sampling.max_new_tokens)]
        )
    was_training = model.training
    model.eval()

    def run() -> Tensor:
        return model.generate(  # type: ignore[operator]
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            generation_config=config,
            logits_processor=processors,
            stopping_criteria=steps,
            synced_gpus=sharded(model),
        )

    # peft's generate calls the wrapped model's forward, not its own: under FSDP2 it runs as
    # the sharded model's forward, which gathers the parameters it owns
    with torch.no_grad(), gathered(model):
        sequences = as_forward(model, run) if hasattr(model, "peft_config") else run()
    model.train(was_training)
    response_ids = sequences[:, prompt_ids.shape[1] :]
    logp = None if recorder is None else recorder.finish(sequences, response_ids.shape[1])
    return Generation.from_sequences(response_ids, logp, eos_ids)


@HF.implementation
class HFEngine:
    """It samples from the trainer's actor module itself, so ``sync`` has nothing to do, and
    with ``dtype: auto`` its log-probs are π_old's (``samples_from_policy``)."""

    def __init__(self, *, dtype: str) -> None:
        self.dtype = dtype
        self.context: EngineContext | None = None

    @property
    def samples_from_policy(self) -> bool:
        return self.dtype == "auto"

    def _autocast(self, context: EngineContext) -> AbstractContextManager[Any]:
        if self.dtype == "auto":
            return context.autocast()
        device = torch.device(context.device).type
        return torch.autocast(device, dtype=getattr(torch, self.dtype))

    def start(self, context: EngineContext) -> None:
        self.context = context

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: Sampling) -> Generation:
        context = self.context
        if context is None:
            raise RuntimeError("the hf engine was not started")
        with torch.no_grad(), self._autocast(context):
            return generate(
                context.model,
                prompt_ids,
                prompt_mask,
                sampling,
                context.eos_ids,
                context.pad_id,
                context.progress,
            )

    def sync(self) -> None:
        """Nothing: the actor samples with the weights the update just changed."""

    def close(self) -> None:
        self.context = None
