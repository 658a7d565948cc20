"""Validation of a spec: structure first (pydantic), then every component against the
registry, the cross-slot requirements and the bounds of a round; every error at once, each
with its path."""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, get_args

from pydantic import (
    BaseModel,
    ValidationError,
)

from ppokit.catalogue import Component
from ppokit.registry import (
    BUILTIN_PLUGIN,
    ComponentInfo,
    Registry,
    RegistryError,
    format_validation_error,
    get_registry,
    name_problem,
    suggest,
)
from ppokit.slots import FIELDS, SLOTS
from ppokit.spec.files import MAX_SPEC_DEPTH, MAX_SPEC_NODES, measure
from ppokit.spec.models import ComponentSpec, DataSpec, RewardSpec, Spec, SpecError
from ppokit.spec.references import resolve_references

#: Response positions a round may hold (B x max_new_tokens): each needs several float32
#: [B, T] tensors and a row of hidden states, so beyond this no machine has the memory. An
#: evaluation (eval.prompts x (eval.n + 1) responses, greedy and sampled) is bounded the
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


#: The data section's settings of a table (a data file, a Hub dataset), with the value
#: that leaves each unset.
_TABLE_SETTINGS: dict[str, Any] = {
    "columns": {},
    "answer_pattern": None,
    "config": None,
    "split": "train",
}


def _given(data: DataSpec, settings: Iterable[str]) -> list[str]:
    """The settings of ``settings`` that ``data`` sets (to other than their unset value)."""
    unset = {**_TABLE_SETTINGS, "options": {}, "shuffle": True}
    return [k for k in settings if getattr(data, k) != unset[k]]


def source_problems(data: DataSpec, prefix: str, registry: Registry) -> list[str]:
    """``path: message`` lines of what is wrong with the prompt source of the data section
    at ``prefix`` (``data``, ``eval.data``): its name, its parameters (``data.source.<param>``
    for a mapping, ``data.options.<param>`` for a name with options) and the section's
    settings that do not apply to it. Its packages and its entry's check are not run."""
    form = data.form(registry)
    comp = data.prompt_source(registry)
    if form == "mapping":
        stray = _given(data, (*_TABLE_SETTINGS, "shuffle", "options"))
        if stray:
            return [
                f"{prefix}: {', '.join(stray)}: with source a mapping, the source's "
                f"parameters go in it ({prefix}.source.<parameter>)"
            ]
        lines, _ = _check_slot(f"{prefix}.source", "prompt_source", comp, registry)
        return lines
    if form == "name":
        unused = _given(data, _TABLE_SETTINGS)
        if unused:
            verb = "applies" if len(unused) == 1 else "apply"
            builtin = registry.info("prompt_source", comp.name).plugin == BUILTIN_PLUGIN
            what = f"built-in {comp.name!r} generator" if builtin else f"source {comp.name!r}"
            return [
                f"{prefix}: {', '.join(unused)}: {verb} to a data file or dataset, not to the "
                f"{what}"
            ]
        return _check_slot(f"{prefix}.options", "prompt_source", comp, registry)[0]
    if data.options:
        return [
            f"{prefix}.options: a data file takes no options, got {', '.join(sorted(data.options))}"
        ]
    if form == "file" and data.config is not None:
        return [f"{prefix}: config: applies to a Hub dataset (source: hf:owner/name) only"]
    if form == "file" and re.fullmatch(r"[A-Za-z_]\w*", str(data.source)):
        close = suggest(str(data.source), registry.names("prompt_source"))
        if close and not os.path.exists(str(data.source)):
            return [f"{prefix}.source: no prompt source nor data file {data.source!r}{close}"]
    return []


def _optional_packages(spec: Spec, registry: Registry) -> Iterator[tuple[str, str, str]]:
    """(spec path, package, ppokit extra) of each optional package the spec uses."""
    for i, tracker in enumerate(spec.output.report_to):
        yield f"output.report_to.{i}", tracker, tracker
    if spec.model.lora is not None:
        yield "model.lora", "peft", "lora"
    if spec.data.needs_datasets(registry):
        yield "data.source", "datasets", "data"
    if (
        spec.eval is not None
        and spec.eval.data is not None
        and spec.eval.data.needs_datasets(registry)
    ):
        yield "eval.data.source", "datasets", "data"


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
    "eval": "eval.prompts, eval.n (or the largest eval.k) or eval.max_new_tokens "
    "(prompts x (n + 1) responses)",
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


def _entry_check(
    path: str, kind: str, comp: ComponentSpec, entry: Component, spec: Spec, registry: Registry
) -> list[str]:
    """The lines of the entry's own ``check`` (none while its parameters are invalid; a
    check that raises, or calls ``sys.exit``, is a line naming it)."""
    info = registry.info(kind, comp.name)
    try:
        params = info.validate(comp.params)
    except ValidationError:
        return []  # reported with the slot
    assert entry.check is not None
    try:
        return [str(line) for line in entry.check(spec, params)]
    except (Exception, SystemExit) as exc:  # a plugin's: reported, never a traceback
        return [f"{path}: the check of {kind} {comp.name!r} failed: {exc!r}"]


def _entry_needs(
    path: str, kind: str, comp: ComponentSpec, spec: Spec, registry: Registry
) -> list[str]:
    """The lines of the packages a registered component's entry needs that are missing,
    else of its entry's own ``check``."""
    entry = registry.info(kind, comp.name).entry
    missing = [
        f"{path}: needs the package {package!r}, which is not installed: {install}"
        for package, install in entry.packages
        if importlib.util.find_spec(package) is None
    ]
    if entry.check is not None and not missing:
        return _entry_check(path, kind, comp, entry, spec, registry)
    return missing


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
    if not spec.reward and spec.rollout.environment.name == "none":
        errors.append(
            "reward: give at least one reward (no reward is for a spec whose "
            "rollout.environment gives the rewards)"
        )
    t, ro = spec.train, spec.rollout
    batch = ro.prompts_per_round * ro.n
    # with an environment an episode's budget (without its chat markup)
    tokens = ro.max_new_tokens if ro.environment.name == "none" else ro.episode_budget()
    errors.extend(_too_large("rollout", "a round", batch, tokens))
    if spec.eval is not None:
        e = spec.eval
        tokens = e.max_new_tokens or spec.rollout.max_new_tokens
        errors.extend(_too_large("eval", "an evaluation", e.prompts * (e.samples + 1), tokens))
    sections = [("data", spec.data)]
    if spec.eval is not None and spec.eval.data is not None and spec.eval.data != spec.data:
        sections.append(("eval.data", spec.eval.data))
    for prefix, data in sections:
        problems = source_problems(data, prefix, registry)
        errors.extend(problems)
        comp = data.prompt_source(registry)
        if not problems and registry.has("prompt_source", comp.name):
            errors.extend(_entry_needs(f"{prefix}.source", "prompt_source", comp, spec, registry))
    for path, package, extra in _optional_packages(spec, registry):
        if importlib.util.find_spec(package) is None:
            errors.append(
                f"{path}: needs the package {package!r}, which is not installed: "
                f"pip install 'ppokit[{extra}]'"
            )
    for path, kind, comp in spec.slots():  # the packages and the check an entry declares
        if registry.has(kind, comp.name):
            errors.extend(_entry_needs(path, kind, comp, spec, registry))
    if ro.max_staleness and ro.filter.name != "none":
        errors.append(
            f"rollout.filter: dynamic sampling ({ro.filter.name}) decides during a round how "
            "many batches to generate, which batches generated ahead cannot follow: set "
            "rollout.filter: none or rollout.max_staleness: 0"
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
    if t.micro_batch_tokens is not None and t.micro_batch_size is not None:
        errors.append(
            "train.micro_batch_tokens: set it or train.micro_batch_size, not both (a token "
            "budget replaces a number of responses)"
        )
    if t.pack_sequences and t.micro_batch_tokens is None:
        errors.append(
            "train.pack_sequences: packs the sequences of a micro-batch of "
            "train.micro_batch_tokens tokens: set that budget too"
        )
    return errors


def spec_warnings(spec: Spec) -> list[str]:
    """``path: message`` lines of what a valid spec trains that its author may not expect
    (``ppokit validate`` and ``ppokit train`` show them): asynchronous rollouts without a
    rollout correction."""
    ro = spec.rollout
    if not ro.max_staleness or spec.policy.correction.name != "none":
        return []
    s = ro.max_staleness
    against = (
        "the PPO ratio and its clip are taken against the engine's log μ itself"
        if ro.logp_old == "rollout"
        else "the PPO ratio and its clip are taken against π_old at the update's weights, and "
        "the gap π_old/μ is not weighted"
    )
    return [
        f"policy.correction: none with rollout.max_staleness {s}: rows come from weights up "
        f"to {s} update(s) old; {against} (docs/async.md); e.g. policy.correction: token_tis"
    ]


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
    if measure(data, MAX_SPEC_NODES)[1] > MAX_SPEC_DEPTH:
        raise SpecError([f"the spec nests deeper than {MAX_SPEC_DEPTH} levels"])
    data = resolve_references(data)
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
