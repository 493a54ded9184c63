"""Structured output fields -> the engine's ``ConstraintSpec``, checked before a response starts.

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) and vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and their newer
``structured_outputs`` object. At most one constraint per request; a schema that uses a
feature the grammar engine does not implement, an invalid regex or grammar, a key that
``response_format`` does not define, is a 400 naming the field (``response_format.schema``),
never a silent ignore.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, ValidationError

from engine.constraints.spec import ConstraintSpec
from server.errors import APIError, field_path
from server.protocol import NestedObject

_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar", "json_object": "json_object"}  # fmt: skip


def requested_constraint(body) -> tuple[str, ConstraintSpec] | None:
    """The request's output constraint and the field that asked for it (None: free text),
    not yet compiled (``check_usable``); raises a 400 naming the field."""
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
    name, spec = found[0] if found else ("", None)
    if body.guided_whitespace_pattern is not None:
        if spec is None or spec.kind not in ("json_schema", "json_object"):
            # Without JSON output it would shape nothing: refused, not ignored.
            raise _bad(
                "guided_whitespace_pattern",
                "guided_whitespace_pattern applies to JSON output only (guided_json, a "
                "json_object or json_schema response_format, structured_outputs json or "
                "json_object), and this request asks for none",
            )
        spec = ConstraintSpec(spec.kind, spec.source, body.guided_whitespace_pattern)
    return None if spec is None else (name, spec)


def check_usable(name: str, spec: ConstraintSpec, vocabulary: Callable[[], Any] | None) -> None:
    """Compile the constraint; a 400 naming ``name`` if it cannot be used. With the model's
    vocabulary (an llguidance tokenizer, from ``vocabulary``) the check also catches what only
    the vocabulary decides, such as a special token it lacks."""
    error = spec.error(None if vocabulary is None else vocabulary())
    if error:
        raise _bad(name, f"{name}: the constraint cannot be used: {error}")


class _TextFormat(NestedObject):
    type: Literal["text"]


class _JsonObjectFormat(NestedObject):
    type: Literal["json_object"]


class _JsonSchema(NestedObject):
    name: str  # required, as OpenAI requires it
    description: str | None = None
    # Optional in OpenAI's API, where none means any JSON: ask for json_object for that.
    schema_: dict[str, Any] | str = Field(alias="schema")
    strict: bool | None = None  # either way, the schema is enforced


class _JsonSchemaFormat(NestedObject):
    type: Literal["json_schema"]
    json_schema: _JsonSchema


_FORMATS: dict[str, type[NestedObject]] = {
    "text": _TextFormat,
    "json_object": _JsonObjectFormat,
    "json_schema": _JsonSchemaFormat,
}


def _response_format(value: dict[str, Any]) -> ConstraintSpec | None:
    kind = value.get("type")
    model = _FORMATS.get(kind) if isinstance(kind, str) else None
    if model is None:
        message = f"response_format.type must be text, json_object or json_schema, got {kind!r}"
        raise _bad("response_format.type", message)
    try:
        parsed = model.model_validate(value)
    except ValidationError as e:
        raise _format_error(kind, e) from None
    if isinstance(parsed, _JsonObjectFormat):
        return ConstraintSpec("json_object")
    if isinstance(parsed, _JsonSchemaFormat):
        schema = _json_value(parsed.json_schema.schema_, "response_format.json_schema.schema")
        return ConstraintSpec("json_schema", schema)
    return None


def _format_error(kind: str, error: ValidationError) -> APIError:
    """The first problem in a response_format, named by its full path."""
    first = error.errors()[0]
    loc = [part for part in (field_path(first["loc"]) or "").split(".") if part]
    param = ".".join(["response_format", *loc])
    if first["type"] == "missing":
        return _bad(param, f"{param} is required for a {kind!r} response_format")
    if first["type"] == "extra_forbidden":
        nested = len(loc) > 1  # inside json_schema
        model = _JsonSchema if nested else _FORMATS[kind]
        known = ", ".join(f.alias or name for name, f in model.model_fields.items())
        where = "response_format.json_schema" if nested else f"a {kind!r} response_format"
        return _bad(param, f"{param} is not a field of {where} (its fields: {known})")
    if first["type"] in ("model_type", "dict_type"):
        return _bad(param, f"{param} must be an object")
    return _bad(param, f"{param}: {first['msg']}")


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
