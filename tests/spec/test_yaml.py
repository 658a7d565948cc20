"""How a spec's YAML is read: YAML 1.2's numbers (a YAML 1.1 number that YAML 1.2 reads
otherwise, ``010`` or ``1:00``, is refused naming its path, in a file and in ``--set``),
merge keys whose keys are written again (allowed, the written key wins) beside real
duplicate keys (refused), component names with look-alike letters (refused, the letter named
by its code point) and nesting deep enough to exhaust Python's recursion (one line)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from ppokit.spec import (
    MAX_SPEC_DEPTH,
    SpecError,
    apply_overrides,
    load_spec,
    parse_spec_text,
    validate_spec,
)

pytestmark = pytest.mark.usefixtures("clean_registry")


def errors_of(text: str) -> list[str]:
    with pytest.raises(SpecError) as exc:
        parse_spec_text(text)
    assert all("\n" not in line for line in exc.value.errors)
    return exc.value.errors


# ---------------------------------------------------------------------- numbers
@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            "rollout: {n: 010}",
            "rollout.n: 010 is ambiguous: YAML 1.1 reads it as 8, YAML 1.2 as 10: write 10 or "
            "8, whichever you mean",
        ),
        (
            "train:\n  reward_timeout: 1:00\n",
            "train.reward_timeout: 1:00 is the number 60 in YAML 1.1 and text in YAML 1.2: "
            "write 60 for the number, or quote '1:00' for text",
        ),
        ("seed: 1_000", "seed: 1_000 is the number 1000 in YAML 1.1 and text in YAML 1.2"),
        ("seed: 0b101", "seed: 0b101 is the number 5 in YAML 1.1"),
        ("kl: {coef: 1:30.5}", "kl.coef: 1:30.5 is the number 90.5 in YAML 1.1"),
        ("reward: [demo, {name: demo, weight: 010}]", "reward.1.weight: 010 is ambiguous"),
    ],
)
def test_yaml_1_1_numbers_are_refused_naming_their_path(text: str, error: str) -> None:
    errors = errors_of(text)
    assert len(errors) == 1 and errors[0].startswith(error), errors


def test_every_ambiguous_number_is_reported() -> None:
    assert len(errors_of("seed: 010\nrollout: {n: 1:00, max_new_tokens: 0b1}\n")) == 3


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("07", 7),  # the same in both
        ("09", 9),  # text in YAML 1.1 (not octal), 9 in YAML 1.2
        ("1e-4", 1e-4),  # text in YAML 1.1 (no dot), a float in YAML 1.2
        ("1.0e3", 1000.0),
        ("-.5", -0.5),
        ("0o10", 8),
        ("0x1F", 31),
        ("-12", -12),
        ("'010'", "010"),  # quoted: text
        (".inf", float("inf")),
        ("yes", True),  # booleans are YAML 1.1's still: only numbers changed
        ("0x_", "0x_"),  # YAML 1.1's pattern of a number, but none
    ],
)
def test_yaml_1_2_numbers(text: str, value: Any) -> None:
    read = parse_spec_text(f"x: {text}")["x"]
    assert read == value and type(read) is type(value)


def test_any_number_like_scalar_reads_or_is_one_spec_error() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("0123456789_:.-+eExob") for _ in range(rng.randint(1, 6)))
        for doc in (f"x: {text}", f"{text}: 1", f"x: [{text}]"):
            try:
                parse_spec_text(doc)
            except SpecError as exc:
                assert len(exc.errors) == 1 and "\n" not in exc.errors[0], (doc, exc.errors)


def test_a_spec_with_yaml_1_2_numbers_validates(tmp_spec: Any) -> None:
    spec = load_spec(tmp_spec("train: {actor_lr: 1e-4, critic_lr: 2E-3}\nrollout: {n: 08}\n"))
    assert (spec.train.actor_lr, spec.train.critic_lr, spec.rollout.n) == (1e-4, 2e-3, 8)


def test_set_refuses_yaml_1_1_numbers_too(tmp_spec: Any) -> None:
    with pytest.raises(SpecError) as exc:
        apply_overrides({}, ["rollout.n=010", "train.reward_timeout=1:00", "seed=5"])
    assert exc.value.errors == [
        "--set 'rollout.n=010': rollout.n: 010 is ambiguous: YAML 1.1 reads it as 8, YAML 1.2 "
        "as 10: write 10 or 8, whichever you mean",
        "--set 'train.reward_timeout=1:00': train.reward_timeout: 1:00 is the number 60 in "
        "YAML 1.1 and text in YAML 1.2: write 60 for the number, or quote '1:00' for text",
    ]
    with pytest.raises(SpecError) as exc:
        load_spec(tmp_spec("seed: 1\n"), ["eval.prompts=0100"])
    assert "eval.prompts: 0100 is ambiguous" in str(exc.value)


# ---------------------------------------------------------------------- merge keys
def test_a_merged_key_may_be_written_again() -> None:
    text = """\
base: &base {lam: 0.9, gamma: 1.0}
advantage:
  <<: *base
  name: gae
  lam: 0.5
"""
    assert parse_spec_text(text)["advantage"] == {"lam": 0.5, "gamma": 1.0, "name": "gae"}


def test_merging_several_mappings_the_first_wins() -> None:
    text = "a: &a {x: 1}\nb: &b {x: 2, y: 2}\nc:\n  <<: [*a, *b]\n  z: 3\n"
    assert parse_spec_text(text)["c"] == {"x": 1, "y": 2, "z": 3}


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("a: {x: 1, x: 2}", "duplicate key 'x'"),
        ("base: &b {x: 1}\nc:\n  <<: *b\n  y: 1\n  y: 2\n", "duplicate key 'y' (first on line 4)"),
        ("base: &b {x: 1, x: 2}\nc: {<<: *b}\n", "duplicate key 'x'"),
        ("a: &a {x: 1}\nc: {<<: *a, <<: *a}\n", "duplicate key '<<'"),
    ],
)
def test_real_duplicate_keys_are_refused(text: str, line: str) -> None:
    errors = errors_of(text)
    assert len(errors) == 1 and line in errors[0] and "invalid YAML" in errors[0]


def test_a_merge_key_in_a_spec_file(tmp_spec: Any) -> None:
    spec = load_spec(
        tmp_spec(
            "critic:\n  target: &t {name: lambda_return, gamma: 1.0, lam: 0.95}\n"
            "advantage:\n  <<: *t\n  name: gae\n  lam: 0.9\n"
        )
    )
    assert spec.advantage.name == "gae" and spec.advantage.params == {"gamma": 1.0, "lam": 0.9}


# ---------------------------------------------------------------------- names
@pytest.mark.parametrize(
    ("data", "error"),
    [
        (
            {"advantage": "g\u0430e"},
            "advantage: component name 'g\\u0430e' is not an ASCII identifier (letters, digits "
            "and '_', not starting with a digit): '\\u0430' is U+0430 CYRILLIC SMALL LETTER A",
        ),
        (
            {"advantage": {"name": "\uff47\uff41\uff45", "lam": 0.9}},
            "advantage: component name '\\uff47\\uff41\\uff45' is not an ASCII identifier",
        ),
        (
            {"reward": ["demo", "d\u0435mo"], "kl": {"estimator": "k\u0031\u20e3"}},
            "reward.1: component name 'd\\u0435mo' is not an ASCII identifier",
        ),
    ],
)
def test_look_alike_component_names_are_refused(data: dict[str, Any], error: str) -> None:
    with pytest.raises(SpecError) as exc:
        validate_spec(data)
    assert any(line.startswith(error) for line in exc.value.errors), exc.value.errors
    assert all(line.isascii() for line in exc.value.errors)  # each letter shown by its escape


def test_a_look_alike_name_in_set() -> None:
    with pytest.raises(SpecError) as exc:
        validate_spec(apply_overrides({}, ["advantage=\u0261ae"]))
    assert exc.value.errors[0].startswith("advantage: component name '\\u0261ae'")
    assert "U+0261 LATIN SMALL LETTER SCRIPT G" in exc.value.errors[0]


# ---------------------------------------------------------------------- nesting
@pytest.mark.parametrize(
    "text",
    [
        "x: " + "[" * 10_000 + "]" * 10_000,  # far past Python's recursion limit
        "x: " + "{a: " * 5_000 + "1" + "}" * 5_000,
        "".join("  " * i + f"k{i}:\n" for i in range(MAX_SPEC_DEPTH + 5)) + "  " * 70 + "1\n",
    ],
    ids=["flow-lists", "flow-mappings", "block-mappings"],
)
def test_deep_nesting_is_one_line(text: str) -> None:
    errors = errors_of(text)
    assert errors == [f"line 1: invalid YAML: nested deeper than {MAX_SPEC_DEPTH} levels"] or (
        len(errors) == 1 and f"nested deeper than {MAX_SPEC_DEPTH} levels" in errors[0]
    ), errors


def test_aliases_cannot_nest_past_the_bound() -> None:
    """Each anchor within the bound, each alias of it nested again: the loaded value is far
    deeper than any node as written."""
    lines = ["a0: &a0 " + "[" * 50 + "1" + "]" * 50]
    lines += [f"a{i}: &a{i} " + "[" * 50 + f"*a{i - 1}" + "]" * 50 for i in range(1, 40)]
    errors = errors_of("\n".join(lines))
    assert len(errors) == 1 and "deeper than" in errors[0]


def test_deep_values_from_python_and_set() -> None:
    deep: Any = 1
    for _ in range(5_000):
        deep = [deep]
    with pytest.raises(SpecError, match=f"nests deeper than {MAX_SPEC_DEPTH} levels"):
        validate_spec({"advantage": {"name": "gae", "lam": deep}})
    with pytest.raises(SpecError) as exc:
        apply_overrides({}, ["advantage.lam=" + "[" * 3_000 + "]" * 3_000])
    assert exc.value.errors[0].endswith(f"nested deeper than {MAX_SPEC_DEPTH} levels")


def test_the_depth_bound_is_exact() -> None:
    """The top mapping, the lists and the value are MAX_SPEC_DEPTH levels: read; one more:
    refused."""
    lists = MAX_SPEC_DEPTH - 2
    value = parse_spec_text("x: " + "[" * lists + "1" + "]" * lists)["x"]
    for _ in range(lists):
        value = value[0]
    assert value == 1
    errors_of("x: " + "[" * (lists + 1) + "1" + "]" * (lists + 1))
