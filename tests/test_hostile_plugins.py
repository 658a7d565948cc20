"""Plugins cannot take the command line down: installed hostile plugins (one that calls
``sys.exit`` at import, one whose lazy factory names a missing attribute, one that prints to
standard output) are isolated and reported like any other broken plugin, and the CLI's JSON
output stays parseable. Also the environment switches: boolean words and unknown names."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

import ppokit
from ppokit.catalogue import Component
from ppokit.registry import Registry, RegistryError, build_registry, env_flag
from tests.helpers import Venv, write_plugin_dist

EXITS = """\
import sys
sys.exit(3)  # a plugin that ends the program when imported
"""

MISSING_ATTR = """\
import ppokit


@ppokit.hookimpl
def ppokit_register(register):
    # no params model: the schema must import the factory, and the attribute is missing
    register(ppokit.Component("advantage", "ghost", "ppokit_missing_attr:NoSuchClass"))
"""

PRINTS = """\
import ppokit

print("hello from a plugin")


@ppokit.hookimpl
def ppokit_register(register):
    register(ppokit.Component("advantage", "chatty", "ppokit_prints:X"))
"""


@pytest.fixture(scope="module")
def hostile_venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    root = tmp_path_factory.mktemp("hostile")
    venv = Venv(root / "env")
    dists = root / "dists"
    venv.install(
        write_plugin_dist(dists, "ppokit-exits", "ppokit_exits", EXITS, "exits"),
        write_plugin_dist(
            dists, "ppokit-missing-attr", "ppokit_missing_attr", MISSING_ATTR, "missing_attr"
        ),
        write_plugin_dist(dists, "ppokit-prints", "ppokit_prints", PRINTS, "prints"),
    )
    return venv


@pytest.mark.slow
def test_list_json_and_schema_survive(hostile_venv: Venv) -> None:
    listed = hostile_venv.ppokit("list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)  # nothing a plugin printed is in it
    names = {r["name"] for r in rows}
    assert {"gae", "grpo", "ghost"} <= names and "chatty" not in names
    assert "Traceback" not in listed.stderr
    show = hostile_venv.ppokit("show", "advantage", "ghost")  # listing imports no factory
    assert show.returncode != 0 and "NoSuchClass" in show.stderr
    assert "Traceback" not in show.stderr
    schema = hostile_venv.ppokit("schema")
    assert schema.returncode == 0, schema.stderr
    advantages = json.dumps(json.loads(schema.stdout)["$defs"]["component.advantage"])
    assert '"grpo"' in advantages and "ghost" not in advantages


@pytest.mark.slow
def test_the_hostile_plugins_are_reported(hostile_venv: Venv, tmp_path: Path) -> None:
    result = hostile_venv.ppokit("plugins", "--json")
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    assert "SystemExit: 3" in plugins["exits"]["error"]
    assert "wrote to standard output" in plugins["prints"]["error"]
    assert plugins["missing_attr"]["ok"]  # it loads; its one component cannot be created
    spec = tmp_path / "ghost.yaml"
    spec.write_text("advantage: ghost\nrollout: {n: 2}\n")
    validate = hostile_venv.ppokit("validate", str(spec))
    assert validate.returncode != 0 and "NoSuchClass" in validate.stderr
    assert "Traceback" not in validate.stderr


@pytest.mark.slow
def test_strict_and_filter_switches(hostile_venv: Venv) -> None:
    strict = hostile_venv.ppokit("list", PPOKIT_STRICT_PLUGINS="yes")
    assert strict.returncode == 1 and "plugin exits" in strict.stderr
    loose = hostile_venv.ppokit("list", PPOKIT_STRICT_PLUGINS="off")
    assert loose.returncode == 0
    bad_word = hostile_venv.ppokit("list", PPOKIT_STRICT_PLUGINS="maybe")
    assert bad_word.returncode != 0 and "PPOKIT_STRICT_PLUGINS" in bad_word.stderr
    assert "Traceback" not in bad_word.stderr
    unknown = hostile_venv.ppokit("plugins", "--json", PPOKIT_LOAD_PLUGINS="prints,nosuch")
    plugins = {p["name"]: p for p in json.loads(unknown.stdout)["plugins"]}
    assert "names no installed plugin 'nosuch'" in plugins["nosuch"]["error"]
    assert set(plugins) == {"ppokit", "prints", "nosuch"}


# ------------------------------------------------------------------ in process
@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("1", True),
        ("TRUE", True),
        ("yes", True),
        ("On", True),
        ("0", False),
        ("no", False),
        ("off", False),
        ("false", False),
        ("", False),
    ],
)
def test_boolean_words(monkeypatch: pytest.MonkeyPatch, raw: str, value: bool) -> None:
    monkeypatch.setenv("PPOKIT_STRICT_PLUGINS", raw)
    assert env_flag("PPOKIT_STRICT_PLUGINS") is value


def test_a_bad_boolean_word_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPOKIT_STRICT_PLUGINS", "2")
    with pytest.raises(RegistryError, match="expected one of"):
        build_registry()


def _module(hook: object) -> types.ModuleType:
    module = types.ModuleType("plugin")
    module.ppokit_register = hook  # type: ignore[attr-defined]
    return module


def test_sys_exit_in_the_hook_is_isolated() -> None:
    @ppokit.hookimpl
    def ppokit_register(register: object) -> None:
        raise SystemExit(2)

    registry = Registry()
    record = registry.load_plugin("quits", _module(ppokit_register))
    assert record.error == "SystemExit: 2"


def test_printing_in_the_hook_is_isolated(capsys: pytest.CaptureFixture[str]) -> None:
    @ppokit.hookimpl
    def ppokit_register(register: object) -> None:
        print("noise")

    registry = Registry()
    record = registry.load_plugin("noisy", _module(ppokit_register))
    assert record.error is not None and "wrote to standard output" in record.error
    out = capsys.readouterr()
    assert out.out == "" and "noise" in out.err


def test_a_lazy_factory_naming_a_missing_attribute(tmp_path: Path) -> None:
    registry = Registry()

    @ppokit.hookimpl
    def ppokit_register(register: object) -> None:
        register(Component("advantage", "ghost", "os:no_such_thing"))  # type: ignore[operator]

    assert registry.load_plugin("ghosts", _module(ppokit_register)).ok
    info = registry.info("advantage", "ghost")
    with pytest.raises(RegistryError, match="cannot be imported: AttributeError"):
        info.load()
    assert "no_such_thing" in info.as_dict()["error"]


def test_a_component_of_a_known_plugin_names_the_plugin() -> None:
    registry = Registry()  # no plugin installed
    with pytest.raises(RegistryError, match=r"it comes with the plugin ppokit-hlgauss, which"):
        registry.info("regression_loss", "hlgauss")


def test_a_known_plugin_that_is_not_installed_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from importlib.metadata import PackageNotFoundError

    import ppokit.registry as registry_module

    def missing(name: str) -> None:
        raise PackageNotFoundError(name)

    monkeypatch.setattr(registry_module, "distribution", missing)
    with pytest.raises(RegistryError, match=r"not installed: pip install ppokit-hlgauss"):
        Registry().info("regression_loss", "hlgauss")


def test_the_known_plugins_table_matches_the_bundled_plugins() -> None:
    from ppokit_example import plugin as example
    from ppokit_hlgauss import plugin as hlgauss

    from ppokit.registry import KNOWN_PLUGINS

    registry = Registry()
    registry.load_plugin("example", example, distribution="ppokit-example")
    registry.load_plugin("hlgauss", hlgauss, distribution="ppokit-hlgauss")
    registered = {
        (kind, name): record.distribution
        for record in registry.plugins.values()
        for kind, name in record.components
    }
    assert registered == KNOWN_PLUGINS
