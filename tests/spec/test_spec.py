"""The spec: the folder of valid and invalid specs with their expected messages, --set
semantics, every error at once with its path, close names and cross-slot requirements."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.registry import get_registry
from ppokit.slots import SLOTS, slot
from ppokit.spec import (
    Spec,
    SpecError,
    apply_overrides,
    load_spec,
    read_spec_file,
    validate_spec,
)
from tests.helpers import InvalidSpec, invalid_specs, valid_specs

pytestmark = pytest.mark.usefixtures("clean_registry")


# ---------------------------------------------------------------------- the spec folder
@pytest.mark.parametrize("path", valid_specs(), ids=lambda p: p.stem)
def test_valid_specs(path: Path) -> None:
    spec = load_spec(path)
    again = validate_spec(yaml.safe_load(spec.to_yaml()))  # round trip through YAML
    assert again.model_dump() == spec.model_dump()


@pytest.mark.parametrize("case", invalid_specs(), ids=lambda c: c.path.stem)
def test_invalid_specs_report_every_expected_error(case: InvalidSpec) -> None:
    assert case.errors, f"{case.path.name} states no expected error"
    with pytest.raises(SpecError) as exc:
        load_spec(case.path)
    errors = exc.value.errors
    assert exc.value.source == str(case.path)
    assert len(errors) == len(case.errors), errors
    for expected in case.errors:
        assert any(expected in line for line in errors), (expected, errors)
    assert all("\n" not in line for line in errors)


def test_the_spec_folder_covers_both_sides() -> None:
    assert len(valid_specs()) >= 5
    cases = invalid_specs()
    assert any(c.schema_rejects for c in cases) and any(not c.schema_rejects for c in cases)


# ---------------------------------------------------------------------- errors
def errors_of(data: Any) -> list[str]:
    with pytest.raises(SpecError) as exc:
        validate_spec(data)
    return exc.value.errors


def test_structural_and_component_errors_come_together() -> None:
    errors = errors_of(
        {
            "advantage": {"name": "grpo", "epz": 1},
            "critic": {"target": "td1"},
            "rollout": {"n": "four"},
            "train": {"rounds": 0},
        }
    )
    assert errors == [
        "rollout.n: Input should be a valid integer, unable to parse string as an integer",
        "train.rounds: Input should be greater than or equal to 1",
        "advantage.epz: Extra inputs are not permitted (did you mean 'eps'?)",
        "critic.target: unknown critic_target 'td1' (did you mean 'td0'?)",
    ]


def test_cross_slot_requirements() -> None:
    assert errors_of({"advantage": "mc"}) == [
        "critic: advantage (mc) needs values from a critic: add a 'critic' section"
    ]
    validate_spec({"advantage": "mc", "critic": {}})
    assert errors_of({"advantage": "dr_grpo", "rollout": {"n": 1}}) == [
        "rollout.n: advantage (dr_grpo) compares responses within a group: "
        "rollout.n must be >= 2, got 1"
    ]
    validate_spec({"advantage": "dr_grpo", "rollout": {"n": 2}})
    validate_spec({"advantage": "remax", "rollout": {"n": 1}})  # baseline: the trainer's job


def test_micro_batch_must_divide_the_minibatch() -> None:
    base = {"advantage": "grpo", "rollout": {"prompts_per_round": 4, "n": 4}}
    validate_spec({**base, "train": {"minibatch_size": 8, "micro_batch_size": 4}})
    assert errors_of({**base, "train": {"minibatch_size": 8, "micro_batch_size": 3}}) == [
        "train.micro_batch_size: must divide the minibatch of 8 responses, got 3"
    ]


def test_not_a_mapping_and_files() -> None:
    assert errors_of(["x"]) == ["the spec must be a mapping, got list"]
    with pytest.raises(SpecError, match="file not found"):
        read_spec_file("/nonexistent/spec.yaml")


def test_empty_file_means_defaults(tmp_spec: Any) -> None:
    assert read_spec_file(tmp_spec("")) == {}


# ---------------------------------------------------------------------- --set
@pytest.mark.parametrize(
    "written",
    [None, "lambda_return", {"name": "lambda_return"}, {"name": "lambda_return", "gamma": 0.99}],
    ids=["absent", "name", "mapping", "mapping-with-params"],
)
def test_set_a_parameter_whatever_the_slot_looks_like(written: Any) -> None:
    critic = {} if written is None else {"target": written}
    data = {"advantage": "gae", "critic": critic}
    spec = validate_spec(apply_overrides(data, ["critic.target.lam=0.9"]))
    assert spec.critic is not None and spec.critic.target.name == "lambda_return"
    assert spec.critic.target.params["lam"] == 0.9
    if isinstance(written, dict) and "gamma" in written:
        assert spec.critic.target.params["gamma"] == 0.99


def test_the_defaults_form_a_valid_spec() -> None:
    spec = validate_spec({})
    assert spec.advantage.name == slot("advantage").default


def test_set_swaps_a_component_and_drops_its_params() -> None:
    data = {"advantage": {"name": "gae", "lam": 0.9}, "critic": {}}
    spec = validate_spec(apply_overrides(data, ["advantage=rloo"]))
    assert (spec.advantage.name, spec.advantage.params) == ("rloo", {})
    assert data["advantage"] == {"name": "gae", "lam": 0.9}  # the input is not modified


def test_set_in_nested_slots_lists_and_sections() -> None:
    data = {"reward": ["math_verify", {"name": "length_penalty", "target": 8}]}
    out = apply_overrides(
        data,
        [
            "reward.1.weight=0.5",
            "reward.0.weight=2",
            "critic.target.lam=0.5",
            "kl.estimator=k3",
            "model.tiny={num_hidden_layers: 3}",
            "output.dir=runs/x",
            "seed=3",
            "advantage=grpo",
        ],
    )
    spec = validate_spec(out)
    assert [(r.name, r.weight) for r in spec.reward] == [
        ("math_verify", 2),
        ("length_penalty", 0.5),
    ]
    assert spec.critic is not None and spec.critic.target.name == "lambda_return"
    assert spec.critic.target.params == {"lam": 0.5}
    assert spec.kl is not None and spec.kl.estimator.name == "k3"
    assert spec.model.tiny.num_hidden_layers == 3
    assert (spec.output.dir, spec.seed) == ("runs/x", 3)


def test_set_single_reward_without_index() -> None:
    spec = validate_spec(apply_overrides({"advantage": "grpo"}, ["reward.weight=3"]))
    assert [(r.name, r.weight) for r in spec.reward] == [("demo", 3)]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("advantage", "expected path=value"),
        ("=3", "expected path=value"),
        ("a..b=1", "expected path=value"),
        ("seed.x=1", "seed is not a mapping"),
        ("reward.7.weight=1", "index 7 is out of range: reward has 2 item"),
        ("reward.weight=1", "reward has 2 items; use reward.N"),
    ],
)
def test_bad_overrides(override: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        apply_overrides({"seed": 1, "reward": ["demo", "demo"]}, [override])


def test_every_bad_override_is_reported() -> None:
    with pytest.raises(SpecError) as exc:
        apply_overrides({}, ["x", "y"])
    assert len(exc.value.errors) == 2


def test_load_spec_with_overrides_reports_the_file(tmp_spec: Any) -> None:
    path = tmp_spec("advantage: grpo\n")
    assert load_spec(path, ["rollout.n=8"]).rollout.n == 8
    with pytest.raises(SpecError) as exc:
        load_spec(path, ["rollout.n=1"])
    assert exc.value.source == str(path)
    assert str(exc.value).startswith(f"{path}: rollout.n:")


# ---------------------------------------------------------------------- properties
SCALARS = st.one_of(
    st.integers(-5, 5),
    st.floats(-2, 2, allow_nan=False),
    st.booleans(),
    st.sampled_from(["x", "y z"]),
)


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from(sorted(s.path for s in SLOTS if s.path != "reward")),
    st.sampled_from(["absent", "name", "mapping"]),
    st.from_regex(r"[a-z][a-z_]{0,8}", fullmatch=True).filter(lambda k: k != "name"),
    SCALARS,
)
def test_set_reaches_the_slot_parameter(slot: str, form: str, key: str, value: Any) -> None:
    """After ``--set SLOT.KEY=V``, the parsed slot holds KEY=V and keeps its component."""
    section, _, leaf = slot.rpartition(".")
    default = Spec().model_dump()
    default_name = (default[section] or {}).get(leaf) if section else default[leaf]
    name = default_name or {"kl.estimator": "k1"}.get(slot, "lambda_return")
    if slot.startswith("critic."):
        name = {"target": "lambda_return", "mask": "response", "weight": "uniform",
                "loss": "mse", "aggregation": "token_mean"}[leaf]  # fmt: skip
    data: dict[str, Any] = {}
    if form != "absent":
        written: Any = name if form == "name" else {"name": name}
        if section:
            data[section] = {leaf: written}
        else:
            data[leaf] = written
    out = apply_overrides(
        data, [f"{slot}.{key}={yaml.safe_dump(value).strip().removesuffix('...').strip()}"]
    )
    node: Any = out
    for part in slot.split("."):
        node = node[part]
    assert node["name"] == name
    assert node[key] == value


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_choice_of_registered_components_validates(data: st.DataObject) -> None:
    """With a critic, a KL section and groups, every registered component without required
    parameters fits its slot, and the spec survives a YAML round trip."""
    registry = get_registry()

    def pick(kind: str) -> str:
        names = [
            i.name
            for i in registry.components(kind)
            if not i.params.model_json_schema().get("required")
            # a component whose package is missing is a validation error by design
            and all(importlib.util.find_spec(p) for p, _ in (i.entry.packages if i.entry else ()))
        ]
        return data.draw(st.sampled_from(names), label=kind)

    raw: dict[str, Any] = {"rollout": {"n": 4}, "critic": {}, "policy": {}, "kl": {}}
    # heads of 32 dimensions, as the demo's: every engine runs them (vLLM's CPU attention too)
    raw["model"] = {"tiny": {"num_attention_heads": 2, "num_key_value_heads": 2}}
    for path, kind in ((s.path, s.kind) for s in SLOTS):
        section, _, leaf = path.rpartition(".")
        (raw[section] if section else raw)[leaf] = pick(kind)
    spec = validate_spec(raw)
    assert {p: c.name for p, _, c in spec.slots()} == {
        p: (raw[p.split(".")[0]][p.split(".")[1]] if "." in p else raw[p])
        for p in (s.path for s in SLOTS)
    }
    assert validate_spec(yaml.safe_load(spec.to_yaml())).model_dump() == spec.model_dump()


@pytest.mark.parametrize(
    ("tiny", "message"),
    [
        ({"n_layer": 2}, "model.tiny.n_layer: Extra inputs are not permitted"),
        ({"hidden_size": 0}, "model.tiny.hidden_size"),
        ({"hidden_size": 30}, "multiple of num_attention_heads"),
    ],
)
def test_the_tiny_models_options_are_checked(tiny: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        validate_spec({"model": {"tiny": tiny}})


def test_an_entrys_check_adds_its_lines_and_a_failing_one_is_a_line(use_registry) -> None:
    """A component's ``check(spec, params)`` runs at validation with its validated
    parameters; one that raises is reported as a line naming it, never a traceback."""
    from tests.helpers import Plugin, Scaled, ScaleParams

    def picky(spec: Any, params: Any) -> list[str]:
        return [] if params.scale < 2 else [f"advantage.scale: too large for {spec.seed}"]

    def broken(spec: Any, params: Any) -> list[str]:
        raise KeyError("oops")

    use_registry(
        Plugin()
        .add("advantage", "picky", Scaled, params=ScaleParams, check=picky)
        .add("advantage", "broken", Scaled, params=ScaleParams, check=broken)
    )
    validate_spec({"advantage": {"name": "picky", "scale": 1.0}})
    with pytest.raises(SpecError) as err:
        validate_spec({"advantage": {"name": "picky", "scale": 3.0}, "seed": 7})
    assert err.value.errors == ["advantage.scale: too large for 7"]
    with pytest.raises(SpecError) as err:
        validate_spec({"advantage": "broken"})
    assert err.value.errors == [
        "advantage: the check of advantage 'broken' failed: KeyError('oops')"
    ]
