"""A chat request's prompt side, shared by every API that takes a conversation (the OpenAI
chat route and those built on it, and the gRPC `Chat`): the tool format renders the messages
and tools, the chat template makes the prompt, and the request learns what will read its
output (the tool grammar and parser, the reasoning parser). Each API checks its own fields
and names them its own way; what follows from them is decided here once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.generation import GenerationCore
from gateway.generation_types import Prompt
from gateway.prompts import chat_prompt
from gateway.reasoning import ReasoningRequest
from gateway.structured_outputs import check_admissible
from gateway.tools import ToolRequest
from llmserve.errors import FieldError
from llmserve.grammar.reasoning import BUDGET_FIELD
from llmserve.grammar.spec import GrammarSpec


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A chat made ready for generation: its prompt, the grammar its output must match
    (the request's own, or the tool format's), and how the output is read back."""

    prompt: Prompt
    grammar: GrammarSpec | None
    tools: ToolRequest | None
    # With the thinking budget the scheduler enforces.
    reasoning: ReasoningRequest | None


async def prepare_chat(
    core: GenerationCore,
    messages: list[dict[str, Any]],
    tools: ToolRequest | None,
    grammar: GrammarSpec | None,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any],
    thinking_budget: int | None = None,
) -> PreparedChat:
    """`messages` ({role, content[, name, tool_calls, tool_call_id]} each) and the checked
    `tools` and `template_kwargs` rendered into a prompt; `grammar` (the request's structured
    output) checked for admission, then framed as the reasoning format writes an answer.
    FieldError naming the field (OpenAI's names: `messages`, `tools`,
    `thinking_token_budget`) for what cannot be served."""
    fmt = core.tokenization.reasoning_format
    if thinking_budget is not None:
        if isinstance(thinking_budget, bool) or not isinstance(thinking_budget, int):
            raise FieldError(BUDGET_FIELD, f"must be an integer, got {thinking_budget!r}")
        if thinking_budget < 0:
            raise FieldError(BUDGET_FIELD, f"must be at least 0, got {thinking_budget}")
        if fmt is None:
            # The budget ends the reasoning: only a parsed reasoning has an end to find.
            raise FieldError(
                BUDGET_FIELD,
                "needs a model whose reasoning is parsed (this gateway has no reasoning "
                "parser: its chat template has no <think> block, or it runs with "
                "--reasoning-parser none)",
            )
    if tools is not None:
        if fmt is not None and fmt.tools_refused:
            raise FieldError("tools", fmt.tools_refused)
        if grammar is not None:
            raise FieldError(
                grammar.field, "cannot be combined with tools (unless tool_choice is none)"
            )
        grammar = core.tokenization.tool_format.grammar(tools)
    if grammar is not None:
        await check_admissible(grammar, core.limits)
    prompt = await tool_chat_prompt(core, messages, tools, add_generation_prompt, template_kwargs)
    reasoning = _reasoning(core, prompt, thinking_budget)
    if grammar is not None and reasoning is not None:
        grammar = reasoning.answer_grammar(grammar)
    return PreparedChat(prompt, grammar, tools, reasoning)


async def tool_chat_prompt(
    core: GenerationCore,
    messages: list[dict[str, Any]],
    tools: ToolRequest | None,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any] | None,
) -> Prompt:
    """The prompt of a chat with tools, rendered the tool format's way (the tools given to
    the template, or written into the messages)."""
    rendered, template_tools = core.tokenization.tool_format.render(messages, tools)
    return await chat_prompt(
        core, rendered, add_generation_prompt, "messages", template_tools, template_kwargs
    )


def _reasoning(core: GenerationCore, prompt: Prompt, budget: int | None) -> ReasoningRequest | None:
    """How the output of a chat `prompt` is told into reasoning and answer, with its thinking
    budget (`budget`; None: the gateway's --thinking-token-budget); None when the model has
    no reasoning parser."""
    fmt = core.tokenization.reasoning_format
    if fmt is None:
        return None
    if budget is None:
        budget = core.tokenization.default_thinking_budget
    assert prompt.text is not None  # a chat prompt keeps its rendered text
    return ReasoningRequest(fmt, fmt.opened_in(prompt.text), fmt.closed_in(prompt.text), budget)
