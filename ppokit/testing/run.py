"""Runs the properties of one created component with hypothesis: each one held, or failed
with the smallest counterexample found, in one line.

Imports torch and hypothesis: imported only when a check runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import HealthCheck, Verbosity, given, settings

from ppokit.catalogue import Contract
from ppokit.components import KIND_PACKAGES
from ppokit.errors import one_line
from ppokit.slots import KINDS
from ppokit.testing.batches import batch_properties, describe_batch_case
from ppokit.testing.inputs import Violation, call_args
from ppokit.testing.tensors import (
    Elementwise,
    aggregation_properties,
    describe_args,
    elementwise_properties,
    group_filter_properties,
)

__all__ = ["Violation", "run_properties"]

#: A property's outcome: ("held" | "failed" | "not applicable", detail).
Outcome = tuple[str, str]


def _contract(kind: str) -> Contract | None:
    return getattr(KIND_PACKAGES[KINDS.index(kind)], "CONTRACT", None)


def _plan(
    kind: str, component: Any, requires: tuple[str, ...]
) -> tuple[list[Any], Any, Callable[[Any], str]]:
    """The kind's properties, what each test is called with, and how a case is written."""
    contract = _contract(kind)
    returns = contract.returns if contract is not None else ""
    if returns in ("estimate", "position_mask", "prompt_weight", "batch"):
        return batch_properties(returns, requires), component, describe_batch_case
    if returns == "elementwise":
        assert contract is not None
        names = call_args(kind, requires)
        head = (
            int(getattr(component, "head_size", 1) or 1) if "head_size" in contract.optional else 0
        )
        call = Elementwise(component, names, contract.differentiable)
        return elementwise_properties(names, head), call, describe_args
    if returns == "scalar":
        props = aggregation_properties(hasattr(component, "denominator"))
        return props, component, describe_args
    if returns == "group_keep":
        return group_filter_properties(), component, describe_args
    return [], component, describe_args


def _run_one(
    test: Callable[[Any, Any], None],
    target: Any,
    inputs: Any,
    describe: Callable[[Any], str],
    examples: int,
) -> Outcome:
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        report_multiple_bugs=False,
        verbosity=Verbosity.quiet,
        suppress_health_check=list(HealthCheck),
    )
    @given(inputs)
    def run(case: Any) -> None:
        try:
            test(target, case)
        except Violation as exc:
            raise Violation(f"{describe(case)}: {exc}") from None
        except Exception as exc:  # a component that raises fails the property
            raise Violation(f"{describe(case)}: raised {one_line(exc)}") from None

    try:
        run()
    except Violation as exc:
        return "failed", str(exc)
    except Exception as exc:  # hypothesis itself (an unsatisfiable strategy, ...)
        return "failed", one_line(exc)
    return "held", ""


def run_properties(
    kind: str, component: Any, requires: tuple[str, ...], examples: int
) -> Iterator[tuple[str, str, Outcome]]:
    """(property, meaning, outcome) of each property of ``kind``, run on ``component``."""
    props, target, describe = _plan(kind, component, requires)
    for prop in props:
        if len(prop) == 2:
            yield prop[0], "", ("not applicable", prop[1])
            continue
        name, meaning, inputs, test = prop
        yield name, meaning, _run_one(test, target, inputs, describe, examples)
