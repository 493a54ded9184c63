"""Structured output fields -> the engine's ``ConstraintSpec``, checked before a response starts.

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) and vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and their newer
``structured_outputs`` object. At most one constraint per request; a schema that uses a
feature the grammar engine does not implement, an invalid regex or grammar, is a 400 naming
the field, never a silent ignore.
"""

from __future__ import annotations

import json
from typing import Any

from engine.constraints import ConstraintSpec
from server.errors import APIError

_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar", "json_object": "json_object"}  # fmt: skip


def constraint_of(body) -> ConstraintSpec | None:
    """The request's output constraint (None: free text); raises a 400 naming the field."""
    found: list[tuple[str, ConstraintSpec]] = []
    if body.response_format is not None:
        spec = _response_format(body.response_format)
        if spec is not None:
            found.append(("response_format", spec))
    guided = {
        "guided_json": "json_schema",
        "guided_regex": "regex",
        "guided_choice": "choice",
        "guided_grammar": "grammar",
    }
    for name, kind in guided.items():
        value = getattr(body, name)
        if value is not None:
            source = _json_value(value, name) if kind == "json_schema" else value
            found.append((name, ConstraintSpec(kind, source)))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(body.structured_outputs)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise _bad(found[1][0], f"give at most one output constraint, got {names}")
    if not found:
        return None
    name, spec = found[0]
    if body.guided_whitespace_pattern is not None:
        if spec.kind not in ("json_schema", "json_object"):
            raise _bad(
                "guided_whitespace_pattern", "guided_whitespace_pattern applies to JSON only"
            )
        spec = ConstraintSpec(spec.kind, spec.source, body.guided_whitespace_pattern)
    error = spec.error()
    if error:
        raise _bad(name, f"{name}: the constraint cannot be used: {error}")
    return spec


def _response_format(value: Any) -> ConstraintSpec | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object")
    if kind == "json_schema":
        wrapper = value.get("json_schema")
        if not isinstance(wrapper, dict) or "schema" not in wrapper:
            # OpenAI requires the schema; an empty one would mean "any JSON".
            raise _bad("response_format", "response_format.json_schema.schema is required")
        return ConstraintSpec("json_schema", _json_value(wrapper["schema"], "response_format"))
    raise _bad("response_format", "response_format.type must be text, json_object or json_schema")


def _structured_outputs(value: Any) -> ConstraintSpec:
    given = {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else None
    if given is None or len(given) != 1 or next(iter(given)) not in _STRUCTURED_KEYS:
        keys = ", ".join(_STRUCTURED_KEYS)
        raise _bad("structured_outputs", f"structured_outputs takes exactly one of: {keys}")
    key, source = next(iter(given.items()))
    kind = _STRUCTURED_KEYS[key]
    if kind == "json_object":
        if source is not True:
            raise _bad("structured_outputs", "structured_outputs.json_object must be true")
        return ConstraintSpec("json_object")
    if kind == "json_schema":
        source = _json_value(source, "structured_outputs")
    return ConstraintSpec(kind, source)


def _json_value(value: Any, name: str) -> Any:
    """vLLM accepts a schema as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise _bad(name, f"{name}: not valid JSON: {e}") from None
    return value


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")
