"""The JSON Schema of ``ppokit schema`` against jsonschema: the valid specs match it, the
structurally invalid ones do not, and each slot lists exactly the registered components."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ppokit.registry import KINDS, Registry, get_registry
from ppokit.schema import component_schema, spec_schema
from ppokit.spec import validate_spec
from ppokit.spec.compose import compose
from tests.helpers import (
    ROOT,
    InvalidSpec,
    Plugin,
    Scaled,
    ScaleParams,
    invalid_specs,
    shifted,
    valid_specs,
)

pytestmark = pytest.mark.usefixtures("clean_registry")


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = spec_schema(get_registry())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def example_specs() -> list[Path]:
    return sorted((ROOT / "examples" / "specs").glob("*.yaml"))


@pytest.mark.parametrize("path", valid_specs() + example_specs(), ids=lambda p: p.stem)
def test_valid_specs_match_the_schema(validator: Any, path: Path) -> None:
    errors = [e.message for e in validator.iter_errors(yaml.safe_load(path.read_text()))]
    assert errors == []


@pytest.mark.parametrize("case", invalid_specs(), ids=lambda c: c.path.stem)
def test_structurally_invalid_specs_do_not(validator: Any, case: InvalidSpec) -> None:
    try:
        data = yaml.safe_load(case.path.read_text())
    except yaml.YAMLError:
        pytest.skip("not YAML: nothing for a schema to check")
    assert validator.is_valid(data) != case.schema_rejects


def test_every_slot_offers_the_registered_names(validator: Any) -> None:
    registry = get_registry()
    defs = validator.schema["$defs"]
    for kind in KINDS:
        options = defs[f"component.{kind}"]["anyOf"]
        named = [o for o in options[1:] if "name" in o["properties"]]
        objects = {o["properties"]["name"]["const"] for o in named}
        assert objects == set(registry.names(kind)), kind
        assert len(options) == 1 + 2 * len(named), kind  # each also in its nameless form
        bare = set(options[0]["enum"])
        required = {i.name for i in registry.components(kind) if i.schema().get("required")}
        assert bare == set(registry.names(kind)) - required, kind
    assert "ComponentSpec" not in defs and "RewardSpec" not in defs


@settings(max_examples=60, deadline=None)
@given(st.floats(-20, 20, allow_nan=False), st.sampled_from(["scale", "scal", "name2"]))
def test_component_objects_follow_the_params_model(value: float, key: str) -> None:
    """The schema accepts a component object exactly when the registry's validation does."""
    registry = Registry()
    registry.load_plugin("t", Plugin().add("advantage", "scaled", Scaled, params=ScaleParams))
    defs: dict[str, Any] = {}
    schema = {**component_schema("advantage", registry, defs), "$defs": defs}
    obj = {"name": "scaled", key: value}
    try:
        registry.info("advantage", "scaled").validate({key: value})
        ok = True
    except ValidationError:
        ok = False
    assert jsonschema.Draft202012Validator(schema).is_valid(obj) == ok


def test_required_params_and_nested_models(use_registry: Any) -> None:
    from pydantic import BaseModel

    class Inner(BaseModel):
        k: int = 1

    class Outer(BaseModel):
        inner: Inner = Inner()

    use_registry(
        Plugin()
        .add("advantage", "needs_offset", shifted)
        .add("advantage", "nested", Scaled, params=Outer)
    )
    schema = spec_schema()
    v = jsonschema.Draft202012Validator(schema)
    assert not v.is_valid({"advantage": "needs_offset"})
    assert v.is_valid({"advantage": {"name": "needs_offset", "offset": 1.0}})
    assert v.is_valid({"advantage": {"name": "nested", "inner": {"k": 2}}})
    assert not v.is_valid({"advantage": {"name": "nested", "inner": {"k": "x"}}})
    validate_spec({"advantage": {"name": "nested", "inner": {"k": 2}}})


def test_a_nameless_mapping_is_the_slots_parameters(validator: Any) -> None:
    """Parameters without a name, merged into the component a variant or task names: the
    schema accepts a known parameter and refuses an unknown one, as composing does."""
    source = {"config": {"min_terms": 2}, "instruction": ""}
    spec = {"variant": "grpo", "task": "rg_chain_sum", "data": {"source": source}}
    assert validator.is_valid(spec)
    validate_spec(compose(spec).data)
    assert not validator.is_valid({**spec, "data": {"source": {"config_typo": {}}}})
    assert not validator.is_valid({**spec, "data": {"source": {}}})


def test_reward_accepts_a_name_an_object_with_weight_or_a_list(validator: Any) -> None:
    good = [
        {"reward": "demo"},
        {"reward": {"name": "demo", "weight": 2}},
        {"reward": ["demo", {"name": "regex", "pattern": "x", "weight": 0.5}]},
    ]
    bad = [{"reward": []}, {"reward": {"name": "regex"}}, {"reward": {"name": "demo", "wieght": 1}}]
    assert all(validator.is_valid(d) for d in good)
    assert not any(validator.is_valid(d) for d in bad)
    # no reward is for an environment's rewards only
    assert validator.is_valid({"reward": [], "rollout": {"environment": "echo"}})
    assert validator.is_valid({"reward": [], "rollout": {"environment": {"name": "echo"}}})
    for none in ("none", {"name": "none"}):
        assert not validator.is_valid({"reward": [], "rollout": {"environment": none}})
    assert not validator.is_valid({"reward": [], "rollout": {"n": 2}})
