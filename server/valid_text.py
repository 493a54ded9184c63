"""Text that is not valid Unicode is refused before anything reads it.

JSON may spell a lone UTF-16 surrogate ("\\ud800"); Python keeps it in the string, and the
tokenizer, the chat template and the detokenizer then fail on it (a 500). A request holding one
anywhere gets a 400 naming the field instead: the client sent text that no model can read, and
replacing it silently would change the prompt behind the client's back.
"""

from __future__ import annotations

import re

from server.errors import APIError

_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(value, path: str = "") -> tuple[str, str] | None:
    """(field path, the surrogate) of the first lone surrogate in ``value``, or None."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        return (path, found.group()) if found else None
    if isinstance(value, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for where, item in items:
        if isinstance(where, str) and _SURROGATE.search(where):
            return where, _SURROGATE.search(where).group()
        found = lone_surrogate(item, where)
        if found:
            return found
    return None


def check_valid_text(body: dict) -> None:
    """A 400 naming the field when the request holds a lone surrogate anywhere."""
    found = lone_surrogate(body)
    if found is not None:
        where, char = found
        raise APIError(
            400,
            f"{where} contains a lone UTF-16 surrogate (U+{ord(char):04X}), which is not "
            "valid Unicode text",
            param=where,
            code="invalid_value",
        )
