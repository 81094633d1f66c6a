"""What a request asks its output to match, as it crosses the services (AddRequest.grammar)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from llmserve.errors import FieldError


class GrammarKind(IntEnum):
    """Values match the proto enum GrammarKind (GRAMMAR_KIND_*)."""

    JSON_SCHEMA = 1  # source: a JSON schema, serialized
    JSON_OBJECT = 2  # any JSON object; source is empty
    REGEX = 3  # source: a regular expression (Rust `regex` syntax)
    CHOICE = 4  # source: a JSON list of the allowed strings
    LARK = 5  # source: a Lark grammar (llguidance's dialect)
    GBNF = 6  # source: a GBNF / EBNF grammar (llama.cpp's dialect)


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A grammar as the client gave it. Equal specs compile to the same grammar, so the spec
    is the compile cache's key. `field` names the request field it came from, for errors."""

    kind: GrammarKind
    source: str
    field: str = "structured_outputs"

    @staticmethod
    def json_schema(schema: Any, field: str) -> GrammarSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise FieldError(field, f"is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise FieldError(field, "must be a JSON schema (an object)")
        # Key order is kept: it is the order the properties are generated in.
        return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema), field)

    @staticmethod
    def json_object(field: str) -> GrammarSpec:
        return GrammarSpec(GrammarKind.JSON_OBJECT, "", field)

    @staticmethod
    def regex(pattern: Any, field: str) -> GrammarSpec:
        if not isinstance(pattern, str) or not pattern:
            raise FieldError(field, "must be a non-empty regular expression")
        return GrammarSpec(GrammarKind.REGEX, pattern, field)

    @staticmethod
    def choice(options: Any, field: str) -> GrammarSpec:
        if (
            not isinstance(options, list)
            or not options
            or not all(isinstance(o, str) and o for o in options)
        ):
            raise FieldError(field, "must be a non-empty list of non-empty strings")
        return GrammarSpec(GrammarKind.CHOICE, json.dumps(options), field)

    @staticmethod
    def grammar(text: Any, field: str) -> GrammarSpec:
        """Lark (llguidance's dialect) or GBNF, told apart by GBNF's `::=` rules."""
        if not isinstance(text, str) or not text.strip():
            raise FieldError(field, "must be a non-empty grammar")
        kind = GrammarKind.GBNF if "::=" in text else GrammarKind.LARK
        return GrammarSpec(kind, text, field)
