"""Structured output requests: OpenAI's `response_format` and vLLM's `structured_outputs`
turned into one `GrammarSpec`, checked at admission.

The admission check compiles the grammar without the tokenizer (llguidance's validation):
a malformed schema or grammar, or a schema feature that cannot be enforced, is a 400 naming
the field before anything is queued. The token-level compile happens on the scheduler, off
the time-to-first-token path (the prompt prefills meanwhile).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gateway import metrics
from llmserve.errors import FieldError, ResourceExhaustedError
from llmserve.grammar.backend import GrammarError
from llmserve.grammar.llguidance_backend import check_grammar
from llmserve.grammar.spec import GrammarSpec
from llmserve.limits import RequestLimits

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar")


def grammar_of(
    response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None
) -> GrammarSpec | None:
    """The request's grammar (None: free text). Raises FieldError naming the field."""
    spec = _from_response_format(response_format)
    extra = _from_structured_outputs(structured_outputs)
    if spec is not None and extra is not None:
        raise FieldError("structured_outputs", "cannot be combined with response_format")
    return spec or extra


def _from_response_format(rf: dict[str, Any] | None) -> GrammarSpec | None:
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise FieldError("response_format", "must be an object")
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec.json_object("response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise FieldError("response_format.json_schema", "required for type json_schema")
        name = js.get("name")
        if not isinstance(name, str) or not name:
            raise FieldError("response_format.json_schema.name", "must be a non-empty string")
        if "schema" not in js:
            # OpenAI allows it; the output is then any JSON object.
            return GrammarSpec.json_object("response_format")
        if js.get("strict") not in (None, True, False):
            raise FieldError("response_format.json_schema.strict", "must be a boolean")
        return GrammarSpec.json_schema(js["schema"], "response_format")
    raise FieldError(
        "response_format.type", f"must be text, json_object or json_schema, got {kind!r}"
    )


def _from_structured_outputs(so: dict[str, Any] | None) -> GrammarSpec | None:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise FieldError("structured_outputs", "must be an object")
    given = [k for k in _STRUCTURED_KEYS if so.get(k) is not None]
    unknown = sorted(k for k in so if k not in _STRUCTURED_KEYS and so[k] is not None)
    if unknown:
        raise FieldError(f"structured_outputs.{unknown[0]}", "is not supported")
    if not given:
        return None
    if len(given) > 1:
        raise FieldError(
            "structured_outputs", f"one of {', '.join(_STRUCTURED_KEYS)}, got {', '.join(given)}"
        )
    key = given[0]
    field = f"structured_outputs.{key}"
    value = so[key]
    if key == "json":
        return GrammarSpec.json_schema(value, field)
    if key == "regex":
        return GrammarSpec.regex(value, field)
    if key == "choice":
        return GrammarSpec.choice(value, field)
    return GrammarSpec.grammar(value, field)


async def check_admissible(spec: GrammarSpec, limits: RequestLimits) -> None:
    """Size limit, then the compile check in a thread (the event loop serves other streams
    meanwhile), bounded by --max-grammar-check-ms (429: the server is busy with it)."""
    size = len(spec.source.encode())
    if size > limits.max_grammar_bytes:
        metrics.GRAMMAR_REFUSED.labels("too_large").inc()
        raise FieldError(
            spec.field,
            f"{size} bytes is over this server's limit of "
            f"{limits.max_grammar_bytes} (--max-grammar-bytes)",
        )
    start = time.perf_counter()
    try:
        await asyncio.wait_for(
            asyncio.to_thread(check_grammar, spec), limits.max_grammar_check_ms / 1000
        )
    except GrammarError as exc:
        metrics.GRAMMAR_REFUSED.labels("invalid").inc()
        raise FieldError(exc.field, exc.detail) from None
    except TimeoutError:
        metrics.GRAMMAR_REFUSED.labels("slow").inc()
        raise ResourceExhaustedError(
            f"{spec.field}: the grammar took longer than {limits.max_grammar_check_ms} ms to "
            "check (--max-grammar-check-ms)",
            spec.field,
        ) from None
    finally:
        metrics.GRAMMAR_CHECKS.observe(time.perf_counter() - start)
