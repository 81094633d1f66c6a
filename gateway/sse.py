"""Server-sent events as the HTTP APIs stream them: one JSON payload per event, encoded once.

orjson writes compact UTF-8 JSON (no spaces, non-ASCII characters as they are); a float
that JSON cannot hold (NaN, an infinity) becomes null, where the standard library would
write a token that JSON parsers reject.
"""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


def data_event(payload: Any) -> bytes:
    """`data: <json>` and the blank line that ends an event (OpenAI's streams)."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def named_event(name: str, payload: Any) -> bytes:
    """An event with its `event:` line (the Responses and Messages streams)."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"
