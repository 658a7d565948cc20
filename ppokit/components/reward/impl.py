"""Tensor code of the reward components (catalogue: :mod:`ppokit.components.reward`).

A reward ignores the fields it does not use and raises a :class:`~ppokit.errors.UserError`
naming a field it needs but did not get (:func:`require_field`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import re
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ppokit.components import reward as catalogue
from ppokit.errors import MissingDependency, UserError, one_line

__all__ = [
    "ExactMatchReward",
    "HFClassifierReward",
    "LengthPenaltyReward",
    "MathVerifyReward",
    "PythonReward",
    "RegexReward",
    "load_function",
    "require_field",
]

#: Seconds math-verify may spend parsing or comparing one answer (main thread only).
MATH_VERIFY_TIMEOUT = 5


def require_field(fields: dict[str, Any], name: str, reward: str, count: int) -> Sequence[Any]:
    """``fields[name]``, checked to hold one entry per response.

    A missing field is a :class:`UserError` naming it and the fields that were given.
    """
    if name not in fields:
        given = ", ".join(sorted(fields)) or "none"
        raise UserError(
            f"the {reward} reward needs the field {name!r} (a column of the data rows); "
            f"fields given: {given}"
        )
    values = fields[name]
    if len(values) != count:
        raise UserError(
            f"the {reward} reward got {len(values)} values of {name!r} for {count} responses"
        )
    return values


def _scores(values: Iterable[float]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float32)


class _NoTimeoutNotice(logging.Filter):
    """Drops math-verify's "Timeout is disabled ..." warning: off the main thread ppokit
    calls it without its timeouts on purpose (``signal.alarm`` cannot work there) and
    bounds the whole reward call itself (``train.reward_timeout``). Its other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


_NO_TIMEOUT_NOTICE = _NoTimeoutNotice()


def _quiet_math_verify() -> None:
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if _NO_TIMEOUT_NOTICE not in logger.filters:
            logger.addFilter(_NO_TIMEOUT_NOTICE)


def is_number(value: Any) -> bool:
    """Whether a parsed answer is a number as written, not an expression to evaluate: a sympy
    number (``57``, ``-3``, ``0.5``, ``\\frac{3}{4}``) or ``p/q`` of integers in lowest terms
    with ``q > 1`` (math-verify leaves ``3/4`` unevaluated). ``43 + 14``, ``3*4`` and ``12/4``
    are expressions."""
    if getattr(value, "is_Number", False):
        return True
    if not getattr(value, "is_Mul", False):
        return False
    factors = [a for a in value.args if a != -1]
    numerators = [a for a in factors if a.is_Integer]
    denominators = [a for a in factors if a.is_Pow and a.base.is_Integer and a.exp == -1]
    if len(numerators) != 1 or len(denominators) != 1 or len(factors) != 2:
        return False
    p, q = int(numerators[0]), int(denominators[0].base)
    return q > 1 and math.gcd(p, q) == 1


@catalogue.MATH_VERIFY.implementation
class MathVerifyReward:
    """The gold answer and the response are parsed with the ``math-verify`` library (LaTeX,
    ``\\boxed{}`` and plain expressions), so ``\\frac{1}{2}`` matches ``0.5``. Anything that
    fails to parse, raises or times out counts as incorrect. math-verify's timeouts use
    ``signal.alarm``, which works only on the main thread; elsewhere they are disabled.
    """

    def __init__(self, *, field: str, correct: float, incorrect: float, final: str) -> None:
        try:
            from math_verify import parse, verify
        except ImportError:
            raise MissingDependency(
                "math-verify", "the math_verify reward", "pip install math-verify"
            ) from None
        _quiet_math_verify()
        self.field = field
        self.correct = correct
        self.incorrect = incorrect
        self.number_only = final == "number"
        self._parse: Callable[..., list[Any]] = parse
        self._verify: Callable[..., bool] = verify

    @staticmethod
    def _timeout() -> int | None:
        on_main = threading.current_thread() is threading.main_thread()
        return MATH_VERIFY_TIMEOUT if on_main else None

    def _parse_text(self, text: str, timeout: int | None) -> list[Any]:
        try:
            return self._parse(text, parsing_timeout=timeout)
        except Exception:
            return []

    def parse_gold(self, answer: Any, timeout: int | None) -> list[Any]:
        """The parsed gold answer. A LaTeX answer (one with a backslash, e.g. ``8\\sqrt{10}``)
        is parsed inside ``$...$`` first: bare, math-verify would read only its leading number.
        Anything else is parsed as it is, then retried inside ``$...$``."""
        text = str(answer).strip()
        latex = "\\" in text and not text.startswith("$")
        attempts = [f"${text}$", text] if latex else [text, f"${text}$"]
        for attempt in attempts if text else []:
            parsed = self._parse_text(attempt, timeout)
            if parsed:
                return parsed
        return []

    def is_correct(self, gold: list[Any], response: str, timeout: int | None) -> bool:
        if not gold:
            return False
        target = self._parse_text(response, timeout)
        if not target or (self.number_only and not is_number(target[0])):
            return False
        try:
            return bool(self._verify(gold, target, timeout_seconds=timeout))
        except Exception:
            return False

    def __call__(self, prompts: list[str], responses: list[str], **fields: Any) -> torch.Tensor:
        answers = require_field(fields, self.field, "math_verify", len(responses))
        timeout = self._timeout()
        golds: dict[str, list[Any]] = {}
        out = []
        for answer, response in zip(answers, responses, strict=True):
            key = str(answer)
            if key not in golds:
                golds[key] = self.parse_gold(answer, timeout)
            ok = self.is_correct(golds[key], response, timeout)
            out.append(self.correct if ok else self.incorrect)
        return _scores(out)


@catalogue.EXACT_MATCH.implementation
class ExactMatchReward:
    """Non-string answers are compared through ``str()``."""

    def __init__(self, *, field: str, strip: bool, case_sensitive: bool) -> None:
        self.field = field
        self.strip = strip
        self.case_sensitive = case_sensitive

    def normalise(self, text: Any) -> str:
        text = str(text)
        if self.strip:
            text = text.strip()
        if not self.case_sensitive:
            text = text.casefold()
        return text

    def __call__(self, prompts: list[str], responses: list[str], **fields: Any) -> torch.Tensor:
        answers = require_field(fields, self.field, "exact_match", len(responses))
        return _scores(
            float(self.normalise(r) == self.normalise(a))
            for r, a in zip(responses, answers, strict=True)
        )


@catalogue.REGEX.implementation
class RegexReward:
    """Matched by the ``regex`` package, which bounds each match by ``timeout`` seconds (a
    pattern that backtracks exponentially on some response, ``(a|aa)+$``, cannot hold the
    run: that response scores 0). With ``field``, the first capture group and the field are
    compared after stripping whitespace; a group that did not participate in the match
    scores 0.
    """

    def __init__(self, *, pattern: str, field: str | None, mode: str, timeout: float) -> None:
        import regex

        self.regex = regex.compile(pattern)
        self.field = field
        self.mode = mode
        self.timeout = timeout

    def score(self, response: str, expected: Any | None) -> float:
        try:
            match = getattr(self.regex, self.mode)(response, timeout=self.timeout)
        except TimeoutError:
            return 0.0
        if match is None:
            return 0.0
        if self.field is None:
            return 1.0
        group = match.group(1)
        return float(group is not None and group.strip() == str(expected).strip())

    def __call__(self, prompts: list[str], responses: list[str], **fields: Any) -> torch.Tensor:
        if self.field is None:
            expected: Sequence[Any] = [None] * len(responses)
        else:
            expected = require_field(fields, self.field, "regex", len(responses))
        return _scores(self.score(r, e) for r, e in zip(responses, expected, strict=True))


@catalogue.LENGTH_PENALTY.implementation
class LengthPenaltyReward:
    """L is the response length in tokens. With ``target = L_max - L_cache``, ``scale = 1 /
    L_cache`` and ``max_length = L_max`` this is DAPO's soft overlong punishment (0, then
    linear down to -1 at L_max, then -1).
    """

    def __init__(self, *, target: int, scale: float, max_length: int | None) -> None:
        self.target = target
        self.scale = scale
        self.max_length = max_length

    def __call__(self, prompts: list[str], responses: list[str], **fields: Any) -> torch.Tensor:
        raw = require_field(fields, "lengths", "length_penalty", len(responses))
        lengths = torch.as_tensor(raw).to(torch.float32)
        if self.max_length is not None:
            lengths = lengths.clamp(max=float(self.max_length))
        return -self.scale * (lengths - float(self.target)).clamp(min=0.0)


@catalogue.HF_CLASSIFIER.implementation
class HFClassifierReward:
    """``f`` is a local ``AutoModelForSequenceClassification`` reading the (prompt, response)
    text pair, truncated to ``max_length`` tokens. The model and tokenizer are loaded from
    ``path`` on first use (``local_files_only``: nothing is downloaded), kept on the
    instance, and run in eval mode without gradients, ``batch_size`` pairs at a time.
    """

    def __init__(
        self,
        *,
        path: str,
        label: int | str | None,
        batch_size: int,
        max_length: int,
        device: str,
    ) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise UserError(
                f"hf_classifier reward: model directory not found: {path} "
                "(a local directory of a sequence-classification model)"
            )
        self.label = label
        self.batch_size = batch_size
        self.max_length = max_length
        self.device = device
        self._model: Any = None
        self._tokenizer: Any = None
        self._label_index: int | None = None
        self._inputs: frozenset[str] = frozenset()

    def _resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def _resolve_label(self, config: Any) -> int | None:
        num_labels = int(config.num_labels)
        if self.label is None:
            if num_labels != 1:
                names = ", ".join(repr(n) for n in config.id2label.values())
                raise UserError(
                    f"hf_classifier reward: the model has {num_labels} labels ({names}): "
                    "set 'label' to the index or name of the positive one"
                )
            return None
        if num_labels < 2:
            raise UserError(
                "hf_classifier reward: the model has a single-logit head: leave 'label' unset "
                "to use its logit"
            )
        if isinstance(self.label, str):
            label2id = {str(k): int(v) for k, v in config.label2id.items()}
            if self.label not in label2id:
                raise UserError(
                    f"hf_classifier reward: unknown label {self.label!r}; "
                    f"the model's labels are {sorted(label2id)}"
                )
            return label2id[self.label]
        if not 0 <= self.label < num_labels:
            raise UserError(
                f"hf_classifier reward: label index {self.label} out of range "
                f"for {num_labels} labels"
            )
        return self.label

    def load(self) -> None:
        """Load the tokenizer and model (once)."""
        if self._model is not None:
            return
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
            model = AutoModelForSequenceClassification.from_pretrained(
                str(self.path), local_files_only=True
            )
        except (OSError, ValueError) as exc:
            raise UserError(
                f"hf_classifier reward: cannot load {self.path}: {one_line(exc)}"
            ) from None
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise UserError(
                    f"hf_classifier reward: the tokenizer in {self.path} has neither a pad "
                    "nor an eos token"
                )
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        self._label_index = self._resolve_label(model.config)
        model.to(self._resolve_device())
        model.eval()
        self._inputs = frozenset(inspect.signature(model.forward).parameters)
        self._model = model
        self._tokenizer = tokenizer

    def _score_logits(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self._label_index is None:
            return logits[:, 0]
        return logits.softmax(dim=-1)[:, self._label_index]

    @torch.no_grad()
    def __call__(self, prompts: list[str], responses: list[str], **fields: Any) -> torch.Tensor:
        if len(prompts) != len(responses):
            raise UserError(
                f"hf_classifier reward: {len(prompts)} prompts for {len(responses)} responses"
            )
        self.load()
        device = next(self._model.parameters()).device
        if not responses:
            return torch.zeros(0, dtype=torch.float32, device=device)
        chunks = []
        for start in range(0, len(responses), self.batch_size):
            stop = start + self.batch_size
            enc = self._tokenizer(
                list(prompts[start:stop]),
                list(responses[start:stop]),
                truncation=True,
                max_length=self.max_length,
                padding=True,
                return_tensors="pt",
            )
            inputs = {k: v.to(device) for k, v in enc.items() if k in self._inputs}
            chunks.append(self._score_logits(self._model(**inputs).logits))
        return torch.cat(chunks)


def load_function(reference: str) -> Callable[..., Any]:
    """The function ``"path/to/file.py:fn"`` or ``"package.module:fn"`` names: the file is
    imported as a module of its own (its folder is not put on ``sys.path``), the module
    with ``importlib``. Anything that goes wrong is one :class:`UserError` line."""
    where, name, is_file = catalogue.split_function(reference)
    what = f"the python reward's function {reference!r}"
    if is_file:
        path = Path(where).expanduser()
        if not path.is_file():
            raise UserError(f"{what}: file not found: {where} (a path relative to {Path.cwd()})")
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        module_name = f"ppokit_reward_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{digest}"
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, path)
            if spec is None or spec.loader is None:
                raise UserError(f"{what}: {where} cannot be imported as a Python file")
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as exc:
                del sys.modules[module_name]
                raise UserError(f"{what}: importing {where} raised {one_line(exc)}") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:
            raise UserError(f"{what}: cannot import {where}: {one_line(exc)}") from None
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise UserError(
            f"{what}: {where} has no {name!r}; its functions: {', '.join(found) or 'none'}"
        )
    if not callable(fn):
        raise UserError(f"{what}: {name!r} in {where} is a {type(fn).__name__}, not a function")
    return fn  # type: ignore[no-any-return]


@catalogue.PYTHON.implementation
class PythonReward:
    """Calls ``fn(prompts, responses, **fields)``. A function with a ``**kwargs`` parameter
    gets every field; one without gets only the fields it names (``answer``, ``lengths``,
    ...), so ``def reward(prompts, responses, answer)`` works as written. A function written
    for TRL's ``reward_funcs`` (a ``completions`` parameter, no ``responses``) is called as
    TRL calls it, by keyword: ``fn(prompts=..., completions=..., **fields)``. What it returns
    is checked like any reward's: one real number per response (a list, a tensor, a numpy
    array)."""

    def __init__(self, *, function: str) -> None:
        self.function = function
        self.fn = load_function(function)
        self.__wrapped__ = self.fn  # where its code is, for messages
        self.accepts: frozenset[str] | None = None  # None: every keyword (**kwargs)
        names: set[str] = set()
        try:
            parameters = list(inspect.signature(self.fn).parameters.values())
        except (TypeError, ValueError):  # a builtin without a signature: give it all
            parameters = []
        names = {p.name for p in parameters}
        if parameters and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            self.accepts = frozenset(names)
        self.by_keyword = "completions" in names and "responses" not in names

    def __reduce__(self) -> tuple[Any, ...]:
        """Crosses to a worker process as its reference, imported again there (a file's
        module is not importable by name)."""
        return (_python_reward, (self.function,))

    def __call__(self, prompts: list[str], responses: list[str], **fields: Any) -> Any:
        if self.by_keyword:  # TRL's convention: the model's output, whatever the columns
            fields = {**fields, "prompts": prompts, "completions": responses}
        if self.accepts is not None:
            fields = {k: v for k, v in fields.items() if k in self.accepts}
        if self.by_keyword:
            return self.fn(**fields)
        return self.fn(prompts, responses, **fields)

    def __repr__(self) -> str:
        return f"PythonReward({self.function!r})"


def _python_reward(function: str) -> PythonReward:
    """A :class:`PythonReward` made again from its reference (how it is unpickled)."""
    return PythonReward(function=function)
