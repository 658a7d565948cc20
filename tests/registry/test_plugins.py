"""Plugins through real entry points: ppokit-example and two deliberately broken plugins
installed (pip, offline) into a throwaway virtualenv, then that venv's ``ppokit``."""

from __future__ import annotations

import json

import pytest

from tests.helpers import EXAMPLE_PLUGIN, Venv, names_of

pytestmark = pytest.mark.slow

SPEC = """\
rollout: {prompts_per_round: 4, n: 4}
advantage: {name: lite_ppo, eps: 1.0e-5}
policy: {loss: ppo_clip, aggregation: token_mean}
"""


def test_example_component_is_listed_and_attributed(plugin_venv: Venv) -> None:
    result = plugin_venv.ppokit("list", "advantage", "--json")
    assert result.returncode == 0, result.stderr
    advantages = names_of(json.loads(result.stdout), "advantage")
    assert advantages["lite_ppo"] == "example"
    assert advantages["gae"] == "ppokit"
    # the broken plugins are reported, not fatal
    assert "plugin broken_import failed to load" in result.stderr
    assert "plugin broken_hook failed to load" in result.stderr
    assert "Traceback" not in result.stderr


def test_show_and_validate_a_spec_using_it(
    plugin_venv: Venv, tmp_path: pytest.TempPathFactory
) -> None:
    show = json.loads(plugin_venv.ppokit("show", "advantage", "lite_ppo", "--json").stdout)
    assert (show["plugin"], show["version"]) == ("example", "0.1.0")
    assert "arXiv:2508.08221" in show["source"] and show["requires"] == ["group_ids"]
    spec = tmp_path / "lite.yaml"  # type: ignore[operator]
    spec.write_text(SPEC)
    ok = plugin_venv.ppokit("validate", str(spec))
    assert ok.returncode == 0 and ok.stdout.strip() == f"{spec}: valid", ok.stderr
    bad = plugin_venv.ppokit(
        "validate", str(spec), "--set", "rollout.n=1", "--set", "advantage.eps=0"
    )
    assert bad.returncode == 1
    assert "advantage.eps: Input should be greater than 0" in bad.stderr
    assert "rollout.n: advantage (lite_ppo) compares responses within a group" in bad.stderr


def test_plugins_reports_the_failures(plugin_venv: Venv) -> None:
    result = plugin_venv.ppokit("plugins", "--json")
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    assert plugins["example"]["ok"] and plugins["example"]["distribution"] == "ppokit-example"
    assert plugins["example"]["components"] == ["advantage/lite_ppo"]
    assert "ModuleNotFoundError" in plugins["broken_import"]["error"]
    assert "ppokit_no_such_module" in plugins["broken_import"]["error"]
    assert "extra" in plugins["broken_hook"]["error"]
    assert plugins["broken_hook"]["components"] == []
    text = plugin_venv.ppokit("plugins").stdout
    assert "broken_import 0.0.1 (ppokit-broken-import): failed: ModuleNotFoundError" in text


def test_strict_plugins_makes_the_failure_fatal(plugin_venv: Venv) -> None:
    result = plugin_venv.ppokit("list", PPOKIT_STRICT_PLUGINS="1")
    assert result.returncode == 1
    assert result.stdout == ""
    assert "plugin broken_hook" in result.stderr and "plugin broken_import" in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_load_plugins_switch(plugin_venv: Venv) -> None:
    only = plugin_venv.ppokit("list", "advantage", "--json", PPOKIT_LOAD_PLUGINS="example")
    assert only.returncode == 0 and only.stderr == ""  # the broken ones are not loaded
    assert "lite_ppo" in names_of(json.loads(only.stdout), "advantage")
    strict = plugin_venv.ppokit("list", PPOKIT_LOAD_PLUGINS="example", PPOKIT_STRICT_PLUGINS="1")
    assert strict.returncode == 0, strict.stderr
    none = plugin_venv.ppokit("plugins", "--json", PPOKIT_LOAD_PLUGINS="")
    assert [p["name"] for p in json.loads(none.stdout)["plugins"]] == ["ppokit"]
    gone = plugin_venv.ppokit("show", "advantage", "lite_ppo", PPOKIT_LOAD_PLUGINS="")
    assert gone.returncode == 1 and "unknown advantage 'lite_ppo'" in gone.stderr


def test_the_component_module_is_imported_only_on_create(plugin_venv: Venv) -> None:
    code = (
        "import sys; from ppokit.registry import get_registry; r = get_registry(); "
        "r.info('advantage', 'lite_ppo').schema(); "
        "print('before', 'ppokit_example.advantage' in sys.modules, 'torch' in sys.modules); "
        "r.create('advantage', 'lite_ppo'); "
        "print('after', 'ppokit_example.advantage' in sys.modules)"
    )
    result = plugin_venv.run(["-c", code])
    assert result.stdout.split() == ["before", "False", "False", "after", "True"], result.stderr


def test_the_example_plugin_passes_its_own_tests(plugin_venv: Venv) -> None:
    result = plugin_venv.run(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=EXAMPLE_PLUGIN
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert " passed" in result.stdout
