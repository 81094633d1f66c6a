"""Request bodies of the OpenAI-compatible API (plus vLLM's extra sampling fields)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Unknown fields are ignored, as OpenAI's SDKs may send newer ones.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Annotated[int, Field(ge=1, le=64)] = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras.
    best_of: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Lower is served first; checked as an int32 by GenerationInput (a FieldError naming it).
    priority: int = 0
    # Structured output: OpenAI's response_format ({"type": "json_object"} or
    # {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}) and vLLM's
    # structured_outputs (one of json, regex, choice, grammar).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    # An assistant turn's calls ({"id", "type": "function", "function": {"name",
    # "arguments"}}), and the call a "tool" turn answers.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Variables the chat template reads (Qwen3's enable_thinking), over the gateway's
    # --default-chat-template-kwargs.
    chat_template_kwargs: dict[str, Any] | None = None
    # Passed to the chat template as `reasoning_effort`, for templates that read it.
    reasoning_effort: str | None = None
    # Tokens the model may think before the scheduler closes its reasoning block (needs a
    # reasoning parser); default the gateway's --thinking-token-budget.
    thinking_token_budget: int | None = None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


# -- responses (documented in the OpenAPI schema so clients and conformance tests can check
# them; the handlers build plain dicts of the same shape) ------------------------------------


class SpeculativeUsage(BaseModel):
    """llmserve's extension: draft tokens verified for the request, and kept."""

    draft_tokens: int
    accepted_tokens: int


class CompletionTokensDetails(BaseModel):
    # Output tokens up to the end of the reasoning block, its tags included.
    reasoning_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Present when a reasoning parser read the output.
    completion_tokens_details: CompletionTokensDetails | None = None
    # Present only when the request ran with speculative decoding.
    speculative_decoding: SpeculativeUsage | None = None


class CompletionLogprobs(BaseModel):
    # None at the first prompt position when the prompt is echoed (it has no logprob).
    tokens: list[str | None]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    # The model's thinking, with a reasoning parser (--reasoning-parser).
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class HealthStatus(BaseModel):
    status: str
