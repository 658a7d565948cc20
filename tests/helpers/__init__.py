"""The tests' helpers, in one place: here the test plugins, spec fixtures and throwaway
virtualenvs shared by the core's tests; ``tests.helpers.trainer`` small specs and learners on
the tiny model, ``tests.helpers.components`` components built through the registry,
``tests.helpers.strategies`` hypothesis strategies of batches, ``tests.helpers.reference``
the components' reference loops."""

from __future__ import annotations

import os
import shutil
import site
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

from ppokit.catalogue import Component, Task, Variant
from ppokit.hookspecs import Register, hookimpl

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "tests" / "specs"
EXAMPLE_PLUGIN = ROOT / "plugins" / "ppokit-example"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_temp(factory: pytest.TempPathFactory) -> Path:
    """The test run's own temporary folder: the one pytest-xdist's workers share, or the
    session's without them."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder ``name`` as ``build(folder)`` fills it, once in a test run.

    A module-scoped fixture runs once per pytest-xdist worker that runs one of its tests,
    and worksteal may hand a module's tests to both. Built here, the first worker to ask
    builds under a file lock; the others wait, then read the same folder. A build that
    failed (no ``.built`` mark) is removed and made again by the next to ask."""
    from filelock import FileLock

    root = run_temp(factory)
    folder, mark = root / name, root / name / ".built"
    with FileLock(root / f"{name}.lock"):
        if not mark.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            mark.touch()
    return folder


def one_error_line(stderr: str) -> str:
    """The one line a command printed on ``stderr`` for a user's error (no traceback),
    after the lines of the steps it had begun (``ppokit: loading ...``)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("ppokit: ")] or lines
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def module_from_page(page: str, name: str, folder: Path) -> Any:
    """The plugin module the docs page ``docs/<page>`` prints (its python block with
    ``ppokit_register``), written out as ``folder/<name>.py`` and imported afresh."""
    import importlib
    import re

    text = (ROOT / "docs" / page).read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    (folder / f"{name}.py").write_text(next(b for b in blocks if "ppokit_register" in b))
    sys.path.insert(0, str(folder))
    try:
        sys.modules.pop(name, None)
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))


# ---------------------------------------------------------------------- plugins
@dataclass(eq=False)
class Plugin:
    """An in-process plugin: registers one :class:`Component` per ``(args, kwargs)`` pair of
    ``components`` (the entry's fields) when hooked."""

    components: list[tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    fail_with: Exception | None = None

    def add(self, *args: Any, **kwargs: Any) -> Plugin:
        self.components.append((args, kwargs))
        return self

    @hookimpl
    def ppokit_register(self, register: Register) -> None:
        for args, kwargs in self.components:
            given = args[0] if len(args) == 1 and not kwargs else None
            entry = given if isinstance(given, (Component, Variant, Task)) else None
            register(entry if entry is not None else Component(*args, **kwargs))
        if self.fail_with is not None:
            raise self.fail_with


class ScaleParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    scale: float = Field(1.0, gt=0, le=10, description="a positive scale")


class Scaled:
    """Multiplies by ``scale``: y = scale · x."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def __call__(self, x: float) -> float:
        return self.scale * x


def shifted(offset: float, width: int = 2) -> Callable[[float], float]:
    """A function factory whose signature defines the parameters."""
    return lambda x: x + offset * width


# ---------------------------------------------------------------------- specs
@dataclass
class InvalidSpec:
    path: Path
    errors: list[str]
    schema_rejects: bool


def valid_specs() -> list[Path]:
    return sorted((SPECS / "valid").glob("*.yaml"))


def invalid_specs() -> list[InvalidSpec]:
    out = []
    for path in sorted((SPECS / "invalid").glob("*.yaml")):
        lines = path.read_text().splitlines()
        errors = [ln.split("# error:", 1)[1].strip() for ln in lines if ln.startswith("# error:")]
        rejects = any(ln.strip() == "# schema: reject" for ln in lines)
        out.append(InvalidSpec(path, errors, rejects))
    return out


# ---------------------------------------------------------------------- virtualenvs
class Venv:
    """A throwaway virtualenv that sees the current environment's packages.

    ``python -m venv --system-site-packages`` exposes the base interpreter's packages; a
    ``.pth`` file adds the running environment's site-packages (torch, ppokit, pytest, pip,
    setuptools), so installing with ``--no-deps --no-build-isolation`` works offline.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        subprocess.run(
            [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root)],
            check=True,
        )
        self.python = root / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
        own_site = subprocess.run(
            [str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        self.site = Path(own_site)  # where a one-module plugin goes (path_plugin)
        parents = [p for p in site.getsitepackages() if Path(p).is_dir()]
        lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in parents)
        (self.site / "_parent_env.pth").write_text(lines)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PPOKIT_")}
        env.pop("PYTHONPATH", None)
        env.update(extra)
        return env

    def run(
        self, args: Sequence[str], cwd: Path | None = None, **env: str
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.python), *args],
            capture_output=True,
            text=True,
            env=self.env(**env),
            cwd=str(cwd) if cwd else None,
            timeout=600,
        )

    def ppokit(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return self.run(["-m", "ppokit.cli", *args], **env)

    def install(self, *paths: Path) -> None:
        result = self.run(
            [
                "-m",
                "pip",
                "install",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                "--disable-pip-version-check",
                "-q",
                *map(str, paths),
            ]
        )
        assert result.returncode == 0, result.stdout + result.stderr


def path_plugin(root: Path, dist: str, module: str, code: str, ep_name: str) -> Path:
    """A folder that, on ``PYTHONPATH`` (or a virtualenv's :attr:`Venv.site`), installs a
    one-module plugin: the module and a ``.dist-info`` with its entry point in the
    ``ppokit`` group (found by ``importlib.metadata`` like one pip installed; nothing to
    build). Returns the folder."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(textwrap.dedent(code))
    info = root / f"{dist.replace('-', '_')}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(f"[ppokit]\n{ep_name} = {module}\n")
    return root


BROKEN_IMPORT = """\
import ppokit_no_such_module  # the plugin's dependency is missing
"""

BROKEN_HOOK = """\
import ppokit


@ppokit.hookimpl
def ppokit_register(register, extra):  # 'extra' is not an argument of the hook
    register(ppokit.Component("advantage", "never_registered", "x"))
"""


def names_of(rows: Iterable[dict[str, Any]], kind: str) -> dict[str, str]:
    """name -> plugin for the ``list --json`` rows of ``kind``."""
    return {r["name"]: r["plugin"] for r in rows if r["kind"] == kind}
