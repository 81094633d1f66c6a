"""Response shapes of /v1/completions and /v1/chat/completions: one base turns generation
updates into SSE chunks and full bodies; each endpoint shapes only its own choice."""

from __future__ import annotations

import abc
from typing import Any

from gateway.chat_output import ChatOutput, read_all
from gateway.generation import GenerationCore
from gateway.generation_types import ChoiceUpdate, GenerationInput, LogprobEntry, Usage
from gateway.tool_formats import ToolCallDelta
from llmserve.v1 import common_pb2

PromptLogprobs = list[LogprobEntry | None]


def usage_dict(usage: Usage, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage block; with a reasoning parser, `completion_tokens_details`; with
    speculative decoding, llmserve's extension field `speculative_decoding` (`UsageInfo`)."""
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
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
        return {**self.envelope(self.chunk_name), "choices": [], "usage": self.usage(usage)}

    def usage(self, usage: Usage) -> dict[str, Any]:
        """The usage block, once every choice has been shaped."""
        return usage_dict(usage)

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
                    **self.full_choice(i, key, joined, prompt_logprobs.get(i), parts),
                    **self.ending(key, parts[-1]),
                }
            )
        return {**self.envelope(self.object_name), "choices": result, "usage": self.usage(usage)}

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
        self,
        i: int,
        key: int,
        c: ChoiceUpdate,
        prompt_logprobs: PromptLogprobs | None,
        parts: list[ChoiceUpdate],
    ) -> dict[str, Any]:
        """A whole choice of prompt `i` (`c`: its `parts` joined), without its finish and
        stop reasons."""


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
        return self.full_choice(i, i * self.n + c.index, c, prompt_logprobs, [c])

    def full_choice(
        self,
        i: int,
        key: int,
        c: ChoiceUpdate,
        prompt_logprobs: PromptLogprobs | None,
        parts: list[ChoiceUpdate],
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
    """A chat's choices, read by `ChatOutput`: with a reasoning parser, the thinking goes to
    `reasoning_content`; with tools, the tool format's parser turns the answer into
    `tool_calls` and content, and a choice that made calls finishes with "tool_calls"."""

    object_name, chunk_name = "chat.completion", "chat.completion.chunk"

    def __init__(
        self,
        core: GenerationCore,
        response_id: str,
        created: int,
        n: int,
        inp: GenerationInput | None = None,
    ) -> None:
        super().__init__(core, response_id, created, n)
        self.started: set[int] = set()
        self.reasoning = None if inp is None else inp.reasoning
        self.tools = None if inp is None else inp.tools
        self.outputs: dict[int, ChatOutput] = {}

    def _output(self, key: int) -> ChatOutput:
        if key not in self.outputs:
            self.outputs[key] = ChatOutput(
                self.reasoning, self.tools, self.core.tokenization.tool_format
            )
        return self.outputs[key]

    def chunk_choice(
        self, i: int, c: ChoiceUpdate, prompt_logprobs: PromptLogprobs | None
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if c.index not in self.started:
            self.started.add(c.index)
            delta["role"] = "assistant"
        d = self._output(c.index).feed_last(c.text, len(c.token_ids), bool(c.finish_reason))
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        if d.content or (self.tools is None and self.reasoning is None and not c.finish_reason):
            delta["content"] = d.content
        if d.calls:
            delta["tool_calls"] = [_call_delta(x) for x in d.calls]
        return {"index": c.index, "delta": delta, "logprobs": _chat_logprobs(c.logprobs)}

    def full_choice(
        self,
        i: int,
        key: int,
        c: ChoiceUpdate,
        prompt_logprobs: PromptLogprobs | None,
        parts: list[ChoiceUpdate],
    ) -> dict[str, Any]:
        output = self.outputs[key] = ChatOutput(
            self.reasoning, self.tools, self.core.tokenization.tool_format
        )
        d = read_all(output, [(p.text, len(p.token_ids)) for p in parts])
        message: dict[str, Any] = {"role": "assistant", "content": d.content}
        if output.calls:
            message["tool_calls"] = output.calls
            message["content"] = d.content or None
        if output.parses_reasoning:
            message["reasoning_content"] = d.reasoning or None
        return {"index": key, "message": message, "logprobs": _chat_logprobs(c.logprobs)}

    def ending(self, key: int, c: ChoiceUpdate) -> dict[str, Any]:
        out = _ending(c)
        output = self.outputs.get(key)  # a chat has one prompt: key == choice index
        if c.finish_reason == common_pb2.FINISH_REASON_STOP and output and output.calls:
            out["finish_reason"] = TOOL_CALLS_FINISH
        return out

    def usage(self, usage: Usage) -> dict[str, Any]:
        if self.reasoning is None:
            return usage_dict(usage)
        return usage_dict(usage, sum(o.reasoning_tokens for o in self.outputs.values()))


def _chat_logprobs(entries: list[LogprobEntry] | None) -> dict[str, Any] | None:
    if entries is None:
        return None

    def token(t: Any) -> dict[str, Any]:
        return {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}

    return {
        "content": [{**token(e.token), "top_logprobs": [token(t) for t in e.top]} for e in entries]
    }


def _call_delta(d: ToolCallDelta) -> dict[str, Any]:
    if d.id is None:
        return {"index": d.index, "function": {"arguments": d.arguments}}
    return {
        "index": d.index,
        "id": d.id,
        "type": "function",
        "function": {"name": d.name, "arguments": d.arguments},
    }
