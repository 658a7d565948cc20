"""ppokit: PPO-style reinforcement learning for language models, assembled from small named
components chosen by a declarative spec."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ppokit.catalogue import Component, NoParams, Params
from ppokit.hookspecs import hookimpl
from ppokit.registry import get_registry

__version__ = "0.1.0"
__all__ = [
    "Component",
    "NoParams",
    "Params",
    "RolloutBatch",
    "__version__",
    "get_registry",
    "hookimpl",
]

if TYPE_CHECKING:
    from ppokit.batch import RolloutBatch


def __getattr__(name: str) -> Any:
    # RolloutBatch imports torch: keep ``import ppokit`` light for the CLI.
    if name == "RolloutBatch":
        from ppokit.batch import RolloutBatch

        return RolloutBatch
    raise AttributeError(f"module 'ppokit' has no attribute {name!r}")
