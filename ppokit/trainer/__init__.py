"""The trainer: a validated spec becomes a PPO run on transformers models (CPU or GPU).

``train(spec, *, resume=False, smoke=False, overwrite=False, allow_spec_change=False) ->
dict`` is the entry point (also ``ppokit.train``) (Ctrl-C raises ``loop.Interrupted``, a KeyboardInterrupt that says
how to resume); torch and transformers are imported only when it is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["train"]

if TYPE_CHECKING:
    from ppokit.spec import Spec


def train(spec: Spec, **options: Any) -> dict[str, Any]:
    """Run the spec (see :func:`ppokit.trainer.loop.train` for the options)."""
    from ppokit.trainer.loop import train as run

    return run(spec, **options)
