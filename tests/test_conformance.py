"""``ppokit check`` and ``ppokit.testing``: every built-in component holds every property
of its kind; broken components, registered by a test plugin, fail the property they break
(and only it) with a one-line counterexample, through the Python API and the CLI."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ppokit.catalogue import Component, NoParams
from ppokit.cli import app
from ppokit.conformance import parse_params, resolve
from ppokit.registry import BUILTIN_PLUGIN, RegistryError, get_registry
from ppokit.testing import Result, assert_conforms, check_component
from tests.helpers import Plugin
from tests.helpers.components import REQUIRED

runner = CliRunner()
#: Few examples: the properties are simple and the broken components break them everywhere.
EXAMPLES = 5


def invoke(*args: str) -> Any:
    return runner.invoke(app, list(args), catch_exceptions=False)


# ---------------------------------------------------------------------- broken components
class ReadsPadding:
    """An advantage that sums each whole row, padded positions included."""

    def __call__(self, batch: Any) -> torch.Tensor:
        total = batch.token_rewards.float().sum(dim=1, keepdim=True)
        return torch.where(batch.response_mask, total, 0.0)


class Float64:
    """An advantage in float64: the rewards under the mask."""

    def __call__(self, batch: Any) -> torch.Tensor:
        return torch.where(batch.response_mask, batch.token_rewards.double(), 0.0)


class IgnoresMask:
    """A policy loss that forgets its mask: nonzero (and a gradient) at padded positions."""

    def __call__(self, logp: Any, logp_old: Any, adv: Any, mask: Any) -> torch.Tensor:
        return -(adv.float() * torch.exp(logp.float() - logp_old.float()))


class Undeclared:
    """An advantage that reads values without declaring them in ``requires``."""

    def __call__(self, batch: Any) -> torch.Tensor:
        return torch.where(batch.response_mask, batch.values.float(), 0.0)


BROKEN = {
    ("advantage", "undeclared"): (Undeclared, {"requires"}),
    ("advantage", "reads_padding"): (ReadsPadding, {"padding"}),
    ("advantage", "float64"): (Float64, {"contract"}),
    ("policy_loss", "ignores_mask"): (IgnoresMask, {"masked_zero", "gradient"}),
}


def broken_plugin() -> Plugin:
    plugin = Plugin()
    for (kind, name), (factory, _) in BROKEN.items():
        plugin.add(Component(kind, name, factory, params=NoParams, summary=factory.__doc__ or ""))
    return plugin


@pytest.fixture
def broken(use_registry: Any) -> Any:
    return use_registry(broken_plugin())


# ---------------------------------------------------------------------- built-ins
BUILTINS = [(i.kind, i.name) for i in get_registry().components() if i.plugin == BUILTIN_PLUGIN]


@pytest.mark.parametrize(("kind", "name"), BUILTINS, ids=[f"{k}/{n}" for k, n in BUILTINS])
def test_every_builtin_holds_every_property(kind: str, name: str) -> None:
    params = REQUIRED.get(kind, {}).get(name, {})
    results = check_component(kind, name, params, examples=EXAMPLES)
    assert [r.line() for r in results if r.failed] == []
    created = results[0]
    assert created.prop == "created"
    if created.status == "not applicable":  # a package it needs or a server it names
        assert "needs" in created.detail or "without a default" in created.detail
    else:
        assert created.status == "held"


def test_the_kinds_properties_are_run() -> None:
    """A tensor kind runs its properties (not only 'created'); light kinds say why not."""
    props = {r.prop: r.status for r in check_component("advantage", "grpo", examples=2)}
    assert props == dict.fromkeys(
        ["created", "contract", "masked_zero", "padding", "empty_rows", "row_order", "requires"],
        "held",
    )
    agg = {r.prop for r in check_component("aggregation", "token_mean", examples=2)}
    assert {"contract", "padding", "gradient", "micro_batches"} <= agg
    light = check_component("reward", "demo")
    assert [r.status for r in light] == ["held", "not applicable"]


# ---------------------------------------------------------------------- broken ones
@pytest.mark.parametrize(("kind", "name"), list(BROKEN), ids=[n for _, n in BROKEN])
def test_a_broken_component_fails_what_it_breaks_and_only_that(
    broken: Any, kind: str, name: str
) -> None:
    results = check_component(kind, name, examples=EXAMPLES)
    failed = {r.prop for r in results if r.failed}
    assert failed == BROKEN[(kind, name)][1], [r.line() for r in results]
    for r in results:
        if r.failed:
            assert "\n" not in r.detail and "Traceback" not in r.detail
            assert r.detail.startswith("B=") and "mask=[" in r.detail, r.detail


def test_the_counterexamples_name_shapes_and_values(broken: Any) -> None:
    by = {
        (r.name, r.prop): r
        for kind, name in BROKEN
        for r in check_component(kind, name, examples=EXAMPLES)
    }
    padding = by[("reads_padding", "padding")].detail
    assert "padded" in padding and "the output at [0, " in padding and "changed from" in padding
    assert "returned float64 [" in by[("float64", "contract")].detail
    assert "expected float32" in by[("float64", "contract")].detail
    assert "output at padded position" in by[("ignores_mask", "masked_zero")].detail
    assert "gradient at padded position" in by[("ignores_mask", "gradient")].detail
    assert "without the fields it does not require (" in by[("undeclared", "requires")].detail


def test_assert_conforms_raises_with_the_counterexample(broken: Any) -> None:
    with pytest.raises(AssertionError, match=r"advantage/float64 contract: failed: B=\d"):
        assert_conforms("advantage", "float64", examples=EXAMPLES)
    assert_conforms("advantage", "gae", examples=EXAMPLES, lam=0.5)


def test_a_component_that_raises_fails_in_one_line(use_registry: Any) -> None:
    def explode(batch: Any) -> Any:
        raise ValueError("no\nway")

    use_registry(Plugin().add("advantage", "explodes", lambda: explode, params=NoParams))
    results = check_component("advantage", "explodes", examples=EXAMPLES)
    contract = next(r for r in results if r.prop == "contract")
    assert contract.failed and "raised ValueError: no" in contract.detail
    assert "\n" not in contract.detail


# ---------------------------------------------------------------------- the CLI
def test_check_a_plugin_fails_with_its_counterexamples(broken: Any) -> None:
    result = invoke("check", "test0", "--examples", str(EXAMPLES))
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    assert any(line.startswith("advantage/reads_padding padding: failed: B=") for line in lines), (
        lines
    )
    assert "advantage/float64 contract: failed: B=" in result.stdout
    assert "policy_loss/ignores_mask masked_zero: failed: B=" in result.stdout
    assert "advantage/reads_padding contract: held" in result.stdout
    assert "Traceback" not in result.output


def test_check_one_component_and_a_kind(broken: Any) -> None:
    one = invoke("check", "advantage/float64", "--examples", "3", "--failed")
    assert one.exit_code == 1
    assert one.stdout.splitlines()[0].startswith("advantage/float64 contract: failed")
    assert len(one.stdout.splitlines()) == 1
    kind = invoke("check", "aggregation", "--examples", "3")
    assert kind.exit_code == 0, kind.output
    assert "aggregation/token_mean micro_batches: held" in kind.stdout


def test_check_with_parameters() -> None:
    result = invoke("check", "policy_loss/cispo:clip_high=0.3", "--examples", "3")
    assert result.exit_code == 0, result.output
    assert "policy_loss/cispo gradient: held" in result.stdout
    skipped = invoke("check", "policy_loss/cispo", "--examples", "3")
    assert skipped.exit_code == 0
    assert "not applicable: parameters without a default: clip_high" in skipped.stdout
    bad = invoke("check", "policy_loss/cispo:clip_high=-1")
    assert bad.exit_code == 1 and "created: failed: policy_loss 'cispo': clip_high" in bad.stdout


def test_check_a_variant_checks_its_components_with_its_parameters() -> None:
    result = invoke("check", "dapo", "--examples", "3")
    assert result.exit_code == 0, result.output
    assert "truncation/soft_overlong gradient: not applicable" in result.stdout or (
        "truncation/soft_overlong contract: held" in result.stdout
    )
    assert "policy_loss/ppo_clip gradient: held" in result.stdout
    assert "group_filter/informative" in result.stdout


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            "advantag",
            "error: unknown target 'advantag': not a plugin, a variant, a kind or KIND/NAME "
            "(did you mean 'advantage'",
        ),
        ("advantage/gea", "error: unknown advantage 'gea' (did you mean 'gae'"),
        ("advantag/gae", "error: unknown component kind 'advantag' (did you mean 'advantage'"),
        ("advantage:lam=1", "error: advantage:lam=1: parameters go with one component"),
        ("advantage/gae:lam", "error: advantage/gae:lam: parameter 'lam' is not name=value"),
    ],
)
def test_an_unknown_target_is_one_red_line(target: str, message: str) -> None:
    result = invoke("check", target)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.strip().startswith(message), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_resolve_names_each_component_once(broken: Any) -> None:
    found = resolve(["test0", "advantage/float64", "policy_loss/ppo_clip:clip_low=0.1"])
    assert found == [
        ("advantage", "undeclared", {}),
        ("advantage", "reads_padding", {}),
        ("advantage", "float64", {}),
        ("policy_loss", "ignores_mask", {}),
        ("policy_loss", "ppo_clip", {"clip_low": 0.1}),
    ]
    assert len(resolve(["aggregation"])) == len(get_registry().names("aggregation"))
    with pytest.raises(RegistryError):
        resolve(["nothing"])
    assert parse_params("a=1,b=x,c=null,d=0.5", "t") == {"a": 1, "b": "x", "c": None, "d": 0.5}


def test_a_result_line() -> None:
    assert Result("advantage", "gae", "padding", "held").line() == "advantage/gae padding: held"
    failed = Result(
        "advantage", "x", "contract", "failed", "B=1 T=1 mask=[1]: returned float64 [1, 1]"
    )
    assert failed.failed and failed.line().endswith(
        ": failed: B=1 T=1 mask=[1]: returned float64 [1, 1]"
    )
