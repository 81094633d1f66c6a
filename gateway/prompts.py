"""Prompts tokenized off the event loop: a long text (a large prompt or chat) is tokenized in
a thread, so that the gateway's event loop goes on serving every other stream meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.generation import GenerationCore
from gateway.generation_types import Prompt

# Texts longer than this are tokenized in a thread (about a millisecond of tokenizing).
INLINE_TOKENIZE_CHARS = 4096


async def text_prompt(core: GenerationCore, text: str, field_name: str = "prompt") -> Prompt:
    """core.prompt_from_text, in a thread for a long text."""
    if isinstance(text, str) and len(text) > INLINE_TOKENIZE_CHARS:
        return await asyncio.to_thread(core.prompt_from_text, text, field_name)
    return core.prompt_from_text(text, field_name)


async def chat_prompt(
    core: GenerationCore,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    field_name: str = "messages",
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> Prompt:
    """core.prompt_from_chat, in a thread when the messages (or tools) are long."""
    size = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    if tools:
        size += INLINE_TOKENIZE_CHARS  # schemas rendered by a template: never inline
    if size > INLINE_TOKENIZE_CHARS:
        return await asyncio.to_thread(
            core.prompt_from_chat,
            messages,
            add_generation_prompt,
            field_name,
            tools,
            template_kwargs,
        )
    return core.prompt_from_chat(
        messages, add_generation_prompt, field_name, tools, template_kwargs
    )
