"""The gateway request span's gen_ai.* attributes (OpenTelemetry's GenAI conventions)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry import trace

if TYPE_CHECKING:
    from gateway.generation_types import GenerationInput, GenerationUpdate


def set_request_attributes(span: trace.Span, inp: GenerationInput, model: str) -> None:
    if not span.is_recording():
        return
    p = inp.params
    span.set_attributes(
        {
            "gen_ai.operation.name": inp.operation,
            "gen_ai.system": "llmserve",
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": p.max_tokens,
            "gen_ai.request.temperature": p.temperature,
            "gen_ai.request.top_p": p.top_p,
            "gen_ai.request.choice.count": p.n,
            "gen_ai.usage.input_tokens": len(inp.prompt.token_ids),
            "llmserve.request_id": inp.request_id,
        }
    )
    if p.seed is not None:
        span.set_attribute("gen_ai.request.seed", p.seed)


def set_response_attributes(
    span: trace.Span, update: GenerationUpdate, finish_reasons: list[str]
) -> None:
    if not span.is_recording():
        return
    assert update.usage is not None and update.metrics is not None
    span.set_attributes(
        {
            "gen_ai.response.finish_reasons": finish_reasons,
            "gen_ai.usage.output_tokens": update.usage.completion_tokens,
            "llmserve.time_to_first_token_s": update.metrics.first_token_ns / 1e9,
        }
    )
