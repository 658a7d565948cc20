"""JSON Schema of the spec, built from the installed registry.

Each component slot accepts one of the registered names of its kind as a string, or an
object ``{name: <const>, ...that component's parameters}`` that admits no other keys
(``data.source`` any string: a data file's path and ``hf:owner/name`` are sources too), or
a nameless object of one component's parameters, which the spec merges into the component
its variant or task names. A component with a required parameter is accepted by name only
in the object form. The rest of the
schema comes from the pydantic :class:`ppokit.spec.Spec` model.

Nothing here imports torch (unless a plugin's component has no params model, in which case
its factory's signature is read).
"""

from __future__ import annotations

import copy
from typing import Any

from ppokit.registry import KINDS, ComponentInfo, Registry, RegistryError, get_registry
from ppokit.slots import SLOTS, SOURCE
from ppokit.spec import Spec

__all__ = ["component_schema", "spec_schema"]

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _def_name(kind: str) -> str:
    return f"component.{kind}"


def _params_schema(info: ComponentInfo, defs: dict[str, Any]) -> dict[str, Any]:
    """The params model's schema; its nested definitions move into ``defs`` under a prefix."""
    prefix = f"{info.kind}.{info.name}."
    schema = info.params.model_json_schema(ref_template="#/$defs/" + prefix + "{model}")
    for key, sub in schema.pop("$defs", {}).items():
        defs[prefix + key] = sub
    return schema


def _component_object(
    info: ComponentInfo, defs: dict[str, Any], extra: dict[str, Any]
) -> dict[str, Any]:
    params = _params_schema(info, defs)
    properties = {"name": {"const": info.name}, **extra, **params.get("properties", {})}
    obj: dict[str, Any] = {
        "title": f"{info.kind} {info.name}",
        "type": "object",
        "properties": properties,
        "required": ["name", *params.get("required", [])],
        "additionalProperties": False,
    }
    if info.summary:
        obj["description"] = info.summary
    return obj


def _parameters_object(
    info: ComponentInfo, defs: dict[str, Any], extra: dict[str, Any]
) -> dict[str, Any]:
    """The nameless form: parameters merged into the slot's component as the variant or the
    task names it (the name and a required parameter come from there)."""
    params = _params_schema(info, defs)
    return {
        "title": f"{info.kind} {info.name}'s parameters, its name from the variant or task",
        "type": "object",
        "properties": {**extra, **params.get("properties", {})},
        "minProperties": 1,
        "additionalProperties": False,
    }


def component_schema(
    kind: str, registry: Registry | None = None, defs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Schema of one slot of ``kind``: a registered name, ``{name: ..., params...}`` or a
    nameless ``{params...}``."""
    registry = registry or get_registry()
    defs = {} if defs is None else defs
    extra = {"weight": {"type": "number", "default": 1.0}} if kind == "reward" else {}
    infos = []
    for info in registry.components(kind):
        try:
            info.params  # noqa: B018 - a lazy factory without a params model is imported here
        except RegistryError:
            continue  # a plugin's broken component leaves the others' schema intact
        infos.append(info)
    bare = [i.name for i in infos if not i.params.model_json_schema().get("required")]
    objects = [_component_object(i, defs, extra) for i in infos]
    objects += [_parameters_object(i, defs, extra) for i in infos]
    return {
        "title": f"{kind} component",
        "anyOf": [{"type": "string", "enum": bare}, *objects],
    }


def _replace_slot(schema: dict[str, Any], path: str, kind: str) -> None:
    """Point the property at ``path`` (``critic.target``) to the kind's definition."""
    ref = {"$ref": f"#/$defs/{_def_name(kind)}"}
    section, _, slot = path.rpartition(".")
    if section:
        section_ref = _ref_of(schema["properties"][section])
        holder = schema["$defs"][section_ref]
    else:
        holder = schema
    prop = holder["properties"][slot]
    keep = {k: v for k, v in prop.items() if k in ("default", "description", "title")}
    if kind == "reward":
        holder["properties"][slot] = {
            **keep,
            "anyOf": [ref, {"type": "array", "items": ref}],
        }
    else:
        holder["properties"][slot] = {**keep, **ref}


def _replace_source(schema: dict[str, Any]) -> None:
    """Point ``data.source`` (and so ``eval.data.source``) at the prompt sources' definition,
    beside any other string (a data file's path, ``hf:owner/name``)."""
    holder = schema["$defs"][_ref_of(schema["properties"][SOURCE.section or ""])]
    prop = holder["properties"][SOURCE.key]
    keep = {k: v for k, v in prop.items() if k in ("default", "description", "title")}
    ref = {"$ref": f"#/$defs/{_def_name(SOURCE.kind)}"}
    holder["properties"][SOURCE.key] = {**keep, "anyOf": [{"type": "string", "minLength": 1}, ref]}


def _ref_of(prop: dict[str, Any]) -> str:
    """The definition name a property refers to (directly or through ``anyOf`` with null)."""
    candidates = [prop, *prop.get("anyOf", [])]
    for c in candidates:
        if "$ref" in c:
            return c["$ref"].rsplit("/", 1)[-1]
    raise KeyError(f"no $ref in {prop}")


def spec_schema(registry: Registry | None = None) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a spec for the components installed now."""
    registry = registry or get_registry()
    schema = copy.deepcopy(Spec.model_json_schema())
    defs: dict[str, Any] = schema.setdefault("$defs", {})
    for kind in KINDS:
        defs[_def_name(kind)] = component_schema(kind, registry, defs)
    for s in SLOTS:
        _replace_slot(schema, s.path, s.kind)
    _replace_source(schema)
    for unused in ("ComponentSpec", "RewardSpec"):
        defs.pop(unused, None)
    schema["if"] = _NO_ENVIRONMENT
    schema["then"] = {"properties": {"reward": {"not": {"type": "array", "maxItems": 0}}}}
    return {"$schema": SCHEMA_DIALECT, **schema}


#: A spec without an environment (``rollout.environment`` absent or ``none``): it needs a
#: reward (an empty list is for an environment's rewards).
_NO_ENVIRONMENT: dict[str, Any] = {
    "not": {
        "required": ["rollout"],
        "properties": {
            "rollout": {
                "required": ["environment"],
                "properties": {
                    "environment": {
                        "not": {
                            "anyOf": [
                                {"const": "none"},
                                {"type": "object", "properties": {"name": {"const": "none"}}},
                            ]
                        }
                    }
                },
            }
        },
    }
}
