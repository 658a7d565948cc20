"""Registry behaviour: lookup, errors with close names, conflicts, lazy factories, params from
signatures, plugin isolation, and the PPOKIT_* environment switches (through fake entry
points; the real ones are exercised in test_plugins.py)."""

from __future__ import annotations

import sys
import textwrap
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

import ppokit.registry as registry_module
from ppokit.catalogue import Component
from ppokit.hookspecs import hookimpl
from ppokit.registry import (
    KINDS,
    Registry,
    RegistryError,
    build_registry,
    get_registry,
    reset_registry,
    suggest,
)
from tests.helpers import Plugin, Scaled, ScaleParams, shifted


def defined_entries() -> dict[str, set[str]]:
    """The names of every Component entry the kind packages and the tasks define (found in
    the modules, not copied here), by kind."""
    from ppokit import tasks
    from ppokit.components import KIND_PACKAGES

    found: dict[str, set[str]] = {}
    for package in KIND_PACKAGES:
        for value in vars(package).values():
            if isinstance(value, Component):
                found.setdefault(value.kind, set()).add(value.name)
    for value in tasks.COMPONENTS:  # the tasks' own sources and rewards
        found.setdefault(value.kind, set()).add(value.name)
    return found


BUILTIN_NAMES = defined_entries()


def registry_with(*plugins: Plugin) -> Registry:
    registry = Registry()
    for i, plugin in enumerate(plugins):
        registry.load_plugin(f"p{i}", plugin)
    return registry


# ---------------------------------------------------------------------- lookup
def test_builtins_are_registered_and_torch_free(clean_registry: None) -> None:
    registry = get_registry()
    builtins = {
        kind: {i.name for i in registry.components(kind) if i.plugin == "ppokit"} for kind in KINDS
    }
    # every entry a kind package defines is registered, and nothing else is built in
    assert builtins == {kind: BUILTIN_NAMES.get(kind, set()) for kind in KINDS}
    assert all(builtins.values()), "a kind without a built-in"
    for info in registry.components():
        assert info.plugin, info.name
        assert info.summary, f"{info.kind} {info.name} has no summary"
        assert info.formula, f"{info.kind} {info.name}: the catalogue gives no formula"
        if (info.kind, info.name) != ("reward", "demo"):  # the demo task has no paper
            assert info.source, f"{info.kind} {info.name} names no source"
        assert info.lazy, f"{info.kind} {info.name} is not lazy"
        assert issubclass(info.params, BaseModel)
    assert registry.plugins["ppokit"].ok


def test_lookup_and_order() -> None:
    registry = registry_with(
        Plugin()
        .add("policy_loss", "zeta", Scaled, summary="last")
        .add("advantage", "beta", Scaled)
        .add(
            "advantage",
            "alpha",
            Scaled,
            params=ScaleParams,
            formula="y = s·x",
            requires=("group_ids",),
        )
    )
    assert registry.names("advantage") == ["alpha", "beta"]
    assert [(i.kind, i.name) for i in registry.components()] == [
        ("advantage", "alpha"),
        ("advantage", "beta"),
        ("policy_loss", "zeta"),
    ]
    info = registry.info("advantage", "alpha")
    assert (info.plugin, info.formula, info.requires) == ("p0", "y = s·x", ("group_ids",))
    # every fact is the entry's: a factory's docstring or attributes state none
    assert registry.info("policy_loss", "zeta").summary == "last"
    beta = registry.info("advantage", "beta")
    assert (beta.summary, beta.formula, beta.requires) == ("", "", ())
    assert registry.has("advantage", "beta") and not registry.has("advantage", "gamma")


def test_unknown_kind_and_name_list_close_names() -> None:
    registry = registry_with(
        Plugin().add("advantage", "grpo", Scaled).add("advantage", "gae", Scaled)
    )
    with pytest.raises(
        RegistryError, match=r"unknown component kind 'advantag' \(did you mean 'advantage'"
    ):
        registry.info("advantag", "gae")
    with pytest.raises(RegistryError, match=r"unknown advantage 'gea' \(did you mean 'gae'"):
        registry.info("advantage", "gea")
    with pytest.raises(RegistryError) as exc:
        registry.info("advantage", "zzzzzz")
    assert "did you mean" not in str(exc.value)
    with pytest.raises(RegistryError, match="unknown component kind"):
        registry.names("advantages_")


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(BUILTIN_NAMES["advantage"])), st.integers(0, 10))
def test_one_typo_suggests_the_name(name: str, position: int) -> None:
    """Dropping one character of a registered name suggests that name."""
    i = position % len(name)
    typo = name[:i] + name[i + 1 :]
    if typo in BUILTIN_NAMES["advantage"]:
        return
    assert repr(name) in suggest(typo, BUILTIN_NAMES["advantage"])


# ---------------------------------------------------------------------- conflicts
def test_duplicate_names_across_plugins_name_both_providers() -> None:
    registry = registry_with(
        Plugin().add("advantage", "dup", Scaled).add("advantage", "mine", Scaled),
        Plugin().add("advantage", "dup", shifted),
    )
    with pytest.raises(
        RegistryError, match=r"advantage 'dup' is registered by more than one plugin \(p0, p1\)"
    ):
        registry.info("advantage", "dup")
    assert "dup" not in registry.names("advantage")  # no silent override
    assert registry.info("advantage", "mine").plugin == "p0"  # the rest stays usable
    assert registry.conflict_errors() == [
        "advantage 'dup' is registered by more than one plugin: p0, p1"
    ]


def test_same_name_twice_in_one_plugin_fails_that_plugin() -> None:
    registry = registry_with(
        Plugin().add("advantage", "twice", Scaled).add("advantage", "twice", Scaled),
        Plugin().add("advantage", "fine", Scaled),
    )
    assert "registered twice" in (registry.plugins["p0"].error or "")
    assert registry.names("advantage") == ["fine"]


# ---------------------------------------------------------------------- factories and params
LAZY = Component("advantage", "lazy", "lazy_component_mod", params=ScaleParams, formula="f")
LAZY_SIG = Component("advantage", "lazy_sig", "lazy_component_mod")


def test_lazy_factory_is_imported_only_on_create(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "lazy_component_mod.py").write_text(
        textwrap.dedent(
            '''
            from tests.registry.test_registry import LAZY, LAZY_SIG


            @LAZY_SIG.implementation
            class Lazy:
                """y = k x"""

                def __init__(self, k: int = 3) -> None:
                    self.k = k


            @LAZY.implementation
            class Scaled(Lazy):
                def __init__(self, scale: float) -> None:
                    self.scale = scale
            '''
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_component_mod", raising=False)
    registry = registry_with(Plugin().add(LAZY).add(LAZY_SIG))
    info = registry.info("advantage", "lazy")
    assert info.defaults() == {"scale": 1.0}
    assert info.as_dict()["formula"] == "f"
    assert "lazy_component_mod" not in sys.modules
    # without a params model, reading the parameters needs the signature: now it is imported
    assert registry.info("advantage", "lazy_sig").defaults() == {"k": 3}
    assert "lazy_component_mod" in sys.modules
    assert registry.create("advantage", "lazy_sig", k=5).k == 5
    # the docstring @LAZY_SIG.implementation wrote is the entry's, which states no formula
    assert registry.info("advantage", "lazy_sig").formula == ""
    assert registry.create("advantage", "lazy", scale=2.0).scale == 2.0  # each its own


def test_lazy_factory_that_cannot_be_imported() -> None:
    registry = registry_with(Plugin().add("advantage", "ghost", "ppokit_no_such_mod"))
    with pytest.raises(RegistryError, match="advantage 'ghost' \\(plugin p0\\) cannot be imported"):
        registry.create("advantage", "ghost")
    unmarked = registry_with(Plugin().add("advantage", "ghost", "textwrap"))
    with pytest.raises(RegistryError, match="module 'textwrap' marks no implementation"):
        unmarked.create("advantage", "ghost")
    bad = registry_with(Plugin().add("advantage", "ghost", "not a module"))
    assert "'not a module' is not a module name" in (bad.plugins["p0"].error or "")
    # a factory is a module's name: "module:attr" is not one
    attr = registry_with(Plugin().add("advantage", "older", "textwrap:dedent"))
    assert "'textwrap:dedent' is not a module name" in (attr.plugins["p0"].error or "")


def test_register_takes_one_entry() -> None:
    registry = registry_with(Plugin().add("advantage", "early", Scaled))
    assert registry.names("advantage") == ["early"]

    class Old:
        def __init__(self, *args: Any) -> None:
            self.args = args

        @hookimpl
        def ppokit_register(self, register: Any) -> None:
            register(*self.args)

    for args in [("advantage", "late", Scaled), (Component("advantage", "x", Scaled), "more")]:
        record = Registry().load_plugin("old", Old(*args))
        assert "register(entry) takes one ppokit.Component" in (record.error or ""), args


def test_params_from_the_signature() -> None:
    registry = registry_with(Plugin().add("reward", "shift", shifted))
    info = registry.info("reward", "shift")
    assert set(info.params.model_fields) == {"offset", "width"}
    assert info.defaults() == {"width": 2}
    assert info.schema()["required"] == ["offset"]
    assert registry.create("reward", "shift", offset=1.5)(1.0) == 4.0
    with pytest.raises(RegistryError, match="offset: Field required"):
        registry.create("reward", "shift")
    with pytest.raises(RegistryError, match="widht: Extra inputs are not permitted"):
        registry.create("reward", "shift", offset=1, widht=3)
    with pytest.raises(RegistryError, match="width: Input should be a valid integer"):
        registry.create("reward", "shift", offset=1, width="many")


@settings(max_examples=60, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False, width=32))
def test_create_accepts_exactly_the_params_in_bounds(scale: float) -> None:
    registry = registry_with(Plugin().add("advantage", "scaled", Scaled, params=ScaleParams))
    if 0 < scale <= 10:
        assert registry.create("advantage", "scaled", scale=scale).scale == scale
    else:
        with pytest.raises(RegistryError, match="advantage 'scaled': scale: Input should be"):
            registry.create("advantage", "scaled", scale=scale)


# ---------------------------------------------------------------------- broken plugins
@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("advantages", "x", Scaled), {}, "unknown component kind 'advantages'"),
        (("advantage", "not a name", Scaled), {}, "is not an ASCII identifier"),
        (("advantage", "x", 42), {}, "factory must be callable"),
        (("advantage", "x", Scaled), {"params": dict}, "params must be a pydantic model"),
        (("advantage", "x", Scaled), {"requires": ("valuez",)}, "unknown batch field 'valuez'"),
    ],
)
def test_bad_registration_fails_only_its_plugin(
    args: tuple[object, ...], kwargs: dict[str, object], message: str
) -> None:
    registry = registry_with(
        Plugin().add("advantage", "early", Scaled).add(*args, **kwargs),
        Plugin().add("advantage", "other", Scaled),
    )
    assert message in (registry.plugins["p0"].error or "")
    assert registry.names("advantage") == ["other"]  # p0 committed nothing


def test_hook_that_raises_and_bad_hooks_are_isolated() -> None:
    class WrongSignature:
        @hookimpl
        def ppokit_register(self, register: object, extra: object) -> None: ...

    class UnknownHook:
        @hookimpl
        def ppokit_registr(self, register: object) -> None: ...

    raising = Plugin(fail_with=RuntimeError("boom")).add("advantage", "partial", Scaled)
    registry = Registry()
    registry.load_plugin("raising", raising)
    registry.load_plugin("wrong", WrongSignature())
    registry.load_plugin("unknown", UnknownHook())
    registry.load_plugin("good", Plugin().add("advantage", "good", Scaled))
    errors = {p.name: p.error for p in registry.failed}
    assert errors["raising"] == "RuntimeError: boom"
    assert "extra" in errors["wrong"]
    assert "unknown hook 'ppokit_registr'" in errors["unknown"]
    assert registry.names("advantage") == ["good"]
    assert registry.plugins["good"].ok
    assert "RuntimeError: boom" in (registry.plugins["raising"].traceback or "")


# ---------------------------------------------------------------------- entry points and switches
PLUGIN_MODULES = {
    "ppk_good_a": 'from tests.helpers import Plugin, Scaled\nplugin = Plugin().add("advantage", "from_a", Scaled)\n',
    "ppk_good_b": 'from tests.helpers import Plugin, Scaled\nplugin = Plugin().add("advantage", "from_b", Scaled)\n',
    "ppk_broken": "import ppk_missing_dependency\nplugin = None\n",
    "ppk_clash": 'from tests.helpers import Plugin, Scaled\nplugin = Plugin().add("advantage", "from_a", Scaled)\n',
}


@pytest.fixture
def fake_entry_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_registry: None
) -> None:
    """The ``ppokit`` entry-point group holds good_a, good_b and broken (modules in tmp_path)."""
    for module, code in PLUGIN_MODULES.items():
        (tmp_path / f"{module}.py").write_text(code)
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [
        EntryPoint("good_a", "ppk_good_a:plugin", "ppokit"),
        EntryPoint("good_b", "ppk_good_b:plugin", "ppokit"),
        EntryPoint("broken", "ppk_broken:plugin", "ppokit"),
    ]
    monkeypatch.setattr(
        registry_module.plugins, "entry_points", lambda group: eps if group == "ppokit" else []
    )


def test_entry_points_load_and_a_broken_one_is_recorded(fake_entry_points: None) -> None:
    registry = build_registry()
    assert {"from_a", "from_b", "gae"} <= set(registry.names("advantage"))
    assert registry.info("advantage", "from_a").plugin == "good_a"
    broken = registry.plugins["broken"]
    assert not broken.ok and "ppk_missing_dependency" in (broken.error or "")
    assert [p.name for p in registry.failed] == ["broken"]


def test_strict_plugins_makes_a_broken_plugin_fatal(
    fake_entry_points: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PPOKIT_STRICT_PLUGINS", "1")
    with pytest.raises(RegistryError, match="plugin broken: ModuleNotFoundError"):
        build_registry()
    with pytest.raises(RegistryError, match="plugin broken"):
        get_registry()
    monkeypatch.setenv("PPOKIT_STRICT_PLUGINS", "0")
    assert build_registry().has("advantage", "from_b")


def test_strict_plugins_makes_a_conflict_fatal(
    fake_entry_points: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    eps = [
        EntryPoint("good_a", "ppk_good_a:plugin", "ppokit"),
        EntryPoint("clash", "ppk_clash:plugin", "ppokit"),
    ]
    monkeypatch.setattr(registry_module.plugins, "entry_points", lambda group: eps)
    assert not build_registry().has("advantage", "from_a")
    with pytest.raises(
        RegistryError,
        match=r"advantage 'from_a' is registered by more than one plugin: clash, good_a",
    ):
        build_registry(strict=True)


@pytest.mark.parametrize(
    ("switch", "loaded"),
    [
        ("", set()),
        ("good_a", {"good_a"}),
        ("good_b, good_a", {"good_a", "good_b"}),
        ("broken,good-b", {"broken", "good_b"}),
    ],
)
def test_load_plugins_selects_by_name(
    fake_entry_points: None, monkeypatch: pytest.MonkeyPatch, switch: str, loaded: set[str]
) -> None:
    monkeypatch.setenv("PPOKIT_LOAD_PLUGINS", switch)
    registry = build_registry()
    assert set(registry.plugins) == {"ppokit", *loaded}
    assert registry.has("advantage", "gae")  # the built-ins always load
    assert registry.has("advantage", "from_a") == ("good_a" in loaded)


def test_reset_registry_rebuilds(fake_entry_points: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPOKIT_LOAD_PLUGINS", "")
    first = get_registry()
    assert get_registry() is first and not first.has("advantage", "from_a")
    monkeypatch.setenv("PPOKIT_LOAD_PLUGINS", "good_a")
    reset_registry()
    assert get_registry().has("advantage", "from_a")


def test_requirements_are_the_optional_batch_fields() -> None:
    """The torch-free registry repeats RolloutBatch's optional fields: keep them equal."""
    from ppokit.batch import FIELDS
    from ppokit.registry import REQUIREMENTS

    assert set(REQUIREMENTS) == set(FIELDS) - {"response_mask", "token_rewards"}


def test_every_builtin_cites_its_papers_from_the_table(clean_registry: None) -> None:
    """A paper a built-in names (its arXiv id or address) is cited in the table's words."""
    from ppokit.papers import PAPERS

    by_where = {p.where: p for p in PAPERS.values() if p.where}
    assert len(by_where) == len([p for p in PAPERS.values() if p.where])  # each paper once
    for info in get_registry().components():
        if info.plugin != "ppokit":
            continue
        for where, paper in by_where.items():
            if where in info.source:
                assert str(paper) in info.source, (info.kind, info.name, where)
