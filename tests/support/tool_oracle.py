"""Chats with tools as SmolLM2 sees them, and what it answers them greedily under
`tool_choice="auto"`: a call or text, decided by HF transformers alone.

Tests of the served answer take their expectation from here rather than from the gateway's
tool formats. An auto grammar leaves the model's first tokens free enough for greedy decoding
to start as it does here: the Hermes and Llama 3 grammars allow any start of a text answer
or of a call, and the generic format's JSON envelope is the model restricted to the two ways
the envelope can open (`{"tool_calls": [` or `{"content": "`), as below.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from tests.support.grammar import smollm2_tokenizer
from tests.support.models import load_smollm2
from tests.support.templates import template_text

# How a call starts, in each format's own words (the format names of gateway/tool_formats/).
HERMES_CALL = "<tool_call>\n"
LLAMA3_CALL = '{"'
GENERIC_CALL, GENERIC_TEXT = '{"tool_calls": [', '{"content": "'


class Answer(StrEnum):
    CALL = "call"
    TEXT = "text"


def chat_tokens(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template: str | None = None,
) -> list[int]:
    """The prompt of `messages` (OpenAI's form) as a chat template renders it, with the
    generation prompt: SmolLM2's own template, or a test template by name (given `tools`)."""
    tokenizer = smollm2_tokenizer()
    history = json.loads(json.dumps(messages))
    for m in history:
        m["content"] = m["content"] or ""
        for call in m.get("tool_calls") or []:  # templates write the arguments out themselves
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    text = tokenizer.apply_chat_template(
        history,
        tools=tools,
        chat_template=None if template is None else template_text(template),
        add_generation_prompt=True,
        tokenize=False,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def auto_answer(tool_format: str, prompt: list[int], max_tokens: int) -> Answer:
    """Whether SmolLM2's greedy answer to `prompt`, in `max_tokens` tokens at most, is a call
    or text in `tool_format` (hermes, llama3_json or generic). AssertionError for an answer
    whose branch the served grammar would not follow from the model's own first tokens."""
    if tool_format == "generic":
        opening = _greedy(prompt, max_tokens, _decided, _consistent_with_an_opening)
        assert _decided(opening), repr(opening)
        return Answer.CALL if _consistent(opening, GENERIC_CALL) else Answer.TEXT
    if tool_format == "hermes":
        text = _greedy(prompt, max_tokens, lambda out: out.startswith(HERMES_CALL))
        if text.startswith(HERMES_CALL):
            return Answer.CALL
        assert HERMES_CALL.strip() not in text, f"text, then a call: {text!r}"
        return Answer.TEXT
    assert tool_format == "llama3_json", tool_format
    text = _greedy(prompt, max_tokens, lambda out: len(out) >= len(LLAMA3_CALL))
    # A call starts with an object, a text answer with anything else but space.
    assert text[:1].strip() and (text.startswith(LLAMA3_CALL) or text[0] != "{"), repr(text)
    return Answer.CALL if text.startswith(LLAMA3_CALL) else Answer.TEXT


def _decided(out: str) -> bool:
    return sum(_consistent(out, o) for o in (GENERIC_CALL, GENERIC_TEXT)) < 2


def _consistent(out: str, opening: str) -> bool:
    return opening.startswith(out) or out.startswith(opening)


def _consistent_with_an_opening(out: str) -> list[int]:
    """The tokens that keep `out` on the way to, or past, an envelope's opening."""
    return [
        i
        for i, piece in enumerate(_token_texts())
        if piece and any(_consistent(out + piece, o) for o in (GENERIC_CALL, GENERIC_TEXT))
    ]


def _greedy(
    prompt: list[int],
    max_tokens: int,
    done: Callable[[str], bool],
    allowed: Callable[[str], list[int]] | None = None,
) -> str:
    """HF's greedy continuation of `prompt` (among the `allowed` tokens, when given) until
    its end of turn, `max_tokens`, or `done` of the text so far."""
    import torch

    tokenizer, model = load_smollm2()
    ids, cache, new = torch.tensor([prompt]), None, []
    text = ""
    for _ in range(max_tokens):
        with torch.no_grad():
            out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        cache, logits = out.cache, out.logits[0, -1]  # [vocab]
        if allowed is None:
            token = int(logits.argmax())
        else:
            choices = allowed(text)
            token = choices[int(logits[choices].argmax())]
        if token == tokenizer.eos_token_id:
            break
        new.append(token)
        text = tokenizer.decode(new)
        if done(text):
            break
        ids = torch.tensor([[token]])
    return text


@functools.cache
def _token_texts() -> list[str]:
    tokenizer = smollm2_tokenizer()
    return [tokenizer.decode([i]) for i in range(len(tokenizer))]
