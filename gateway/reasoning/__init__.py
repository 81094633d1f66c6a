"""Reasoning formats: how a model's thinking is told apart from its answer, one module per
format, and the choice among them (`--reasoning-parser`: a name, or `auto` to read it off the
chat template)."""

from __future__ import annotations

from gateway.reasoning.base import (
    ReasoningDelta,
    ReasoningFormat,
    ReasoningParser,
    ReasoningRequest,
)
from gateway.reasoning.harmony import CHANNEL, HARMONY, MESSAGE, HarmonyFormat
from gateway.reasoning.think_tags import THINK_CLOSE, THINK_OPEN, THINK_TAGS, ThinkTagsFormat

__all__ = [
    "FORMATS",
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningFormat",
    "ReasoningParser",
    "ReasoningRequest",
    "HarmonyFormat",
    "ThinkTagsFormat",
    "detect_format",
    "reasoning_format",
]

AUTO = "auto"
NONE = "none"
REASONING_PARSERS = (AUTO, NONE, THINK_TAGS, HARMONY)
_FLAG = "--reasoning-parser"

FORMATS: dict[str, ReasoningFormat] = {THINK_TAGS: ThinkTagsFormat(), HARMONY: HarmonyFormat()}


def detect_format(template: str | None) -> str:
    """`harmony` for a chat template that writes harmony's message headers (gpt-oss's),
    `think_tags` for one that writes both think tags, else `none`."""
    if not template:
        return NONE
    if CHANNEL in template and MESSAGE in template:
        return HARMONY
    if THINK_OPEN in template and THINK_CLOSE in template:
        return THINK_TAGS
    return NONE


def reasoning_format(name: str, template: str | None) -> ReasoningFormat | None:
    """The format `--reasoning-parser NAME` picks for this chat template (None: the output
    is all answer). ValueError naming the flag for an unknown name."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"{_FLAG}: must be one of {', '.join(REASONING_PARSERS)}, got {name!r}")
    if name == AUTO:
        name = detect_format(template)
    return FORMATS.get(name)
