"""Catalogue of the built-in prompt_weight components (torch-free)."""

from __future__ import annotations

from ppokit.hookspecs import Register


def register_components(register: Register) -> None:
    pass
