"""`POST /tokenize` and `POST /detokenize`, as vLLM's server has them: a prompt (or a chat,
rendered by the chat template) to token ids, and token ids back to text. Nothing is sent to
the scheduler."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from gateway.generation import GenerationCore
from gateway.http_errors import error_responses
from gateway.openai_protocol import ChatMessage
from gateway.tokenization import check_template_kwargs, check_unicode
from llmserve.errors import FieldError
from llmserve.limits import check_prompt_tokens

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


@router.post("/tokenize", responses=error_responses(400, 401, 404, 503))
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    core: GenerationCore = request.app.state.core
    core.check_model(body.model)
    tokenization = core.tokenization
    if (body.prompt is None) == (body.messages is None):
        raise FieldError("prompt", "give either prompt or messages")
    if body.messages is not None:
        text = tokenization.render_chat(
            [{"role": m.role, "content": m.text()} for m in body.messages],
            add_generation_prompt=body.add_generation_prompt,
            template_kwargs=check_template_kwargs(
                body.chat_template_kwargs, "chat_template_kwargs"
            ),
        )
        # The template writes its own special tokens.
        ids = tokenization.encode(text, add_special_tokens=bool(body.add_special_tokens))
    else:
        assert body.prompt is not None
        check_unicode(body.prompt, "prompt")
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = tokenization.encode(body.prompt, add_special_tokens=add)
    check_prompt_tokens(core.limits, len(ids), "prompt")
    out: dict[str, Any] = {"count": len(ids), "max_model_len": core.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tokenization.tokenizer.convert_ids_to_tokens(ids)
    return out


@router.post("/detokenize", responses=error_responses(400, 401, 404, 503))
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    core: GenerationCore = request.app.state.core
    core.check_model(body.model)
    vocab = core.tokenization.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise FieldError("tokens", f"token id {bad} is outside [0, {vocab})")
    return {"prompt": core.tokenization.tokenizer.decode(body.tokens)}
