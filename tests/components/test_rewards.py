"""The built-in rewards: hand-computed cases, identities, and the registry round-trip."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ppokit.components.reward import RegexParams
from ppokit.components.reward.impl import (
    LengthPenaltyReward,
    MathVerifyReward,
)
from ppokit.errors import MissingDependency, UserError
from ppokit.registry import RegistryError, build_registry, get_registry
from ppokit.spec import Spec, SpecError, validate_spec
from ppokit.tasks.arithmetic import evaluate
from tests.helpers.components import builtin_names, make

#: The built-in rewards, as registered.
REWARDS = builtin_names("reward")


def _check_scores(scores: torch.Tensor, n: int) -> None:
    assert scores.dtype == torch.float32
    assert scores.shape == (n,)


# ------------------------------------------------------------------ math_verify
@pytest.fixture(scope="module")
def math_reward() -> MathVerifyReward:
    return get_registry().create("reward", "math_verify")


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("The sum is \\boxed{68}.", "68", 1.0),
        ("\\boxed{68}", "68", 1.0),
        ("\\boxed{67}", "68", 0.0),
        ("lorem ipsum }{\\frac{", "68", 0.0),
        ("", "68", 0.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("So x = \\boxed{0.75}", "\\frac{3}{4}", 1.0),
        ("\\boxed{\\frac{3}{4}}", "\\frac{2}{3}", 0.0),
        ("\\boxed{-16}", "-16", 1.0),
        ("\\boxed{68}", "}{garbage\\", 0.0),
    ],
)
def test_math_verify_cases(
    math_reward: MathVerifyReward, response: str, answer: str, expected: float
) -> None:
    scores = math_reward(["q"], [response], answer=[answer])
    _check_scores(scores, 1)
    assert scores.tolist() == [expected]


def test_math_verify_custom_values_and_field() -> None:
    reward = get_registry().create(
        "reward", "math_verify", field="gold", correct=2.0, incorrect=-1.0
    )
    scores = reward(["q", "q"], ["\\boxed{5}", "\\boxed{6}"], gold=[5, "5"], lengths=[3, 3])
    assert scores.tolist() == [2.0, -1.0]


@pytest.fixture(scope="module")
def number_reward() -> MathVerifyReward:
    return get_registry().create("reward", "math_verify", final="number")


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("57", "57", 1.0),
        ("The answer is 57.", "57", 1.0),
        ("43 + 14 = 57", "57", 1.0),
        ("\\boxed{57}", "57", 1.0),
        ("57.0", "57", 1.0),
        ("-3", "-3", 1.0),
        ("3/4", "3/4", 1.0),
        ("\\boxed{\\frac{3}{4}}", "3/4", 1.0),
        ("-3/4", "-3/4", 1.0),
        ("0.75", "3/4", 1.0),
        # the problem restated: an expression, however it is written
        ("43 + 14", "57", 0.0),
        ("\\boxed{43 + 14}", "57", 0.0),
        ("The answer is 98 + 93 - 77.", "114", 0.0),
        ("$3 \\cdot 19$", "57", 0.0),
        ("6/8", "3/4", 0.0),
        ("114/2", "57", 0.0),
    ],
)
def test_math_verify_number_only_cases(
    number_reward: MathVerifyReward, response: str, answer: str, expected: float
) -> None:
    """``final: number``: the answer must be written as a number; the default reward accepts
    every expression of the table's left column that equals the gold answer."""
    assert number_reward(["q"], [response], answer=[answer]).tolist() == [expected]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 99), min_size=2, max_size=3),
    st.lists(st.sampled_from("+-*"), min_size=2, max_size=2),
)
def test_math_verify_number_only_refuses_the_restated_problem(
    number_reward: MathVerifyReward, math_reward: MathVerifyReward, terms: list[int], ops: list[str]
) -> None:
    """Over generated problems: the problem's own expression scores 0 with ``final: number``
    and 1 by default (math-verify evaluates it); the value written out scores 1 with both."""
    text = str(terms[0]) + "".join(f" {o} {t}" for o, t in zip(ops, terms[1:], strict=False))
    gold = str(evaluate(terms, ops[: len(terms) - 1]))
    responses = [f"The answer is {text}.", f"The answer is {gold}."]
    assert number_reward(["q"] * 2, responses, answer=[gold] * 2).tolist() == [0.0, 1.0]
    assert math_reward(["q"] * 2, responses, answer=[gold] * 2).tolist() == [1.0, 1.0]


def test_math_verify_off_the_main_thread(math_reward: MathVerifyReward) -> None:
    out: list[torch.Tensor] = []
    worker = threading.Thread(
        target=lambda: out.append(math_reward(["q", "q"], ["\\boxed{68}", "67"], answer=["68"] * 2))
    )
    worker.start()
    worker.join()
    assert out[0].tolist() == [1.0, 0.0]


def test_math_verify_missing_field(math_reward: MathVerifyReward) -> None:
    with pytest.raises(UserError, match="'answer'"):
        math_reward(["q"], ["\\boxed{1}"], lengths=[1], truncated=[False])


def test_math_verify_missing_dependency(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(MissingDependency, match="pip install math-verify"):
        make("reward", "math_verify")


# ------------------------------------------------------------------ exact_match
@pytest.mark.parametrize(
    ("params", "response", "answer", "expected"),
    [
        ({}, "  Paris\n", "paris", 1.0),
        ({}, "PARIS", "Paris", 1.0),
        ({}, "Paris.", "Paris", 0.0),
        ({"case_sensitive": True}, "PARIS", "Paris", 0.0),
        ({"case_sensitive": True}, " Paris ", "Paris", 1.0),
        ({"strip": False}, " Paris ", "Paris", 0.0),
        ({}, "42", 42, 1.0),
    ],
)
def test_exact_match_cases(params: dict, response: str, answer: object, expected: float) -> None:
    reward = get_registry().create("reward", "exact_match", **params)
    scores = reward(["q"], [response], answer=[answer])
    _check_scores(scores, 1)
    assert scores.tolist() == [expected]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=12), min_size=1, max_size=6), st.booleans())
def test_exact_match_identities(texts: list[str], strip: bool) -> None:
    reward = make("reward", "exact_match", strip=strip)
    n = len(texts)
    assert reward(["q"] * n, texts, answer=texts).tolist() == [1.0] * n
    padded = [f" {t.upper()}\t" for t in texts]
    expected = [float(strip and t.upper().casefold() == t.casefold()) for t in texts]
    assert reward(["q"] * n, padded, answer=texts).tolist() == expected


def test_exact_match_missing_field() -> None:
    with pytest.raises(UserError, match="'label'"):
        make("reward", "exact_match", field="label")(["q"], ["a"], answer=["a"])


# ------------------------------------------------------------------------ regex
def test_regex_search_and_fullmatch() -> None:
    search = make("reward", "regex", pattern=r"<answer>.*</answer>")
    full = make("reward", "regex", pattern=r"<answer>.*</answer>", mode="fullmatch")
    responses = ["<answer>3</answer>", "so <answer>3</answer>", "no tags"]
    assert search(["q"] * 3, responses).tolist() == [1.0, 1.0, 0.0]
    assert full(["q"] * 3, responses).tolist() == [1.0, 0.0, 0.0]


def test_regex_capture_group_compared_with_field() -> None:
    reward = get_registry().create("reward", "regex", pattern=r"answer: (-?\d+)", field="answer")
    responses = ["answer: 12", "answer: 13", "answer: -4", "nothing", "answer:  7"]
    answers = ["12", "12", -4, "4", "7"]
    scores = reward(["q"] * 5, responses, answer=answers)
    _check_scores(scores, 5)
    assert scores.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]


def test_regex_optional_group_that_did_not_match() -> None:
    reward = make("reward", "regex", pattern=r"done(?: (\w+))?", field="answer")
    assert reward(["q", "q"], ["done", "done ok"], answer=["ok", "ok"]).tolist() == [0.0, 1.0]


def test_regex_missing_field() -> None:
    reward = make("reward", "regex", pattern=r"(\d+)", field="answer")
    with pytest.raises(UserError, match="'answer'"):
        reward(["q"], ["1"], lengths=[1])


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"pattern": "(unclosed"}, "invalid regular expression"),
        ({"pattern": "[a-"}, "invalid regular expression"),
        ({"pattern": r"\d+", "field": "answer"}, "needs a capture group"),
        ({"pattern": "x", "mode": "match"}, "mode"),
        ({}, "pattern"),
    ],
)
def test_regex_params_rejected(params: dict, message: str) -> None:
    with pytest.raises(RegistryError, match=message):
        get_registry().create("reward", "regex", **params)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"pattern": r"\d+", "field": "answer"}, "needs a capture group"),
        ({"pattern": "x", "mode": "match"}, "mode"),
        ({"pattern": "(x"}, "invalid regular expression"),
    ],
)
def test_regex_params_model_validates(params: dict, message: str) -> None:
    """The params model checks the pattern, the mode and the capture group (the
    implementation trusts it)."""
    with pytest.raises(ValidationError, match=message):
        RegexParams(**params)


def test_regex_params_defaults() -> None:
    params = RegexParams(pattern=r"(\d+)", field="answer")
    assert (params.mode, params.field) == ("search", "answer")
    assert RegexParams(pattern="x").field is None


def test_bad_regex_in_a_spec_is_reported_with_its_path() -> None:
    with pytest.raises(SpecError) as info:
        validate_spec({"reward": {"name": "regex", "pattern": "(oops"}})
    assert any(
        e.startswith("reward.pattern") and "invalid regular expression" in e
        for e in info.value.errors
    )


# --------------------------------------------------------------- length_penalty
@pytest.mark.parametrize(
    ("params", "lengths", "expected"),
    [
        ({}, [0, 1, 100], [0.0, -0.01, -1.0]),
        ({"target": 10, "scale": 0.5}, [3, 10, 11, 14], [0.0, 0.0, -0.5, -2.0]),
        ({"target": 4, "scale": 0.25, "max_length": 8}, [4, 6, 8, 20], [0.0, -0.5, -1.0, -1.0]),
    ],
)
def test_length_penalty_cases(params: dict, lengths: list[int], expected: list[float]) -> None:
    reward = get_registry().create("reward", "length_penalty", **params)
    n = len(lengths)
    scores = reward(["q"] * n, ["r"] * n, lengths=lengths, truncated=[False] * n)
    _check_scores(scores, n)
    torch.testing.assert_close(scores, torch.tensor(expected))


def test_length_penalty_is_dapo_soft_overlong_punishment() -> None:
    l_max, l_cache = 20, 4
    reward = LengthPenaltyReward(target=l_max - l_cache, scale=1 / l_cache, max_length=l_max)
    lengths = list(range(30))
    dapo = [
        0.0 if n <= l_max - l_cache else (((l_max - l_cache) - n) / l_cache if n <= l_max else -1.0)
        for n in lengths
    ]
    scores = reward(["q"] * 30, ["r"] * 30, lengths=torch.tensor(lengths))
    torch.testing.assert_close(scores, torch.tensor(dapo))


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(0, 500), min_size=1, max_size=10),
    st.integers(0, 100),
    st.floats(0, 2, allow_nan=False),
    st.one_of(st.none(), st.integers(1, 300)),
)
def test_length_penalty_formula(
    lengths: list[int], target: int, scale: float, max_length: int | None
) -> None:
    if max_length is not None and max_length <= target:
        max_length = target + 1
    reward = LengthPenaltyReward(target=target, scale=scale, max_length=max_length)
    n = len(lengths)
    scores = reward(["q"] * n, ["r"] * n, lengths=lengths)
    _check_scores(scores, n)
    cap = max_length if max_length is not None else max(lengths)
    expected = [-scale * max(0, min(length, cap) - target) for length in lengths]
    torch.testing.assert_close(scores, torch.tensor(expected, dtype=torch.float32))
    assert (scores <= 0).all()
    order = sorted(range(n), key=lambda i: lengths[i])
    assert (scores[order].diff() <= 1e-6).all()  # longer is never better


def test_length_penalty_params_and_missing_lengths() -> None:
    with pytest.raises(RegistryError, match="max_length"):
        get_registry().create("reward", "length_penalty", target=10, max_length=10)
    with pytest.raises(UserError, match="'lengths'"):
        make("reward", "length_penalty")(["q"], ["r"], answer=["a"])


# ---------------------------------------------------------------- hf_classifier
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "good", "bad", "answer", "is", "the", "a", "b"]


def _tokenizer(bert: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bert:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
    )


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=0,
    )
    path = tmp_path_factory.mktemp("llama_rm")
    LlamaForSequenceClassification(config).save_pretrained(path)
    _tokenizer(bert=False).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(1)
    config = BertConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=64,
        num_labels=2,
        id2label={0: "NEG", 1: "POS"},
        label2id={"NEG": 0, "POS": 1},
    )
    path = tmp_path_factory.mktemp("bert_rm")
    BertForSequenceClassification(config).save_pretrained(path)
    _tokenizer(bert=True).save_pretrained(path)
    return path


PROMPTS = ["the answer is", "a", "the answer", "b b b b b b"]
RESPONSES = ["good", "bad bad bad a b", "good answer", "a"]


def test_hf_classifier_single_logit_matches_the_model(llama_dir: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    reward = get_registry().create("reward", "hf_classifier", path=str(llama_dir), device="cpu")
    scores = reward(PROMPTS, RESPONSES, answer=["x"] * 4)
    _check_scores(scores, 4)
    model = AutoModelForSequenceClassification.from_pretrained(llama_dir).eval()
    vocab = {w: i for i, w in enumerate(WORDS)}
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
            ids = torch.tensor([[vocab[w] for w in f"{p} {r}".split()]])
            torch.testing.assert_close(scores[i], model(input_ids=ids).logits[0, 0])
    assert reward._model is not None and not reward._model.training
    first = reward._model
    reward(PROMPTS[:1], RESPONSES[:1])
    assert reward._model is first  # loaded once


def test_hf_classifier_batching_and_padding_do_not_change_scores(llama_dir: Path) -> None:
    whole = make("reward", "hf_classifier", path=str(llama_dir), batch_size=4, device="cpu")
    single = make("reward", "hf_classifier", path=str(llama_dir), batch_size=1, device="cpu")
    torch.testing.assert_close(whole(PROMPTS, RESPONSES), single(PROMPTS, RESPONSES))


def test_hf_classifier_truncates_to_max_length(llama_dir: Path) -> None:
    truncating = make("reward", "hf_classifier", path=str(llama_dir), max_length=3, device="cpu")
    full = make("reward", "hf_classifier", path=str(llama_dir), device="cpu")
    # longest_first: tokens come off the longer text until 3 remain
    torch.testing.assert_close(
        truncating(["the answer is"], ["good good good good"]), full(["the"], ["good good"])
    )
    torch.testing.assert_close(
        truncating(["the answer is"], ["good"]), full(["the answer"], ["good"])
    )


def test_hf_classifier_label_probabilities(bert_dir: Path) -> None:
    pos = get_registry().create("reward", "hf_classifier", path=str(bert_dir), label="POS")
    neg = get_registry().create("reward", "hf_classifier", path=str(bert_dir), label=0)
    p, q = pos(PROMPTS, RESPONSES), neg(PROMPTS, RESPONSES)
    _check_scores(p, 4)
    assert ((p > 0) & (p < 1)).all()
    torch.testing.assert_close(p.cpu() + q.cpu(), torch.ones(4))


@pytest.mark.parametrize(
    ("label", "message"),
    [(None, "set 'label'"), ("MAYBE", "unknown label"), (5, "out of range")],
)
def test_hf_classifier_bad_label(bert_dir: Path, label: object, message: str) -> None:
    reward = make("reward", "hf_classifier", path=str(bert_dir), label=label, device="cpu")
    with pytest.raises(UserError, match=message):
        reward(PROMPTS, RESPONSES)


def test_hf_classifier_missing_directory_is_a_spec_error(tmp_path: Path) -> None:
    from ppokit.registry import RegistryError
    from ppokit.spec import SpecError, validate_spec

    missing = str(tmp_path / "nope")
    with pytest.raises(RegistryError, match="model directory not found"):
        get_registry().create("reward", "hf_classifier", path=missing)
    with pytest.raises(SpecError, match=r"reward.path: .*model directory not found"):
        validate_spec({"reward": {"name": "hf_classifier", "path": missing}})
    with pytest.raises(SpecError, match=r"has no config\.json"):
        validate_spec({"reward": {"name": "hf_classifier", "path": str(tmp_path)}})


def test_hf_classifier_directory_without_a_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # a config, but no model
    reward = make("reward", "hf_classifier", path=str(tmp_path), device="cpu")
    with pytest.raises(UserError, match="cannot load"):
        reward(["q"], ["r"])


# --------------------------------------------------------------------- registry
def test_every_reward_is_registered_with_its_documentation() -> None:
    registry = get_registry()
    known = {"math_verify", "exact_match", "regex", "length_penalty", "hf_classifier", "demo"}
    assert known <= set(REWARDS)
    for name in REWARDS:
        info = registry.info("reward", name)
        assert info.summary
        if name != "demo":
            assert info.source and "arXiv:" in info.source
            assert info.formula.startswith("r = ")
    assert registry.info("reward", "demo").params.model_fields == {}
    # registered lazily (loading a component replaces the string: ask a fresh registry)
    assert build_registry().info("reward", "demo").entry.factory == "ppokit.tasks.demo"


def test_registry_round_trip_and_defaults() -> None:
    registry = get_registry()
    reward = registry.create("reward", "math_verify")
    assert isinstance(reward, MathVerifyReward)
    assert (reward.field, reward.correct, reward.incorrect) == ("answer", 1.0, 0.0)
    assert registry.info("reward", "exact_match").defaults() == {
        "field": "answer",
        "strip": True,
        "case_sensitive": False,
    }
    with pytest.raises(RegistryError, match="unknown: Extra inputs"):
        registry.create("reward", "exact_match", unknown=1)
    data = {
        "reward": [{"name": "math_verify"}, {"name": "length_penalty", "weight": 0.5, "target": 8}]
    }
    assert [r.name for r in Spec.model_validate(data).reward] == ["math_verify", "length_penalty"]
    assert _reward_errors(data) == []
    data["reward"][1]["target"] = -1
    assert [e.split(":")[0] for e in _reward_errors(data)] == ["reward.1.target"]


def _reward_errors(data: dict) -> list[str]:
    """The errors of a spec about its reward slots (other slots are not under test here)."""
    try:
        validate_spec(data)
    except SpecError as exc:
        return [e for e in exc.errors if e.startswith("reward")]
    return []


def test_reward_catalogue_does_not_import_torch() -> None:
    code = (
        "import sys; import ppokit.components.reward as r; "
        "from ppokit.registry import get_registry; "
        "get_registry().info('reward', 'regex').schema(); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_math_verify_reads_a_bare_latex_gold_answer_whole() -> None:
    """``8\\sqrt{10}`` is one number, not 8: a LaTeX gold answer is parsed in math mode."""
    from ppokit.registry import get_registry

    reward = get_registry().create("reward", "math_verify")
    responses = ["\\boxed{8\\sqrt{10}}", "\\boxed{8}"]
    assert reward(["q", "q"], responses, answer=["8\\sqrt{10}"] * 2).tolist() == [1.0, 0.0]
