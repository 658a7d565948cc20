"""Catalogue of the built-in position_mask components (torch-free)."""

from __future__ import annotations

from ppokit.builtins._base import NoParams
from ppokit.hookspecs import Register

MODULE = "ppokit.components.position_mask"


def register_components(register: Register) -> None:
    register(
        "position_mask",
        "response",
        f"{MODULE}:ResponseMask",
        params=NoParams,
        summary="Every response token",
        formula="m_t = response_mask_t",
        source="the general critic loss of ppokit's docs/concepts.md; PPO (Schulman et al., 2017), arXiv:1707.06347",
    )
    register(
        "position_mask",
        "completed",
        f"{MODULE}:CompletedMask",
        params=NoParams,
        summary="Response tokens of rows that ended with EOS (truncated rows get 0)",
        formula="m_t = response_mask_t * (1 - truncated)",
        requires=("truncated",),
        source="Time Limits in Reinforcement Learning (Pardo et al., 2018), arXiv:1712.00378: no value regression on cut-off returns",
    )
    register(
        "position_mask",
        "last_token",
        f"{MODULE}:LastTokenMask",
        params=NoParams,
        summary="Only each row's last response token",
        formula="m_t = 1 if t is the row's last response position else 0",
        source="ppokit: train the critic on the final state only (an outcome-value critic)",
    )
