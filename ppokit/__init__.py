"""ppokit: PPO-style reinforcement learning for language models, assembled from small named
components chosen by a declarative spec."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from ppokit.catalogue import Component, NoParams, Params, Task, Variant
from ppokit.hookspecs import hookimpl
from ppokit.registry import get_registry
from ppokit.trainer import train

try:  # pyproject.toml states it once; the installed distribution's metadata carries it
    __version__ = version("ppokit")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
__all__ = [
    "Component",
    "NoParams",
    "Params",
    "RolloutBatch",
    "Run",
    "Task",
    "Variant",
    "__version__",
    "build",
    "get_registry",
    "hookimpl",
    "load_spec",
    "set_threads",
    "train",
]

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from ppokit.batch import RolloutBatch
    from ppokit.spec import Spec
    from ppokit.trainer.models import Models
    from ppokit.trainer.run import Run, build


def load_spec(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    base: dict[str, Any] | None = None,
) -> Spec:
    """Read a spec file (None: start from ``base`` or the defaults), apply ``path=value``
    overrides, validate it: :func:`ppokit.spec.load_spec`."""
    from ppokit.spec import load_spec as load

    return load(path, overrides, base=base)


def set_threads(spec: Spec, models: Models) -> str:
    """Give torch the CPU threads ``ppokit train`` gives a run of ``spec`` on ``models``
    (``model.threads``, else one for a small model on the CPU, where more only contend) and
    say which: :func:`ppokit.trainer.threads.set_threads`. ``ppokit.train`` and
    ``ppokit.build`` apply it themselves; models built otherwise call it once built."""
    from ppokit.trainer.threads import set_threads as apply

    return apply(spec, models)


def __getattr__(name: str) -> Any:
    # RolloutBatch, build and Run import torch: keep ``import ppokit`` light for the CLI.
    if name == "RolloutBatch":
        from ppokit.batch import RolloutBatch

        return RolloutBatch
    if name in ("build", "Run"):  # a spec's run, ready for its rounds: ppokit.trainer.run
        from ppokit.trainer import run

        return getattr(run, name)
    raise AttributeError(f"module 'ppokit' has no attribute {name!r}")
