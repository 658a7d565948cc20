"""The demo task: echo the symbol the prompt shows.

Each prompt is ``"echo <s>"`` for a symbol ``s`` drawn uniformly from a small alphabet (default
``"abcd"``); the answer is ``s``. The reward is the fraction of the response's first
:data:`SPAN` characters that equal ``s`` (missing characters count 0), so it is 1 for
``"ssss"`` and 0 for a response without ``s``. A policy that ignores the prompt matches the
symbol of a uniformly drawn prompt with probability at most 1/K at each position, so it
scores at most 1/K = 0.25 with four symbols: only reading the prompt scores higher.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ppokit.components import reward as catalogue

if TYPE_CHECKING:
    import torch

__all__ = ["SPAN", "SYMBOLS", "DemoReward", "make_row"]

SYMBOLS = "abcd"
#: Response characters the reward looks at.
SPAN = 4


def make_row(rng: random.Random, symbols: str = SYMBOLS, turns: int = 1) -> dict[str, Any]:
    """One prompt of the demo task: ``{"prompt": "echo b", "answer": "b"}``; with ``turns``
    > 1 also ``"symbols"``, the symbol of each turn of the ``echo`` environment
    (``"bdca"``: the prompt's, then ``turns - 1`` more drawn independently)."""
    if not symbols:
        raise ValueError("data.options.symbols must not be empty")
    symbol = rng.choice(symbols)
    row = {"prompt": f"echo {symbol}", "answer": symbol}
    if turns > 1:
        row["symbols"] = symbol + "".join(rng.choice(symbols) for _ in range(turns - 1))
    return row


def echo_score(response: str, symbol: str, span: int = SPAN) -> float:
    """Fraction of the first ``span`` characters of ``response`` equal to ``symbol``."""
    if not symbol:
        return 0.0
    return sum(ch == symbol for ch in response[:span]) / span


@catalogue.DEMO.implementation
class DemoReward:
    """The symbol comes from the row's ``answer`` field, else from the prompt's last character."""

    def __call__(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        answer: Sequence[str] | None = None,
        **fields: Any,
    ) -> torch.Tensor:
        import torch  # this module stays torch-free: the spec reads its SYMBOLS

        symbols = list(answer) if answer is not None else [p[-1:] for p in prompts]
        return torch.tensor(
            [echo_score(r, str(s)) for r, s in zip(responses, symbols, strict=True)],
            dtype=torch.float32,
        )
