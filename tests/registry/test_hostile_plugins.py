"""Plugins cannot take the command line down: installed hostile plugins (one that calls
``sys.exit`` at import, one whose lazy factory names a missing attribute, one that prints to
standard output, one whose import hangs, one that calls ``os._exit(0)``, one that writes to
file descriptor 1 from Python and from C, one whose summary holds terminal escape codes) are
isolated and reported like any other broken plugin, the CLI's JSON output stays parseable and
its text output holds no control character. Also the switches: ``--no-plugins`` and
``PPOKIT_NO_PLUGINS``, the import time limit, boolean words and unknown names."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import types
from pathlib import Path

import pytest

import ppokit
from ppokit.catalogue import Component
from ppokit.errors import printable
from ppokit.registry import (
    PLUGIN_IMPORT_TIMEOUT,
    Registry,
    RegistryError,
    build_registry,
    env_flag,
    name_problem,
    plugin_import_timeout,
)
from tests.helpers import Venv, path_plugin

EXITS = """\
import sys
sys.exit(3)  # a plugin that ends the program when imported
"""

MISSING_ATTR = """\
import ppokit


@ppokit.hookimpl
def ppokit_register(register):
    # no params model: the schema must import the factory, and its module marks none
    register(ppokit.Component("advantage", "ghost", "ppokit_missing_attr"))
"""

PRINTS = """\
import ppokit

print("hello from a plugin")


@ppokit.hookimpl
def ppokit_register(register):
    register(ppokit.Component("advantage", "chatty", "ppokit_prints"))
"""


HANGS = """\
import time

time.sleep(3600)  # an import that never finishes (a network call without a timeout, ...)
"""

OS_EXIT = """\
import os

os._exit(0)  # ends the process at once, with status 0, skipping every handler
"""

WRITES_FD1 = """\
import ctypes
import os

import ppokit

os.write(1, b"written to fd 1 by a plugin\\n")  # below sys.stdout
ctypes.CDLL(None).printf(b"printed by C code\\n")  # into the C library's stdout buffer


@ppokit.hookimpl
def ppokit_register(register):
    os.write(1, b"written to fd 1 by a hook\\n")
    register(ppokit.Component("advantage", "fd_writer", "ppokit_writes_fd1", summary="fd"))
"""

ESCAPES = """\
import ppokit

ESCAPES = ppokit.Component(
    "advantage",
    "escapes",
    "ppokit_escapes",
    summary="clears \\x1b[2J\\x1b]0;title\\x07 the screen\\r",
    formula="A = \\x1b[31m red",
)


@ESCAPES.implementation
def make():
    return None


@ppokit.hookimpl
def ppokit_register(register):
    register(ESCAPES)
"""

FAILS_LOUDLY = """\
raise RuntimeError("and fails \\x1b[5m blinking")
"""

#: The import time limit of the commands run here (a hanging plugin waits this long).
TIMEOUT = "2"


class HostileVenv(Venv):
    """A virtualenv whose commands bound a plugin's import by TIMEOUT seconds."""

    def env(self, **extra: str) -> dict[str, str]:
        return super().env(**{"PPOKIT_PLUGIN_IMPORT_TIMEOUT": TIMEOUT, **extra})


@pytest.fixture(scope="module")
def hostile_venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    root = tmp_path_factory.mktemp("hostile")
    venv = HostileVenv(root / "env")
    for dist, module, code, entry in [
        ("ppokit-exits", "ppokit_exits", EXITS, "exits"),
        ("ppokit-missing-attr", "ppokit_missing_attr", MISSING_ATTR, "missing_attr"),
        ("ppokit-prints", "ppokit_prints", PRINTS, "prints"),
        ("ppokit-hangs", "ppokit_hangs", HANGS, "hangs"),
        ("ppokit-os-exit", "ppokit_os_exit", OS_EXIT, "os_exit"),
        ("ppokit-writes-fd1", "ppokit_writes_fd1", WRITES_FD1, "fd1"),
        ("ppokit-escapes", "ppokit_escapes", ESCAPES, "escapes"),
        ("ppokit-loud", "ppokit_loud", FAILS_LOUDLY, "loud"),
    ]:
        path_plugin(venv.site, dist, module, code, entry)
    return venv


@pytest.mark.slow
def test_list_json_and_schema_survive(hostile_venv: Venv) -> None:
    listed = hostile_venv.ppokit("list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)  # nothing a plugin printed or wrote is in it
    names = {r["name"] for r in rows}
    assert {"gae", "grpo", "ghost", "fd_writer"} <= names and "chatty" not in names
    for text in ("written to fd 1 by a plugin", "printed by C code", "by a hook"):
        assert text in listed.stderr  # sent to standard error instead
    assert "Traceback" not in listed.stderr
    show = hostile_venv.ppokit("show", "advantage", "ghost")  # listing imports no factory
    assert show.returncode != 0 and "marks no implementation" in show.stderr
    assert "Traceback" not in show.stderr
    schema = hostile_venv.ppokit("schema")
    assert schema.returncode == 0, schema.stderr
    advantages = json.dumps(json.loads(schema.stdout)["$defs"]["component.advantage"])
    assert '"grpo"' in advantages and "ghost" not in advantages
    assert "fd_writer" not in advantages  # its factory cannot be imported either


@pytest.mark.slow
def test_a_hanging_import_and_os_exit_are_reported(hostile_venv: Venv) -> None:
    began = time.perf_counter()
    result = hostile_venv.ppokit("plugins", "--json")
    took = time.perf_counter() - began
    assert result.returncode == 0, result.stderr  # os._exit(0) did not end the command
    plugins = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    assert f"its import did not finish within {TIMEOUT} s" in plugins["hangs"]["error"]
    assert "PluginExit: called os._exit(0) while loading" in plugins["os_exit"]["error"]
    assert plugins["fd1"]["ok"] and plugins["ppokit"]["ok"]
    assert took < 60  # the hung import is left behind on a daemon thread: the process exits
    text = hostile_venv.ppokit("plugins")
    assert text.returncode == 0 and "hangs" in text.stdout and "os_exit" in text.stdout


@pytest.mark.slow
def test_plugin_text_reaches_no_terminal_raw(hostile_venv: Venv) -> None:
    plugins = hostile_venv.ppokit("plugins")
    listed = hostile_venv.ppokit("list", "advantage", COLUMNS="400")  # one line a row
    shown = hostile_venv.ppokit("show", "advantage", "escapes")
    for result in (plugins, listed, shown):
        assert "\x1b" not in result.stdout + result.stderr and "\x07" not in result.stdout
        assert "\r" not in result.stdout
    assert "and fails \\x1b[5m blinking" in plugins.stdout  # shown, escaped
    assert "and fails \\x1b[5m blinking" in listed.stderr  # the warning
    assert "clears \\x1b[2J\\x1b]0;title\\x07 the screen\\r" in listed.stdout
    assert "A = \\x1b[31m red" in shown.stdout


@pytest.mark.slow
def test_plugins_off(hostile_venv: Venv) -> None:
    for args, env in [(("--no-plugins",), {}), ((), {"PPOKIT_NO_PLUGINS": "1"})]:
        result = hostile_venv.ppokit(*args, "plugins", "--json", **env)
        assert result.returncode == 0, result.stderr
        assert [p["name"] for p in json.loads(result.stdout)["plugins"]] == ["ppokit"]
        assert "written to fd 1" not in result.stderr  # not even imported
    listed = hostile_venv.ppokit("--no-plugins", "list", "--json")
    assert "ghost" not in {r["name"] for r in json.loads(listed.stdout)}
    bad = hostile_venv.ppokit("list", PPOKIT_NO_PLUGINS="maybe")
    assert bad.returncode == 1 and "PPOKIT_NO_PLUGINS" in bad.stderr
    bad = hostile_venv.ppokit("list", PPOKIT_PLUGIN_IMPORT_TIMEOUT="soon")
    assert bad.returncode == 1 and "PPOKIT_PLUGIN_IMPORT_TIMEOUT" in bad.stderr
    assert "Traceback" not in bad.stderr


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
    assert validate.returncode != 0 and "marks no implementation" in validate.stderr
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


# ------------------------------------------------------------------ in process: the guards
def test_a_hook_that_hangs_is_bounded() -> None:
    release = threading.Event()

    @ppokit.hookimpl
    def ppokit_register(register: object) -> None:
        release.wait(30)

    began = time.perf_counter()
    record = Registry().load_plugin("stuck", _module(ppokit_register), timeout=0.2)
    release.set()
    assert time.perf_counter() - began < 10
    assert record.error == (
        "its ppokit_register hook did not return within 0.2 s (PPOKIT_PLUGIN_IMPORT_TIMEOUT)"
    )


def test_os_exit_in_a_hook_is_refused_and_put_back() -> None:
    real = os._exit

    @ppokit.hookimpl
    def ppokit_register(register: object) -> None:
        os._exit(0)

    for timeout in (None, 5.0):  # on this thread and on a worker thread
        record = Registry().load_plugin("exits", _module(ppokit_register), timeout=timeout)
        assert record.error == "PluginExit: called os._exit(0) while loading"
        assert os._exit is real


def test_writes_to_fd_1_go_to_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    @ppokit.hookimpl
    def ppokit_register(register: object) -> None:
        os.write(1, b"below sys.stdout\n")
        register(Component("advantage", "quiet", "os"))

    record = Registry().load_plugin("writes", _module(ppokit_register), timeout=5.0)
    sys.stdout.write("after\n")  # standard output is back
    sys.stdout.flush()
    out = capfd.readouterr()
    assert record.ok and out.out == "after\n" and "below sys.stdout" in out.err


#: The entry ppokit_lazy_writes (written by the test below) marks its implementation of.
LAZY_WRITES = Component("advantage", "writes", "ppokit_lazy_writes")


def test_a_lazy_factory_is_imported_under_the_guards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "ppokit_lazy_writes.py").write_text(
        "import os\nfrom tests.registry.test_hostile_plugins import LAZY_WRITES\n"
        "os.write(1, b'fd 1 at import\\n')\n\n"
        "@LAZY_WRITES.implementation\ndef make():\n    return 1\n"
    )
    (tmp_path / "ppokit_lazy_exits.py").write_text("import os\nos._exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    @ppokit.hookimpl
    def ppokit_register(register: object) -> None:
        register(LAZY_WRITES)  # type: ignore[operator]
        register(Component("advantage", "exits", "ppokit_lazy_exits"))  # type: ignore[operator]

    registry = Registry()
    assert registry.load_plugin("lazy", _module(ppokit_register)).ok
    assert registry.info("advantage", "writes").load()() == 1
    out = capfd.readouterr()
    assert out.out == "" and "fd 1 at import" in out.err
    with pytest.raises(RegistryError, match=r"PluginExit: called os._exit\(0\) while loading"):
        registry.info("advantage", "exits").load()


class Spinning:
    """An entry point whose import computes forever (Python code that never sleeps: a
    thread waiting for it would never get the interpreter back)."""

    name = "spins"
    dist = None

    def load(self) -> object:
        while True:
            pass


def test_an_import_that_computes_forever_is_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    import ppokit.registry.plugins as plugins

    monkeypatch.setenv("PPOKIT_PLUGIN_IMPORT_TIMEOUT", "0.3")
    monkeypatch.setattr(plugins, "entry_points", lambda group: [Spinning()])
    registry = Registry()
    registry.load_entry_points()
    assert registry.plugins["spins"].error == (
        "its import did not finish within 0.3 s (PPOKIT_PLUGIN_IMPORT_TIMEOUT)"
    )
    hook = types.SimpleNamespace(
        ppokit_register=ppokit.hookimpl(lambda register: Spinning().load())
    )
    record = registry.load_plugin("hook", hook, timeout=0.3)
    assert record.error == (
        "its ppokit_register hook did not return within 0.3 s (PPOKIT_PLUGIN_IMPORT_TIMEOUT)"
    )


@pytest.mark.parametrize(
    ("raw", "value"), [("", PLUGIN_IMPORT_TIMEOUT), ("0.5", 0.5), (" 7 ", 7.0)]
)
def test_the_import_time_limit(monkeypatch: pytest.MonkeyPatch, raw: str, value: float) -> None:
    monkeypatch.setenv("PPOKIT_PLUGIN_IMPORT_TIMEOUT", raw)
    assert plugin_import_timeout() == value


@pytest.mark.parametrize("raw", ["0", "-1", "inf", "nan", "soon"])
def test_a_bad_import_time_limit(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("PPOKIT_PLUGIN_IMPORT_TIMEOUT", raw)
    with pytest.raises(RegistryError, match="expected a positive number of seconds"):
        plugin_import_timeout()


def test_no_plugins_loads_the_builtins_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPOKIT_NO_PLUGINS", "1")
    monkeypatch.delenv("PPOKIT_LOAD_PLUGINS", raising=False)
    registry = build_registry()
    assert list(registry.plugins) == ["ppokit"] and registry.has("advantage", "gae")
    assert not registry.has("advantage", "lite_ppo")  # the example plugin is installed here
    monkeypatch.setenv("PPOKIT_NO_PLUGINS", "0")
    assert build_registry().has("advantage", "lite_ppo")


# ------------------------------------------------------------------ names and text
@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("g\u0430e", "'\\u0430' is U+0430 CYRILLIC SMALL LETTER A"),
        ("\uff47\uff41\uff45", "U+FF47 FULLWIDTH LATIN SMALL LETTER G"),
        ("gae ", "is not an ASCII identifier"),
        ("1gae", "is not an ASCII identifier"),
        ("", "is not an ASCII identifier"),
    ],
)
def test_look_alike_component_names_are_refused(name: str, message: str) -> None:
    @ppokit.hookimpl
    def ppokit_register(register: object) -> None:
        register(Component("advantage", name, "os"))  # type: ignore[operator]

    record = Registry().load_plugin("lookalike", _module(ppokit_register))
    assert record.error is not None and message in record.error
    assert record.error.isascii()  # the name is shown by its escapes
    assert name_problem("gae") is None and name_problem("Td0_x") is None


def test_plugin_names() -> None:
    from ppokit.registry import PLUGIN_NAME

    assert name_problem("ppokit-hl.gauss_2", "plugin name", PLUGIN_NAME) is None
    problem = name_problem("h\u0435", "plugin name", PLUGIN_NAME)
    assert problem is not None and "U+0435 CYRILLIC SMALL LETTER IE" in problem


def test_printable_escapes_control_characters() -> None:
    assert printable("a\x1b[31mb\x07\u202ec\r") == "a\\x1b[31mb\\x07\\u202ec\\r"
    assert printable("line\n\tcafé 中 😀") == "line\n\tcafé 中 😀"


def test_a_plugins_summary_and_formula_are_stored_printable() -> None:
    @ppokit.hookimpl
    def ppokit_register(register: object) -> None:
        register(Component("advantage", "loud", "os", summary="\x1b[2J", formula="\x9b1m"))

    registry = Registry()
    assert registry.load_plugin("loud", _module(ppokit_register)).ok
    info = registry.info("advantage", "loud")
    assert (info.summary, info.formula) == ("\\x1b[2J", "\\x9b1m")


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


def test_a_lazy_factory_whose_module_marks_no_implementation(tmp_path: Path) -> None:
    registry = Registry()

    @ppokit.hookimpl
    def ppokit_register(register: object) -> None:
        register(Component("advantage", "ghost", "os"))  # type: ignore[operator]

    assert registry.load_plugin("ghosts", _module(ppokit_register)).ok
    info = registry.info("advantage", "ghost")
    with pytest.raises(RegistryError, match="module 'os' marks no implementation"):
        info.load()
    assert "decorate it with @ENTRY.implementation" in info.as_dict()["error"]


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

    monkeypatch.setattr(registry_module.plugins, "distribution", missing)
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
        for kind, name in [*record.components, *record.entries]
    }
    assert registered == KNOWN_PLUGINS


def test_the_docs_state_the_switches_and_the_import_limit() -> None:
    from tests.helpers import ROOT

    text = " ".join((ROOT / "docs" / "plugins.md").read_text().split())
    assert f"for at most {PLUGIN_IMPORT_TIMEOUT:g} seconds" in text
    assert f"did not finish within {PLUGIN_IMPORT_TIMEOUT:g} s" in text
    for switch in ("PPOKIT_PLUGIN_IMPORT_TIMEOUT", "PPOKIT_NO_PLUGINS=1", "--no-plugins"):
        assert switch in text


def test_a_runs_messages_are_printable() -> None:
    import io

    from ppokit.trainer.display import Display

    stream = io.StringIO()
    Display(total=1, start=0, live=False, stream=stream).message("reward said \x1b[2J\x07")
    assert stream.getvalue() == "reward said \\x1b[2J\\x07\n"


def test_errors_printed_by_the_cli_are_printable(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ppokit.cli import app

    spec = tmp_path / "spec.yaml"
    spec.write_text('"\\e[2Jseed": 1\nadvantage: "\\e]0;x\\a"\n')
    result = CliRunner().invoke(app, ["validate", str(spec)])
    assert result.exit_code == 1
    assert "\x1b" not in result.stderr and "\\x1b[2Jseed" in result.stderr, result.stderr
    result = CliRunner().invoke(app, ["explain", str(spec)])  # through fail()
    assert result.exit_code == 1 and "\x1b" not in result.stderr and "\\x1b" in result.stderr
