"""Shared fixtures of the core's tests: registries with test plugins, and one virtualenv
with the example plugin and two broken plugins installed (built once per session)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import ppokit.registry as registry_module
from ppokit.registry import Registry, reset_registry
from tests.helpers import (
    BROKEN_HOOK,
    BROKEN_IMPORT,
    EXAMPLE_PLUGIN,
    Plugin,
    Venv,
    path_plugin,
    run_temp,
)


def pytest_configure(config: pytest.Config) -> None:
    """The runner's terminal size is not the tests' (pytest-xdist's workers set
    ``COLUMNS=80``): what they print lays out as on a user's pipe, from the modules they
    import (ppokit.cli sizes its console then) to the commands they run."""
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)


@pytest.fixture(scope="session", autouse=True)
def conversion_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tests' own cache of converted models (``PPOKIT_CACHE``, for every process they
    start): a run of the suite converts SmolLM2's GGUF file once, shared by pytest-xdist's
    workers (an entry is renamed into place whole), and never reads a cache of the
    machine's."""
    folder = run_temp(tmp_path_factory) / "ppokit-cache"
    folder.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PPOKIT_CACHE", str(folder))
        yield folder


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No PPOKIT_* switches from the caller's environment; the cached registry is rebuilt."""
    monkeypatch.delenv("PPOKIT_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("PPOKIT_STRICT_PLUGINS", raising=False)
    reset_registry()
    yield
    reset_registry()


@pytest.fixture
def use_registry(monkeypatch: pytest.MonkeyPatch, clean_registry: None) -> Callable[..., Registry]:
    """``use_registry(*plugins)``: the process registry becomes the built-ins plus ``plugins``
    (in-process objects), for the CLI, the spec and the schema alike."""

    def install(*plugins: Plugin, builtins: bool = True) -> Registry:
        registry = Registry()
        if builtins:
            from ppokit import components as builtin_plugin

            registry.load_plugin("ppokit", builtin_plugin, distribution="ppokit")
        for i, plugin in enumerate(plugins):
            registry.load_plugin(f"test{i}", plugin, distribution=f"ppokit-test{i}")
        monkeypatch.setattr(registry_module, "build_registry", lambda strict=None: registry)
        reset_registry()
        return registry

    return install


@pytest.fixture(scope="session")
def plugin_venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A throwaway virtualenv with ppokit-example and two broken plugins installed."""
    root = tmp_path_factory.mktemp("venv")
    venv = Venv(root / "env")
    venv.install(EXAMPLE_PLUGIN)
    path_plugin(
        venv.site, "ppokit-broken-import", "ppokit_broken_import", BROKEN_IMPORT, "broken_import"
    )
    path_plugin(venv.site, "ppokit-broken-hook", "ppokit_broken_hook", BROKEN_HOOK, "broken_hook")
    return venv


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that use the session virtualenv are slow."""
    for item in items:
        if "plugin_venv" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def tmp_spec(tmp_path: Path) -> Callable[[str], Path]:
    """Write YAML text to a spec file in tmp_path."""

    def write(text: str, name: str = "spec.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt for the test, as at a terminal, even where the test
    command runs with SIGINT ignored (a shell's background job, nohup)."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
