"""The model's tokenizer on the gateway: load it once per model, encode prompts, render chats.

The gateway owns prompts and their text; the scheduler decodes outputs only to find stop
strings (scheduler_service/engine/text_stops.py), and workers see token ids alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.tool_formats import tool_format
from llmserve.errors import FieldError
from llmserve.model_spec import ModelSource, load_tokenizer


class Tokenization:
    """Prompt-side text operations on one tokenizer."""

    def __init__(
        self, tokenizer: Any, chat_template: str | None = None, tool_parser: str = "auto"
    ) -> None:
        self.tokenizer = tokenizer
        # A Jinja chat template that replaces the tokenizer's own (`--chat-template FILE`).
        self.chat_template = chat_template
        # How chats with tools are rendered and their calls read back (--tool-call-parser).
        self.tool_format = tool_format(tool_parser, self.template_source())

    @classmethod
    def for_model(
        cls, source: ModelSource, chat_template: str | None = None, tool_parser: str = "auto"
    ) -> Tokenization:
        return cls(load_tokenizer(source), chat_template, tool_parser)

    def template_source(self) -> str | None:
        """The chat template in use (a model's named templates, joined)."""
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):
            return "\n".join(str(t) for t in template.values())
        return template

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def count_tokens(self, text: str, *, add_special_tokens: bool = True) -> int:
        return len(self.encode(text, add_special_tokens=add_special_tokens))

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own text (partial characters render as U+FFFD), for logprobs."""
        return [self.tokenizer.decode([t]) for t in token_ids]

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        field_name: str = "messages",
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat template's text for `messages` ({role, content[, name, tool_calls,
        tool_call_id]} each) and `tools` (for templates that render them)."""
        checked = _check_messages(messages, field_name)
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise FieldError(
                field_name,
                "this model has no chat template (a base model?): send a text prompt to the "
                "completions API, or start the server with --chat-template FILE",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                checked,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=template,
                tools=tools,
            )
        except Exception as exc:  # jinja raises TemplateError / exceptions the template raises
            raise FieldError(field_name, f"the chat template rejected the messages: {exc}") from exc
        assert isinstance(text, str)
        return text

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        field_name: str = "messages",
    ) -> list[int]:
        """Token ids of the rendered chat. The template writes its own special tokens (BOS),
        so the tokenizer must not add them again."""
        text = self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, field_name=field_name
        )
        return self.encode(text, add_special_tokens=False)


def _check_messages(messages: Sequence[Mapping[str, Any]], field_name: str) -> list[dict[str, Any]]:
    if not messages:
        raise FieldError(field_name, "must contain at least one message")
    checked = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise FieldError(f"{field_name}[{i}].role", "must be a non-empty string")
        if not isinstance(content, str):
            raise FieldError(f"{field_name}[{i}].content", "must be a string")
        check_unicode(content, f"{field_name}[{i}].content")
        entry: dict[str, Any] = {"role": role, "content": content}
        name = message.get("name")
        if name:
            entry["name"] = str(name)
        # Set only by a tool format whose template renders calls and their results.
        for key in ("tool_calls", "tool_call_id"):
            if message.get(key):
                entry[key] = message[key]
        checked.append(entry)
    return checked


def check_unicode(text: str, field_name: str) -> None:
    """Text from JSON may hold lone surrogates ("\\ud800"), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FieldError(
            field_name,
            f"is not valid Unicode: a lone surrogate {text[exc.start]!r} at position {exc.start}",
        ) from None
