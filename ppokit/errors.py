"""Errors a user can cause. The CLI prints their message on one line and exits non-zero."""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix (bad input, missing optional dependency, bad checkpoint)."""


class MissingDependency(UserError):
    """An optional dependency is not installed; the message says how to install it."""

    def __init__(self, package: str, purpose: str, install: str | None = None) -> None:
        install = install or f"pip install {package}"
        super().__init__(f"{purpose} needs the '{package}' package: {install}")
        self.package = package


class ComponentError(UserError):
    """A component broke its kind's contract at the trainer's boundary (wrong type, shape,
    dtype, a gradient where none belongs) or failed to start; the message names its slot,
    the component and its plugin."""


class ComponentTimeout(ComponentError):
    """A reward call did not return within ``train.reward_timeout`` seconds."""


class NonFiniteError(UserError):
    """A NaN or infinite reward, estimate, loss or gradient norm stopped the run before it
    reached the parameters; the message names the round and where it appeared."""
