"""A chat answer as a sequence of items (reasoning, text, tool calls), for the APIs that
stream items rather than deltas: the Responses API's output items and the Messages API's
content blocks. `OutputItems` turns `ChatDelta`s into item events; the whole answer is the
same events, fed at once, so whole and streamed responses agree.

It also runs one request through GenerationCore for those APIs (one choice each)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from gateway.chat_output import ChatDelta, ChatOutput
from gateway.generation import GenerationCore
from gateway.generation_types import GenerationInput, GenerationUpdate, Usage
from llmserve.v1 import common_pb2


class ItemKind(Enum):
    REASONING = "reasoning"
    TEXT = "text"
    CALL = "call"


@dataclass(slots=True)
class Item:
    kind: ItemKind
    text: str = ""  # the reasoning, the text, or a call's arguments
    call_id: str = ""
    name: str = ""

    def arguments(self) -> dict[str, Any]:
        """A call's arguments as an object (the tool grammar keeps them JSON)."""
        try:
            value = json.loads(self.text or "{}")
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}


class EventKind(Enum):
    OPENED = "opened"
    DELTA = "delta"
    CLOSED = "closed"


@dataclass(slots=True)
class ItemEvent:
    kind: EventKind
    index: int
    item: Item
    delta: str = ""


@dataclass(slots=True)
class OutputItems:
    """The items of one choice, and the events that built them."""

    items: list[Item] = field(default_factory=list)
    _open: bool = False

    def feed(self, d: ChatDelta) -> list[ItemEvent]:
        events: list[ItemEvent] = []
        if d.reasoning:
            self._write(ItemKind.REASONING, d.reasoning, events)
        if d.content:
            self._write(ItemKind.TEXT, d.content, events)
        for call in d.calls:
            if call.id is not None:
                self._close(events)
                self._open_item(Item(ItemKind.CALL, call_id=call.id, name=call.name or ""), events)
            if call.arguments:
                self._append(call.arguments, events)
        return events

    def close(self) -> list[ItemEvent]:
        events: list[ItemEvent] = []
        self._close(events)
        return events

    def _write(self, kind: ItemKind, text: str, events: list[ItemEvent]) -> None:
        if not (self._open and self.items[-1].kind is kind):
            self._close(events)
            self._open_item(Item(kind), events)
        self._append(text, events)

    def _open_item(self, item: Item, events: list[ItemEvent]) -> None:
        self.items.append(item)
        self._open = True
        events.append(ItemEvent(EventKind.OPENED, len(self.items) - 1, item))

    def _append(self, text: str, events: list[ItemEvent]) -> None:
        item = self.items[-1]
        item.text += text
        events.append(ItemEvent(EventKind.DELTA, len(self.items) - 1, item, text))

    def _close(self, events: list[ItemEvent]) -> None:
        if self._open:
            self._open = False
            events.append(ItemEvent(EventKind.CLOSED, len(self.items) - 1, self.items[-1]))


@dataclass(slots=True)
class Outcome:
    """How the one choice ended, and the request's count."""

    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    stop_reason: str | int | None = None
    usage: Usage = field(default_factory=lambda: Usage(0, 0))
    reasoning_tokens: int = 0


async def item_events(
    updates: AsyncIterator[GenerationUpdate],
    output: ChatOutput,
    items: OutputItems,
    outcome: Outcome,
) -> AsyncGenerator[ItemEvent, None]:
    """The item events of one choice's updates; `outcome` is filled in at the end."""
    async for update in updates:
        for c in update.choices:
            events = items.feed(output.feed(c.text, len(c.token_ids)))
            if c.finish_reason:
                events += items.feed(output.finish())
                outcome.finish_reason, outcome.stop_reason = c.finish_reason, c.stop_reason
            for event in events:
                yield event
        if update.usage is not None:
            outcome.usage = outcome.usage + update.usage
    for event in items.close():
        yield event
    outcome.reasoning_tokens = output.reasoning_tokens


async def first_update(
    core: GenerationCore, inp: GenerationInput, parent: Any
) -> AsyncGenerator[GenerationUpdate, None]:
    """The request's updates, its first one already awaited: an error before any token (a
    full queue, an unavailable scheduler) is raised here, as an HTTP error, not an event
    after a 200."""
    updates = aiter(core.generate(inp, parent))
    assert isinstance(updates, AsyncGenerator)
    try:
        first = await anext(updates)
    except BaseException:
        await updates.aclose()
        raise

    async def chained() -> AsyncGenerator[GenerationUpdate, None]:
        try:
            yield first
            async for update in updates:
                yield update
        finally:
            await updates.aclose()

    return chained()
