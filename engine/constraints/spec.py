"""What a request constrains its output to, as an llguidance grammar."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from llguidance import LLMatcher

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# JSON's whitespace between tokens, bounded: unbounded whitespace lets a model that likes
# newlines loop on them forever inside a valid document (a failure known from other servers).
# Enough for pretty-printing a few levels deep; a request may set its own (vLLM's
# guided_whitespace_pattern).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"


@dataclass(frozen=True)
class ConstraintSpec:
    """``source``: the schema (a dict), the regex, the list of choices, or the Lark grammar;
    None for ``json_object`` (any JSON object)."""

    kind: Kind
    source: Any = None
    whitespace: str | None = None  # JSON kinds: the regex of whitespace between tokens

    def grammar(self) -> str:
        """The llguidance grammar string; raises ValueError for a source of the wrong type."""

        whitespace = JSON_WHITESPACE if self.whitespace is None else self.whitespace
        options = {"whitespace_pattern": whitespace, "whitespace_flexible": bool(whitespace)}
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
        if self.kind == "json_schema":
            if not isinstance(self.source, dict):
                raise ValueError("a JSON schema must be an object")
            return LLMatcher.grammar_from_json_schema(self.source, overrides=options)
        if self.kind == "regex":
            if not isinstance(self.source, str):
                raise ValueError("a regex must be a string")
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            choices = self.source
            if not (
                isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)
            ):
                raise ValueError("choices must be a non-empty list of strings")
            return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in choices))
        if self.kind == "grammar":
            if not isinstance(self.source, str):
                raise ValueError("a grammar must be a string (Lark syntax)")
            return LLMatcher.grammar_from_lark(self.source)
        raise ValueError(f"unknown constraint kind {self.kind!r}")

    def error(self, tokenizer=None) -> str | None:
        """Why the constraint cannot be used (an unsupported schema feature, a bad regex), or
        None; ``tokenizer`` (an LLTokenizer) also checks it against the vocabulary."""

        try:
            grammar = self.grammar()
        except ValueError as e:
            return str(e)
        return LLMatcher.validate_grammar(grammar, tokenizer) or None

    def describe(self) -> str:
        source = self.source if isinstance(self.source, str) else json.dumps(self.source)
        return f"{self.kind}: {source[:80]}" if source else self.kind
