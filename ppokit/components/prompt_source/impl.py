"""Prompt sources: the built-ins' code (catalogue: :mod:`ppokit.components.prompt_source`).

Each, created with its parameters, gives its stream of :mod:`ppokit.data` when called with
the run's data seed.
"""

from __future__ import annotations

from collections.abc import Mapping

from ppokit.components.prompt_source import ARITHMETIC, DEMO, FILE, HF, PromptSource
from ppokit.data import ArithmeticSource, DemoSource, RowSettings, hub_source, local_source


@DEMO.implementation
class Demo:
    def __init__(self, *, symbols: str, turns: int) -> None:
        self.options = {"symbols": symbols, "turns": turns}

    def __call__(self, seed: int) -> PromptSource:
        return DemoSource(seed, self.options)


@ARITHMETIC.implementation
class Arithmetic:
    def __init__(self, *, ops: str, min_value: int, max_value: int, terms: int) -> None:
        self.options = {"ops": ops, "min_value": min_value, "max_value": max_value, "terms": terms}

    def __call__(self, seed: int) -> PromptSource:
        return ArithmeticSource(seed, self.options)


def _rows(shuffle: bool, columns: Mapping[str, str], answer_pattern: str | None) -> RowSettings:
    return {"shuffle": shuffle, "columns": dict(columns), "answer_pattern": answer_pattern}


@FILE.implementation
class File:
    def __init__(
        self,
        *,
        path: str,
        split: str,
        columns: Mapping[str, str],
        answer_pattern: str | None,
        shuffle: bool,
    ) -> None:
        self.path, self.split = path, split
        self.rows = _rows(shuffle, columns, answer_pattern)

    def __call__(self, seed: int) -> PromptSource:
        return local_source(seed, self.path, self.split, self.rows)


@HF.implementation
class Hub:
    def __init__(
        self,
        *,
        dataset: str,
        config: str | None,
        split: str,
        columns: Mapping[str, str],
        answer_pattern: str | None,
        shuffle: bool,
    ) -> None:
        self.dataset, self.config, self.split = dataset, config, split
        self.rows = _rows(shuffle, columns, answer_pattern)

    def __call__(self, seed: int) -> PromptSource:
        return hub_source(seed, self.dataset, self.config, self.split, self.rows)


__all__ = ["Arithmetic", "Demo", "File", "Hub"]
