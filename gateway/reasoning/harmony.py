"""`harmony`, gpt-oss's format: the output is a run of messages, each a header and a text
(here on two lines, written as one),

    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

after a generation prompt that ends with `<|start|>assistant` (so the first message has no
`<|start|>ROLE` of its own). The `analysis` channel is the reasoning; the text of every other
channel (`final`, and `commentary` when the model writes one) is the answer. A message ends
with `<|end|>`, or with `<|return|>` / `<|call|>`, which also end the output. The analysis
message may be absent: the output then begins with the final message's header.

The tags are special tokens of gpt-oss's tokenizer, so the gateway decodes them for this
parser (`special_tags`); headers and tags never reach the client. The parser works on text: a
header is held back until its `<|message|>` decides its channel, and an end tag cut in two
is held back as think_tags holds a partial `</think>`, so that whole and streamed outputs come
apart the same way. The message texts are kept as the model wrote them (no whitespace is
trimmed: harmony needs none between its tags).

For the scheduler the block opens with the analysis header and ends where the answer's
message begins (`<|end|><|start|>assistant`): what follows is `<|channel|>final<|message|>`,
the same as after a generation prompt when the model does not think. A grammar for the answer
is framed with that header and the `<|return|>` that ends a final message
(`answer_grammar`). Tool calls (commentary messages `to=functions.NAME`) are not read yet.
"""

from __future__ import annotations

import re
from enum import Enum

from gateway.reasoning.base import ReasoningDelta, ReasoningFormat, ReasoningParser, partial_suffix
from llmserve.grammar.llguidance_backend import lark_text
from llmserve.grammar.spec import GrammarKind, GrammarSpec

HARMONY = "harmony"

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"
CONSTRAIN = "<|constrain|>"

ANALYSIS = "analysis"
FINAL = "final"
# What ends a message: <|end|>, or the end of the output with its stop token.
_MESSAGE_ENDS = (END, RETURN, CALL)
# What begins a header: `<|start|>ROLE`, or `<|channel|>` right after the generation prompt.
_HEADER_STARTS = (START, CHANNEL)
# A header is short (`<|start|>assistant to=functions.NAME<|channel|>commentary
# <|constrain|>json`); text that goes on this long without `<|message|>` is not one.
_MAX_HEADER = 256
# A channel name ends at whitespace (` to=...`, ` json`) or at the next tag.
_CHANNEL_NAME = re.compile(r"[^\s<]*")


class _Part(Enum):
    BETWEEN = "between"  # before a message (or at the start of the output)
    HEADER = "header"  # a header, up to its <|message|>
    ANALYSIS = "analysis"  # the text of an analysis message: reasoning
    ANSWER = "answer"  # the text of any other message


class HarmonyParser(ReasoningParser):
    def __init__(self, opened: bool) -> None:
        self._part = _Part.ANALYSIS if opened else _Part.BETWEEN
        self._held = ""  # text not yet given out (a header, a partial tag, whitespace)
        self._answered = False  # an answer message has begun
        # Reasoning and answer given so far: a later message of the same kind is set apart
        # from them by a newline.
        self._given = {_Part.ANALYSIS: False, _Part.ANSWER: False}
        self._apart = False

    @property
    def in_reasoning(self) -> bool:
        if self._part is _Part.ANALYSIS:
            return True
        return self._part is not _Part.ANSWER and not self._answered

    @property
    def in_block(self) -> bool:
        return self._part is _Part.ANALYSIS

    @property
    def opening(self) -> bool:
        return self._part is _Part.HEADER or (self._part is _Part.BETWEEN and bool(self._held))

    def feed(self, new: str) -> ReasoningDelta:
        out = ReasoningDelta()
        text, self._held = self._held + new, ""
        while text and not self._held:
            if self._part is _Part.BETWEEN:
                text = self._between(text)
            elif self._part is _Part.HEADER:
                text = self._header(text)
            else:
                text = self._body(text, out)
        return out

    def finish(self) -> ReasoningDelta:
        held, self._held = self._held, ""
        out = ReasoningDelta()
        if self._part is _Part.BETWEEN and held.strip():
            self._enter(_Part.ANSWER)  # the start of a tag that never came: text
        if self._part in (_Part.ANALYSIS, _Part.ANSWER):
            self._give(held, out)
        return out  # else whitespace, or a header cut short: no message text

    def _between(self, text: str) -> str:
        """A header begins the next message; any other text is answer without a header (after a
        prompt that wrote the final message's header, or from a model off its format)."""
        stripped = text.lstrip()
        if any(stripped.startswith(tag) for tag in _HEADER_STARTS):
            self._part = _Part.HEADER
            return stripped
        if not stripped or any(tag.startswith(stripped) for tag in _HEADER_STARTS):
            self._held = text
            return ""
        self._enter(_Part.ANSWER)
        return text

    def _header(self, text: str) -> str:
        """Held until its `<|message|>`, whose channel decides where the text goes."""
        end = text.find(MESSAGE, 0, _MAX_HEADER + len(MESSAGE))
        if end >= 0:
            self._enter(_Part.ANALYSIS if _channel(text[:end]) == ANALYSIS else _Part.ANSWER)
            return text[end + len(MESSAGE) :]
        if len(text) < _MAX_HEADER + len(MESSAGE):
            self._held = text
            return ""
        self._enter(_Part.ANSWER)  # too long for a header: text, tags and all
        return text

    def _body(self, text: str, out: ReasoningDelta) -> str:
        """A message's text up to its end tag; returns what follows the tag."""
        ends = [(at, tag) for tag in _MESSAGE_ENDS if (at := text.find(tag)) >= 0]
        if ends:
            at, tag = min(ends)
            self._give(text[:at], out)
            self._part = _Part.BETWEEN
            return text[at + len(tag) :]
        keep = max(partial_suffix(text, tag) for tag in _MESSAGE_ENDS)
        self._give(text[: len(text) - keep], out)
        self._held = text[len(text) - keep :]
        return ""

    def _enter(self, part: _Part) -> None:
        self._part = part
        self._answered = self._answered or part is _Part.ANSWER
        self._apart = self._given[part]

    def _give(self, text: str, out: ReasoningDelta) -> None:
        if not text:
            return
        if self._apart:
            text, self._apart = "\n" + text, False
        self._given[self._part] = True
        if self._part is _Part.ANALYSIS:
            out.reasoning += text
        else:
            out.answer += text


def _channel(header: str) -> str:
    """The channel a header names (`<|channel|>NAME`); empty when it names none."""
    at = header.find(CHANNEL)
    if at < 0:
        return ""
    match = _CHANNEL_NAME.match(header, at + len(CHANNEL))
    assert match is not None  # the pattern matches the empty string
    return match.group()


def _last_message(prompt_text: str) -> tuple[str, str] | None:
    """The channel and text of the prompt's last message when the prompt ends inside it
    (its header complete, no end tag yet); None when the prompt ends between messages or
    in a header."""
    tail = prompt_text[max(prompt_text.rfind(START), 0) :]
    if any(tag in tail for tag in _MESSAGE_ENDS) or MESSAGE not in tail:
        return None
    header, _, text = tail.partition(MESSAGE)
    return _channel(header), text


class HarmonyFormat(ReasoningFormat):
    name = HARMONY
    open_text = CHANNEL + ANALYSIS + MESSAGE
    end_text = END + START + "assistant"
    close_text = end_text
    special_tags = (START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN)
    tools_refused = (
        "are not supported with gpt-oss's harmony format yet (its calls are commentary "
        "messages to=functions.NAME, which this gateway does not read)"
    )

    def opened_in(self, prompt_text: str) -> bool:
        last = _last_message(prompt_text)
        return last is not None and last[0] == ANALYSIS

    def closed_in(self, prompt_text: str) -> bool:
        last = _last_message(prompt_text)
        return last is not None and last[0] != ANALYSIS

    def parser(self, opened: bool) -> ReasoningParser:
        return HarmonyParser(opened)

    def answer_grammar(self, grammar: GrammarSpec, closed: bool) -> GrammarSpec:
        """`grammar` as the text of a final message: after its header (unless the prompt
        wrote it: `closed`), and ended by `<|return|>`, gpt-oss's end of a final message and
        of its turn. A Lark grammar of llguidance's dialect (its `<|name|>` special tokens,
        the request's grammar nested whole with `%lark { ... }`), sent for the field the
        request's grammar came from."""
        header = "" if closed else f'{CHANNEL} "{FINAL}" {MESSAGE} '
        source = f"start: {header}answer {RETURN}\nanswer: %lark {{\n{lark_text(grammar)}\n}}\n"
        return GrammarSpec(GrammarKind.LARK, source, grammar.field)
