"""Shared base of the built-in params models."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Params(BaseModel):
    """Parameters of a component: validated, immutable, no unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoParams(Params):
    """A component without parameters."""
