"""OpenAI request bodies -> GenerationInputs: prompts, text options and sampling parameters,
with errors naming the field the client sent."""

from __future__ import annotations

import functools
import uuid
from typing import Any

from gateway.chat_inputs import prepare_chat
from gateway.generation import GenerationCore
from gateway.generation_types import GenerationInput, Prompt, TextOptions
from gateway.openai_protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from gateway.prompts import text_prompt
from gateway.structured_outputs import check_admissible, grammar_of
from gateway.tokenization import check_template_kwargs
from gateway.tools import parse_tools
from llmserve.errors import FieldError
from llmserve.grammar.spec import GrammarSpec
from llmserve.limits import check_prompt_count
from llmserve.sampling_params import SamplingParams


async def completion_inputs(core: GenerationCore, body: CompletionRequest) -> list[GenerationInput]:
    """One input per prompt of a /v1/completions body; ids `cmpl-<hex>-<prompt index>`."""
    core.check_model(body.model)
    if body.suffix:
        raise FieldError("suffix", "is not supported")
    grammar = await _checked_grammar(
        core, grammar_of(body.response_format, body.structured_outputs)
    )
    response_id = f"cmpl-{uuid.uuid4().hex}"
    inputs = []
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    for i, prompt in enumerate(await _completion_prompts(core, body.prompt)):
        params = _sampling_params(
            core, body, prompt, body.max_tokens, "max_tokens", body.logprobs, prompt_logprobs
        )
        inputs.append(
            GenerationInput(
                f"{response_id}-{i}",
                prompt,
                params,
                _text_options(body),
                "text_completion",
                timeout_s=core.timeout_for(None),
                priority=body.priority,
                grammar=grammar,
            )
        )
    return inputs


async def chat_input(core: GenerationCore, body: ChatCompletionRequest) -> GenerationInput:
    """The input of a /v1/chat/completions body; id `chatcmpl-<hex>`."""
    core.check_model(body.model)
    tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls, core.limits)
    template_kwargs = check_template_kwargs(body.chat_template_kwargs, "chat_template_kwargs")
    if body.reasoning_effort is not None:
        template_kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    chat = await prepare_chat(
        core,
        [_message(m) for m in body.messages],
        tools,
        grammar_of(body.response_format, body.structured_outputs),
        body.add_generation_prompt,
        template_kwargs,
        body.thinking_token_budget,
    )
    max_tokens, field = body.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, field = body.max_tokens, "max_tokens"
    if body.top_logprobs is not None and not body.logprobs:
        raise FieldError("top_logprobs", "needs logprobs: true")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = _sampling_params(core, body, chat.prompt, max_tokens, field, logprobs, None)
    return GenerationInput(
        f"chatcmpl-{uuid.uuid4().hex}",
        chat.prompt,
        params,
        _text_options(body),
        "chat",
        timeout_s=core.timeout_for(None),
        priority=body.priority,
        grammar=chat.grammar,
        tools=chat.tools,
        reasoning=chat.reasoning,
    )


def _message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = m.tool_calls
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


async def _checked_grammar(core: GenerationCore, spec: GrammarSpec | None) -> GrammarSpec | None:
    if spec is not None:
        await check_admissible(spec, core.limits)
    return spec


async def _completion_prompts(core: GenerationCore, prompt: Any) -> list[Prompt]:
    if isinstance(prompt, str):
        return [await text_prompt(core, prompt)]
    if not prompt:
        raise FieldError("prompt", "must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [core.prompt_from_ids(prompt)]
    check_prompt_count(core.limits, len(prompt))
    if all(isinstance(p, str) for p in prompt):
        return [await text_prompt(core, p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    if all(isinstance(p, list) for p in prompt):
        return [core.prompt_from_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise FieldError("prompt", "must be a string, a list of strings, or token ids")


def _stop(body: CompletionRequest | ChatCompletionRequest) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def _text_options(body: CompletionRequest | ChatCompletionRequest) -> TextOptions:
    return TextOptions(
        tuple(_stop(body)), body.include_stop_str_in_output, body.skip_special_tokens
    )


def _sampling_params(
    core: GenerationCore,
    body: CompletionRequest | ChatCompletionRequest,
    prompt: Prompt,
    max_tokens: int | None,
    max_tokens_field: str,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    if body.logit_bias:
        raise FieldError("logit_bias", "is not supported")
    top_k = body.top_k or 0
    if top_k == -1:
        top_k = 0
    client_name = functools.partial(_client_field, body, max_tokens_field)

    def build(max_tokens_left: int) -> SamplingParams:
        try:
            return SamplingParams(
                n=body.n,
                best_of=body.best_of,
                use_beam_search=body.use_beam_search,
                length_penalty=body.length_penalty,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=top_k,
                min_p=body.min_p or 0.0,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=body.repetition_penalty or 1.0,
                seed=body.seed,
                max_tokens=max_tokens_left if max_tokens is None else max_tokens,
                min_tokens=body.min_tokens,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        except FieldError as exc:
            raise FieldError(client_name(exc.field), exc.detail) from exc

    return core.sampling_params(prompt, build, _stop(body), client_name)


def _client_field(
    body: CompletionRequest | ChatCompletionRequest, max_tokens_field: str, name: str | None
) -> str:
    """The body's field behind a SamplingParams field: the one name both SamplingParams'
    own errors and the server's limits give."""
    if name == "max_tokens":
        return max_tokens_field
    if name == "best_of" and body.best_of is None:
        return "n"  # best_of defaults to n; the client only sent n
    if name == "logprobs" and isinstance(body, ChatCompletionRequest):
        return "top_logprobs"
    return name or "body"
