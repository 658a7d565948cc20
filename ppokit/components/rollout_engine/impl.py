"""The ``hf`` rollout engine: the actor's own ``model.generate`` (KV cache, left padding),
recording the log-probability of each sampled token as it is drawn.

Unlike the other kinds' tensor modules this one imports ``transformers`` and
:mod:`ppokit.distributed`: a sharded actor generates under FSDP2 (gathered once a rollout,
``parallel.gather_for_generation``), and peft's generate runs as the sharded model's forward.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from inspect import signature
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppokit.components.rollout_engine import HF, EngineContext, Generation, Sampling

__all__ = ["HFEngine", "LogProbRecorder", "filter_logits", "frozen_copy", "generate"]


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
    filtering, and records log μ(a_t) = log_softmax(filter(logits / temperature))[a_t] of each
    sampled token, of the distribution it sampled from (the kept tokens renormalised: with
    top-k/top-p, log π_old minus log of the kept mass): it keeps the previous step's
    log-softmax and gathers the token that step drew (the last column of ``input_ids``) when
    the next step begins, so nothing is recomputed.

    With a ``generator`` it draws the token itself, from that generator, and leaves it the
    only finite logit (``model.generate`` then decodes greedily): torch's global generator
    is not touched.
    """

    def __init__(
        self,
        temperature: float,
        top_k: int,
        top_p: float,
        generator: torch.Generator | None = None,
    ) -> None:
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.generator = generator
        self.prev: Tensor | None = None
        self.steps: list[Tensor] = []

    def _take_previous(self, input_ids: Tensor) -> None:
        if self.prev is not None:
            self.steps.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
            self.prev = None

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        self._take_previous(input_ids)
        scaled = scores.float() / self.temperature
        kept = filter_logits(scaled, self.top_k, self.top_p)
        self.prev = F.log_softmax(kept, dim=-1)  # μ: the kept tokens' renormalised share
        if self.generator is None:
            return kept
        token = torch.multinomial(kept.softmax(-1), 1, generator=self.generator)
        return torch.full_like(kept, float("-inf")).scatter(-1, token, 0.0)

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
    own_generator: bool = False,
    drop_ended: bool = False,
) -> Generation:
    """``sampling.n`` responses per prompt row from ``model.generate``, or with
    ``drop_ended`` from :func:`decode`; stop at EOS. A model sharded over several processes
    decodes with ``model.generate``, in step with the others (as many steps as the longest:
    each takes part in the others' forwards). ``progress(step, steps, rows)`` is called before
    the first step (step 0) and after each decoding step. ``own_generator``: draw from a
    generator seeded with ``sampling.seed``, not from torch's global one."""
    from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

    from ppokit.distributed import as_forward, gathered, sharded

    if sampling.n > 1:
        prompt_ids = prompt_ids.repeat_interleave(sampling.n, 0)
        prompt_mask = prompt_mask.repeat_interleave(sampling.n, 0)
    generator = None
    if own_generator and not sampling.greedy:
        generator = torch.Generator(device=prompt_ids.device)
        if sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(sampling.seed)
    if progress is not None:  # step 0: the prompts' forward pass begins
        progress(0, sampling.max_new_tokens, prompt_ids.shape[0])
    was_training = model.training
    model.eval()
    if drop_ended and not sharded(model):
        with torch.no_grad():
            done = decode(
                model, prompt_ids, prompt_mask, sampling, eos_ids, pad_id, progress, generator
            )
        model.train(was_training)
        return done
    config = GenerationConfig(
        do_sample=not sampling.greedy and generator is None,
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
        else LogProbRecorder(sampling.temperature, sampling.top_k, sampling.top_p, generator)
    )
    processors = LogitsProcessorList([] if recorder is None else [recorder])
    steps = None
    if progress is not None:
        steps = StoppingCriteriaList(
            [_Steps(progress, prompt_ids.shape[1], sampling.max_new_tokens)]
        )

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


def draw(
    logits: Tensor, sampling: Sampling, generator: torch.Generator | None
) -> tuple[Tensor, Tensor | None]:
    """One token per row of ``[R, V]`` logits and its log μ: the argmax when greedy (no
    log-prob), else a draw from softmax(filter(z / temperature)) with
    log μ(a) = log_softmax(filter(z / temperature))[a], the distribution it was drawn from."""
    if sampling.greedy:
        return logits.argmax(-1), None
    scaled = logits.float() / sampling.temperature
    kept = filter_logits(scaled, sampling.top_k, sampling.top_p)
    token = torch.multinomial(kept.softmax(-1), 1, generator=generator)
    return token.squeeze(1), F.log_softmax(kept, -1).gather(-1, token).squeeze(1)


def decode(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    sampling: Sampling,
    eos_ids: Sequence[int],
    pad_id: int,
    progress: Callable[[int, int, int], None] | None = None,
    generator: torch.Generator | None = None,
) -> Generation:
    """Responses to ``[R, L]`` left-padded prompt rows (already repeated ``n`` times), decoded
    one token a step with a KV cache, where a row that has drawn an EOS leaves the batch: its
    cache rows are dropped, so each step's forward pass is over the rows still going only
    (``model.generate`` decodes every row until the longest ends). One host read a step (how
    many rows go on). Positions count each row's own tokens, as ``model.generate``'s do."""
    rows, steps = prompt_ids.shape[0], sampling.max_new_tokens
    device = prompt_ids.device
    eos = torch.tensor(list(eos_ids), device=device)
    tokens = torch.full((rows, steps), pad_id, dtype=torch.long, device=device)
    logp = None if sampling.greedy else torch.zeros(rows, steps, device=device)
    live = torch.arange(rows, device=device)  # the batch rows still decoding
    mask = prompt_mask.long()
    position = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
    last = {"logits_to_keep": 1} if "logits_to_keep" in signature(lm.forward).parameters else {}
    out = model(
        input_ids=prompt_ids, attention_mask=mask, position_ids=position, use_cache=True, **last
    )
    position = position[:, -1]
    width = 0
    for step in range(steps):
        token, token_logp = draw(out.logits[:, -1], sampling, generator)
        tokens[live, step] = token
        if logp is not None and token_logp is not None:
            logp[live, step] = token_logp
        width = step + 1
        going = ~torch.isin(token, eos)
        left = int(going.sum()) if step + 1 < steps else 0  # the step's one host read
        if progress is not None:
            progress(step + 1, steps, rows)
        if left == 0:
            break
        cache = out.past_key_values
        if left < live.shape[0]:
            keep = going.nonzero().squeeze(1)
            live, token, mask, position = live[keep], token[keep], mask[keep], position[keep]
            cache.batch_select_indices(keep)
        mask = torch.cat([mask, mask.new_ones(left, 1)], 1)
        position = position + 1
        out = model(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=position[:, None],
            past_key_values=cache,
            use_cache=True,
        )
    return Generation.from_sequences(
        tokens[:, :width], None if logp is None else logp[:, :width], eos_ids
    )


def frozen_copy(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of the actor to sample from while the trainer changes the actor: its trainable
    parameters copied, its frozen ones (LoRA's base weights) shared, nothing of it trained;
    a model sharded over several processes gathered whole into a plain module (a
    collective: every process makes its copy at the same point). With a ``dtype``, every
    weight copied and cast to it (none shared: the actor's stay as they are)."""
    from ppokit.distributed import sharded

    if sharded(model):
        plain = _gathered_copy(model)
    else:
        frozen = {} if dtype else {id(p): p for p in model.parameters() if not p.requires_grad}
        plain = copy.deepcopy(model, memo=frozen)
    if dtype is not None:
        plain = plain.to(dtype)
    for p in plain.parameters():
        p.requires_grad_(False)
    return plain.eval()


def _gathered_copy(model: nn.Module) -> nn.Module:
    """A plain copy of a sharded actor: built from its config (a peft model around it under
    LoRA) and loaded with its whole weights, gathered one tensor at a time."""
    from transformers import AutoModelForCausalLM

    from ppokit.distributed import full_tensor

    peft = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
    lm = model.get_base_model() if peft else model  # type: ignore[operator]
    config = copy.deepcopy(lm.config)
    if hasattr(config, "quantization_config"):  # a GGUF file's: the weights are plain here
        del config.quantization_config
    state = {k: full_tensor(v.detach()) for k, v in model.state_dict().items()}
    dtype = next(iter(state.values())).dtype
    device = next(iter(state.values())).device
    with torch.device(device):
        plain: nn.Module = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    if peft:
        from peft import get_peft_model

        adapters: Any = model.peft_config["default"]  # type: ignore[index]
        plain = get_peft_model(plain, adapters)
    plain.load_state_dict(state)
    return plain


@HF.implementation
class HFEngine:
    """It samples from the trainer's actor module itself, so ``sync`` has nothing to do, and
    with ``dtype: auto`` its log-probs are π_old's (``samples_from_policy``), but for top-k/
    top-p: log μ is then of the truncated distribution and ``rollout.logp_old: auto``
    recomputes log π_old, so π_old/μ, the kept mass, shows in ``rollout/mismatch_*``. Asynchronous
    (``EngineContext.asynchronous``), it samples from a frozen copy of the actor
    (:func:`frozen_copy`: under LoRA a copy of the adapters) with generators of its own;
    with ``cast_copy``, from a copy of the whole actor in ``dtype``. ``sync`` copies the
    actor's trained parameters into a copy."""

    def __init__(self, *, dtype: str, cast_copy: bool, drop_ended: bool) -> None:
        self.dtype = dtype
        self.cast_copy = cast_copy
        self.drop_ended = drop_ended
        self.context: EngineContext | None = None
        self.model: nn.Module | None = None  # what samples: the actor or its copy

    @property
    def samples_from_policy(self) -> bool:
        return self.dtype == "auto"

    def _autocast(self, context: EngineContext) -> AbstractContextManager[Any]:
        if self.dtype == "auto":
            return context.autocast()
        if self.cast_copy:  # the weights are in the dtype already
            return contextlib.nullcontext()
        device = torch.device(context.device).type
        return torch.autocast(device, dtype=getattr(torch, self.dtype))

    def start(self, context: EngineContext) -> None:
        self.context = context
        self.model = context.model
        if self.cast_copy:
            self.model = frozen_copy(context.model, getattr(torch, self.dtype))
        elif context.asynchronous:
            self.model = frozen_copy(context.model)

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: Sampling) -> Generation:
        context, model = self.context, self.model
        if context is None or model is None:
            raise RuntimeError("the hf engine was not started")
        with torch.no_grad(), self._autocast(context):
            return generate(
                model,
                prompt_ids,
                prompt_mask,
                sampling,
                context.eos_ids,
                context.pad_id,
                context.progress,
                own_generator=context.asynchronous,
                drop_ended=self.drop_ended,
            )

    def sync(self) -> None:
        """Nothing when the actor samples with the weights the update just changed; the
        actor's trained parameters into the copy when asynchronous (whole tensors of a
        sharded actor: a collective)."""
        from ppokit.distributed import full_tensor

        if self.context is None or self.model is None or self.model is self.context.model:
            return
        mine = dict(self.model.named_parameters())
        with torch.no_grad():  # by name: sharding the actor replaces its parameters
            for name, theirs in self.context.model.named_parameters():
                if theirs.requires_grad:
                    mine[name].copy_(full_tensor(theirs.detach()))

    def close(self) -> None:
        self.context = None
        self.model = None
