"""``ppokit check TARGET...``: the conformance properties (:mod:`ppokit.testing`) of the
components a target names, one line per component and property.

A target is a plugin's name (every component it registered), a variant (the components it
assembles, with the parameters it gives them), a kind (every component of it) or ``KIND/NAME`` (one component, as ``ppokit plugins`` writes it), with parameters
after a colon: ``policy_loss/cispo:clip_high=0.2`` (values read as YAML scalars; the
defaults for the rest). :func:`resolve` turns targets into the ``(kind, name, params)``
list that :func:`ppokit.testing.check` runs, the one entry point of a check.

Torch-free at import: torch and hypothesis are imported when a check runs.
"""

from __future__ import annotations

from typing import Any

import typer
import yaml

from ppokit.errors import UserError, error_lines, fail, printable
from ppokit.registry import Registry, RegistryError, get_registry, suggest
from ppokit.slots import KINDS

__all__ = ["check_command", "parse_params", "resolve"]

#: How each status is shown.
COLORS = {"held": "green", "failed": "red", "not applicable": "yellow"}


def parse_params(text: str, target: str) -> dict[str, Any]:
    """``a=1,b=x`` as ``{"a": 1, "b": "x"}`` (each value a YAML scalar)."""
    params: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"{target}: parameter {item!r} is not name=value")
        try:
            params[key.strip()] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            params[key.strip()] = value
    return params


def variant_components(name: str, registry: Registry) -> list[tuple[str, str, dict[str, Any]]]:
    """The components the variant ``name`` puts in its slots (on the default task), with
    the parameters it gives them."""
    from ppokit.spec import DEFAULT_TASK, compose, validate_spec

    data = compose({"variant": name, "task": DEFAULT_TASK}, (), registry).data
    spec = validate_spec(data, registry)
    return [(kind, comp.name, dict(comp.params)) for _, kind, comp in spec.slots()]


def resolve(
    targets: list[str], registry: Registry | None = None
) -> list[tuple[str, str, dict[str, Any]]]:
    """The ``(kind, name, params)`` of every component the targets name, in order, each
    once; an unknown target is a :class:`RegistryError` with the close names."""
    registry = registry or get_registry()
    found: list[tuple[str, str, dict[str, Any]]] = []
    for target in targets:
        head, _, params_text = target.partition(":")
        if "/" in head:
            kind, _, name = head.partition("/")
            registry.info(kind, name)  # unknown kind or name: the registry's line
            found.append((kind, name, parse_params(params_text, target)))
            continue
        if params_text:
            raise UserError(f"{target}: parameters go with one component (KIND/NAME:a=1)")
        if head in KINDS:
            found += [(i.kind, i.name, {}) for i in registry.components(head)]
        elif head in registry.plugins and registry.plugins[head].ok:
            found += [(k, n, {}) for k, n in registry.plugins[head].components]
        elif registry.has_entry("variant", head):
            found += variant_components(head, registry)
        else:
            known = [
                *KINDS,
                *registry.plugins,
                *(i.name for i in registry.entries("variant")),
                *(f"{i.kind}/{i.name}" for i in registry.components()),
            ]
            raise RegistryError(
                f"unknown target {head!r}: not a plugin, a variant, a kind or KIND/NAME{suggest(head, known)}"
            )
    unique: dict[tuple[str, str, str], tuple[str, str, dict[str, Any]]] = {}
    for kind, name, params in found:
        unique.setdefault((kind, name, repr(sorted(params.items()))), (kind, name, params))
    return list(unique.values())


def check_command(
    targets: list[str] = typer.Argument(
        ...,
        help="A plugin (all its components), a variant (the components it assembles, with "
        "its parameters), a kind (all of it) or KIND/NAME (one component, parameters after "
        "a colon: policy_loss/cispo:clip_high=0.2).",
        metavar="TARGET...",
    ),
    examples: int = typer.Option(
        20, "--examples", min=1, max=10_000, help="Inputs hypothesis draws for each property."
    ),
    failed_only: bool = typer.Option(False, "--failed", help="Print the failed properties only."),
) -> None:
    """Check components against their kind's contract: each property held, failed (with
    the smallest counterexample found) or not applicable. Exit status 1 if any failed."""
    from ppokit.testing import check

    try:
        resolved = resolve(targets)
    except (RegistryError, UserError) as exc:
        raise fail(error_lines(exc)) from None
    failures = 0
    for result in check(resolved, examples=examples):
        failures += result.failed
        if failed_only and not result.failed:
            continue
        typer.secho(printable(result.line()), fg=COLORS[result.status])
    checked = len(resolved)
    summary = f"{checked} component(s) checked, {failures} failed propert{'y' if failures == 1 else 'ies'}"
    typer.secho(summary, fg="red" if failures else "green", err=True)
    if failures:
        raise typer.Exit(1)
