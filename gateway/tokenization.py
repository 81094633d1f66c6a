"""The model's tokenizer on the gateway: load it once per model, encode prompts, render chats.

The gateway owns prompts and their text; the scheduler decodes outputs only to find stop
strings (scheduler_service/engine/text_stops.py), and workers see token ids alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.reasoning import reasoning_format
from gateway.tool_formats import tool_format
from llmserve.errors import FieldError
from llmserve.model_spec import ModelSource, load_tokenizer


class Tokenization:
    """Prompt-side text operations on one tokenizer."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None = None,
        tool_parser: str = "auto",
        reasoning_parser: str = "auto",
        default_template_kwargs: Mapping[str, Any] | None = None,
        default_thinking_budget: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # A Jinja chat template that replaces the tokenizer's own (`--chat-template FILE`).
        self.chat_template = chat_template
        # How chats with tools are rendered and their calls read back (--tool-call-parser).
        self.tool_format = tool_format(tool_parser, self.template_source())
        # How the model's reasoning is told from its answer (--reasoning-parser); None: no
        # reasoning is parsed.
        self.reasoning_format = reasoning_format(reasoning_parser, self.template_source())
        # Variables every chat template rendering gets (--default-chat-template-kwargs); a
        # request's chat_template_kwargs override them.
        self.default_template_kwargs = dict(default_template_kwargs or {})
        # Thinking tokens a chat gets when it names no budget (--thinking-token-budget; None:
        # no bound but max_tokens).
        self.default_thinking_budget = default_thinking_budget
        self._tag_ids: dict[str, list[int]] = {}
        # special_ids_but's answers, by the tags kept.
        self._special_ids_but: dict[tuple[str, ...], frozenset[int]] = {}

    @classmethod
    def for_model(
        cls,
        source: ModelSource,
        chat_template: str | None = None,
        tool_parser: str = "auto",
        reasoning_parser: str = "auto",
        default_template_kwargs: Mapping[str, Any] | None = None,
        default_thinking_budget: int | None = None,
    ) -> Tokenization:
        return cls(
            load_tokenizer(source),
            chat_template,
            tool_parser,
            reasoning_parser,
            default_template_kwargs,
            default_thinking_budget,
        )

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

    def tag_ids(self, text: str) -> list[int]:
        """A reasoning format's tag `text` as output tokens (no special tokens added), encoded
        once per tag: every reasoning request sends them."""
        ids = self._tag_ids.get(text)
        if ids is None:
            ids = self._tag_ids[text] = self.encode(text, add_special_tokens=False)
        return ids

    def special_ids_but(self, kept: tuple[str, ...]) -> frozenset[int]:
        """The ids that decoding with skip_special_tokens leaves out (the tokenizer's special
        tokens), but those whose text is one of `kept`."""
        found = self._special_ids_but.get(kept)
        if found is None:
            added = self.tokenizer.added_tokens_decoder
            special = {i for i, t in added.items() if t.special} | set(
                self.tokenizer.all_special_ids
            )
            keep = {i for i, t in added.items() if t.content in kept}
            found = self._special_ids_but[kept] = frozenset(special - keep)
        return found

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
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat template's text for `messages` ({role, content[, name, tool_calls,
        tool_call_id]} each) and `tools` (for templates that render them); `template_kwargs`
        (a request's chat_template_kwargs) are variables the template may read."""
        checked = _check_messages(messages, field_name)
        variables = {**self.default_template_kwargs, **(template_kwargs or {})}
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
                **variables,
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


# apply_chat_template's own arguments: a template variable of one of these names could not
# be passed (or would change how the prompt is made).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def check_template_kwargs(kwargs: Any, field_name: str) -> dict[str, Any]:
    """A request's (or the gateway's default) chat_template_kwargs: an object whose keys are
    not apply_chat_template's own arguments."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise FieldError(field_name, "must be an object")
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
            raise FieldError(f"{field_name}.{key}", "cannot be passed to the chat template")
    return dict(kwargs)


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
