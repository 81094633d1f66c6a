"""Grammar test helpers: the embedded model's tokenizer (SmolLM2) and schemas whose every
valid output is short, so a model that picks allowed tokens at random still finishes them."""

from __future__ import annotations

import copy
import functools
from typing import Any

from llmserve.model_spec import load_tokenizer, resolve_model

# A tool whose arguments are bounded (an enum and a small integer).
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Lyon", "Nice"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}

# Every field bounded: enums, small integers, booleans, a fixed-shape string, a short array.
BOUNDED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "size": {
            "type": "object",
            "properties": {"w": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["w"],
            "additionalProperties": False,
        },
    },
    "required": ["color", "count", "ok", "code", "tags", "size"],
    "additionalProperties": False,
}


@functools.cache
def _tokenizer() -> Any:
    return load_tokenizer(resolve_model("smollm2"))


def smollm2_tokenizer() -> Any:
    """The SmolLM2 tokenizer, loaded once per test process (`make setup` installs it)."""
    return _tokenizer()


# gpt-oss's harmony tags, all special tokens of its tokenizer.
HARMONY_TAGS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
)


@functools.cache
def _harmony_tokenizer() -> Any:
    tokenizer = copy.deepcopy(_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": list(HARMONY_TAGS)})
    tokenizer.add_special_tokens({"eos_token": "<|return|>"})
    return tokenizer


def harmony_tokenizer() -> Any:
    """SmolLM2's tokenizer with harmony's tags added as special tokens and `<|return|>` its
    EOS, as gpt-oss's tokenizer has them (for tests/support/templates/harmony.jinja). Shared:
    do not change it."""
    return _harmony_tokenizer()
