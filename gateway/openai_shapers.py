"""Response shapes of /v1/completions and /v1/chat/completions: one base turns generation
updates into SSE chunks and full bodies; each endpoint shapes only its own choice."""

from __future__ import annotations

import abc
from typing import Any

from gateway.generation import GenerationCore
from gateway.generation_types import ChoiceUpdate, GenerationInput, LogprobEntry, Usage
from gateway.tool_formats import CallParser, ToolCallDelta
from llmserve.v1 import common_pb2

PromptLogprobs = list[LogprobEntry | None]


def usage_dict(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage block; with speculative decoding, llmserve's extension field
    `speculative_decoding` (`UsageInfo`)."""
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
    if usage.spec_draft_tokens:
        out["speculative_decoding"] = {
            "draft_tokens": usage.spec_draft_tokens,
            "accepted_tokens": usage.spec_accepted_tokens,
        }
    return out


# A chat choice that stopped after tool calls (OpenAI's name; the scheduler's reason is STOP).
TOOL_CALLS_FINISH = "tool_calls"

# common.proto's FinishReason as OpenAI's `finish_reason`: the one mapping. OpenAI has no
# "abort" (vLLM sends it; a request only ends that way when its client went away) and no
# "ignored" (a prompt too long to ever run: its output is empty, as for a length stop).
_OPENAI_FINISH: dict[int, str | None] = {
    common_pb2.FINISH_REASON_UNSPECIFIED: None,
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_IGNORED: "length",
}


class Shaper(abc.ABC):
    """One endpoint's chunks and full responses. A choice's key is `prompt index * n + index`
    (completions take several prompts; a chat has one)."""

    object_name = ""
    chunk_name = ""

    def __init__(self, core: GenerationCore, response_id: str, created: int, n: int) -> None:
        self.core, self.id, self.created, self.n = core, response_id, created, n

    def envelope(self, name: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": name,
            "created": self.created,
            "model": self.core.model_name,
        }

    def chunks(
        self,
        i: int,
        choices: list[ChoiceUpdate],
        prompt_logprobs: PromptLogprobs | None,
        include_usage: bool,
    ) -> list[dict[str, Any]]:
        """SSE chunks for one update of prompt `i`, one per choice."""
        out = []
        for c in choices:
            choice = {
                **self.chunk_choice(i, c, prompt_logprobs),
                **self.ending(i * self.n + c.index, c),
            }
            chunk = {**self.envelope(self.chunk_name), "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            out.append(chunk)
        return out

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self.envelope(self.chunk_name), "choices": [], "usage": usage_dict(usage)}

    def full(
        self,
        choices: dict[int, list[ChoiceUpdate]],
        prompt_logprobs: dict[int, PromptLogprobs],
        usage: Usage,
    ) -> dict[str, Any]:
        """The non-streaming body: each choice's updates joined."""
        result = []
        for key in sorted(choices):
            parts = choices[key]
            logprobs = (
                None
                if all(p.logprobs is None for p in parts)
                else [e for p in parts for e in (p.logprobs or [])]
            )
            joined = ChoiceUpdate(
                key % self.n,
                "".join(p.text for p in parts),
                [t for p in parts for t in p.token_ids],
                logprobs,
            )
            i = key // self.n
            result.append(
                {
                    **self.full_choice(i, key, joined, prompt_logprobs.get(i)),
                    **self.ending(key, parts[-1]),
                }
            )
        return {**self.envelope(self.object_name), "choices": result, "usage": usage_dict(usage)}

    def ending(self, key: int, c: ChoiceUpdate) -> dict[str, Any]:
        """The finish and stop reasons of choice `key` (after its text was shaped)."""
        return _ending(c)

    @abc.abstractmethod
    def chunk_choice(
        self, i: int, c: ChoiceUpdate, prompt_logprobs: PromptLogprobs | None
    ) -> dict[str, Any]:
        """A streamed choice of prompt `i`, without its finish and stop reasons."""

    @abc.abstractmethod
    def full_choice(
        self, i: int, key: int, c: ChoiceUpdate, prompt_logprobs: PromptLogprobs | None
    ) -> dict[str, Any]:
        """A whole choice of prompt `i`, without its finish and stop reasons."""


def _ending(c: ChoiceUpdate) -> dict[str, Any]:
    return {"finish_reason": _OPENAI_FINISH[c.finish_reason], "stop_reason": c.stop_reason}


class CompletionShaper(Shaper):
    object_name = chunk_name = "text_completion"

    def __init__(
        self,
        core: GenerationCore,
        response_id: str,
        created: int,
        n: int,
        inputs: list[GenerationInput],
        echo: bool,
    ) -> None:
        super().__init__(core, response_id, created, n)
        self.inputs, self.echo = inputs, echo
        self.echoed: set[int] = set()
        self.offsets: dict[int, int] = {}

    def chunk_choice(
        self, i: int, c: ChoiceUpdate, prompt_logprobs: PromptLogprobs | None
    ) -> dict[str, Any]:
        return self.full_choice(i, i * self.n + c.index, c, prompt_logprobs)

    def full_choice(
        self, i: int, key: int, c: ChoiceUpdate, prompt_logprobs: PromptLogprobs | None
    ) -> dict[str, Any]:
        prefix, entries = self._echo(i, key, prompt_logprobs)
        lp = None
        if c.logprobs is not None or entries:
            lp = self._logprobs(key, [*entries, *(c.logprobs or [])])
        return {"index": key, "text": prefix + c.text, "logprobs": lp}

    def _echo(
        self, i: int, key: int, prompt_logprobs: PromptLogprobs | None
    ) -> tuple[str, PromptLogprobs]:
        """The prompt's text and logprobs, once per choice, when echo is on."""
        if not self.echo or key in self.echoed:
            return "", []
        self.echoed.add(key)
        prompt = self.inputs[i].prompt
        text = (
            prompt.text
            if prompt.text is not None
            else self.core.tokenization.tokenizer.decode(prompt.token_ids)
        )
        return text, list(prompt_logprobs or [])

    def _logprobs(self, key: int, entries: PromptLogprobs) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        offset = self.offsets.get(key, 0)
        for entry in entries:
            out["text_offset"].append(offset)
            if entry is None:  # the first prompt token has no logprob
                out["tokens"].append(None)
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["tokens"].append(entry.token.text)
            out["token_logprobs"].append(entry.token.logprob)
            out["top_logprobs"].append({t.text: t.logprob for t in entry.top} or None)
            offset += len(entry.token.text)
        self.offsets[key] = offset
        return out


class ChatShaper(Shaper):
    object_name, chunk_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, core: GenerationCore, response_id: str, created: int, n: int) -> None:
        super().__init__(core, response_id, created, n)
        self.started: set[int] = set()

    def chunk_choice(
        self, i: int, c: ChoiceUpdate, prompt_logprobs: PromptLogprobs | None
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if c.index not in self.started:
            self.started.add(c.index)
            delta["role"] = "assistant"
        if c.text or not c.finish_reason:
            delta["content"] = c.text
        return {"index": c.index, "delta": delta, "logprobs": _chat_logprobs(c.logprobs)}

    def full_choice(
        self, i: int, key: int, c: ChoiceUpdate, prompt_logprobs: PromptLogprobs | None
    ) -> dict[str, Any]:
        return {
            "index": key,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": _chat_logprobs(c.logprobs),
        }


def _chat_logprobs(entries: list[LogprobEntry] | None) -> dict[str, Any] | None:
    if entries is None:
        return None

    def token(t: Any) -> dict[str, Any]:
        return {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}

    return {
        "content": [{**token(e.token), "top_logprobs": [token(t) for t in e.top]} for e in entries]
    }


class ToolChatShaper(ChatShaper):
    """A chat with tools: the tool format's parser (gateway/tool_formats/) turns the output
    into `message.tool_calls` / streamed `delta.tool_calls` and content, and a choice that
    made calls finishes with "tool_calls"."""

    def __init__(self, core: GenerationCore, response_id: str, created: int, n: int) -> None:
        super().__init__(core, response_id, created, n)
        self.parsers: dict[int, CallParser] = {}
        self.format = core.tokenization.tool_format

    def chunk_choice(
        self, i: int, c: ChoiceUpdate, prompt_logprobs: PromptLogprobs | None
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if c.index not in self.started:
            self.started.add(c.index)
            delta["role"] = "assistant"
        parser = self.parsers.setdefault(c.index, self.format.parser())
        content, calls = parser.feed(c.text)
        if c.finish_reason:
            held, more = parser.finish()
            content, calls = content + held, calls + more
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [_call_delta(d) for d in calls]
        return {"index": c.index, "delta": delta, "logprobs": _chat_logprobs(c.logprobs)}

    def full_choice(
        self, i: int, key: int, c: ChoiceUpdate, prompt_logprobs: PromptLogprobs | None
    ) -> dict[str, Any]:
        parser = self.parsers[key] = self.format.parser()
        content = parser.feed(c.text)[0] + parser.finish()[0]
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if parser.calls:
            message["tool_calls"] = parser.calls
        elif not content:
            message["content"] = ""
        return {"index": key, "message": message, "logprobs": _chat_logprobs(c.logprobs)}

    def ending(self, key: int, c: ChoiceUpdate) -> dict[str, Any]:
        out = _ending(c)
        parser = self.parsers.get(key)  # a chat has one prompt: key == choice index
        if c.finish_reason == common_pb2.FINISH_REASON_STOP and parser and parser.calls:
            out["finish_reason"] = TOOL_CALLS_FINISH
        return out


def _call_delta(d: ToolCallDelta) -> dict[str, Any]:
    if d.id is None:
        return {"index": d.index, "function": {"arguments": d.arguments}}
    return {
        "index": d.index,
        "id": d.id,
        "type": "function",
        "function": {"name": d.name, "arguments": d.arguments},
    }
