"""The trainer: a validated spec becomes a PPO run on transformers models (CPU or GPU).

``train(spec, *, resume=False, smoke=False, overwrite=False, allow_spec_change=False) ->
dict`` is the entry point (also ``ppokit.train``) (Ctrl-C raises
``lifecycle.ending.Interrupted``, a KeyboardInterrupt that says how to resume);
``build(spec)`` (also ``ppokit.build``) is the run ``train`` builds, for rounds of one's own
(:mod:`ppokit.trainer.run`). torch and transformers are imported only when either is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Run", "build", "train"]

if TYPE_CHECKING:
    from ppokit.spec import Spec
    from ppokit.trainer.run import Run, build


def train(spec: Spec, **options: Any) -> dict[str, Any]:
    """Run the spec (see :func:`ppokit.trainer.loop.train` for the options)."""
    from ppokit.trainer.loop import train as run

    return run(spec, **options)


def __getattr__(name: str) -> Any:
    if name in ("build", "Run"):  # torch: only when asked for
        from ppokit.trainer import run

        return getattr(run, name)
    raise AttributeError(f"module 'ppokit.trainer' has no attribute {name!r}")
