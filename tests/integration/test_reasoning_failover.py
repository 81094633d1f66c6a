"""Reasoning through the whole stack: a tiny Qwen3 that thinks (SmolLM2's tokenizer with
`<think>` and `</think>` as added tokens, a chat template that opens the block in the prompt:
tests/support/models.py build_tiny_thinker), two workers, 16 chat streams over HTTP with
the official `openai` SDK, each with `thinking_token_budget: 16`, half of them answering
under a JSON schema, greedy and seeded. The random model almost never closes its block by
itself: the scheduler does, with forced tokens. Every block ends within the budget plus the
closing text, every JSON answer is valid, and a worker SIGKILLed mid-stream changes no byte
of any stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.support.fleet import FleetStack, start_fleet
from tests.support.grammar import BOUNDED_SCHEMA
from tests.support.models import build_tiny_thinker

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.services]

BUDGET = 16
# "\n" and "</think>": what the scheduler appends when the budget is spent.
CLOSING_TOKENS = 2
WORKER_ARGS = ["--max-model-len", "512", "--kv-cache-memory", "0.05", "--num-threads", "1"]
SCHEDULER_ARGS = ["--worker-lease-s", "60"]


@dataclass
class Stream:
    reasoning: str = ""
    content: str = ""
    finish_reason: str | None = None
    reasoning_tokens: int | None = None
    completion_tokens: int | None = None


@dataclass
class Chat:
    schema: bool
    params: dict[str, Any] = field(default_factory=dict)


def workload() -> dict[str, Chat]:
    chats = {}
    for i in range(16):
        sampling = {"temperature": 0.0} if i % 4 < 2 else {"temperature": 1.0, "seed": 300 + i}
        chats[f"c{i}"] = Chat(schema=i % 2 == 0, params=sampling)
    return chats


WORKLOAD = workload()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    model = build_tiny_thinker(tmp_path_factory.mktemp("thinker"))
    stack = start_fleet(
        str(model),
        tmp_path_factory.mktemp("thinker-fleet"),
        2,
        scheduler_args=SCHEDULER_ARGS,
        worker_args=WORKER_ARGS,
    )
    yield stack
    stack.stop()


def prompt_of(chat: Chat) -> str:
    return "Describe a box as JSON." if chat.schema else "Tell me a story."


async def run_chats(fleet: FleetStack, on_chunk: Callable[[int], None] | None = None):
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{fleet.http_port}/v1", api_key="x", max_retries=0
    )
    total = 0

    async def one(chat: Chat, prompt: str) -> Stream:
        nonlocal total
        extra: dict[str, Any] = {}
        if chat.schema:
            extra["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "box", "schema": BOUNDED_SCHEMA},
            }
        got = Stream()
        stream = await client.chat.completions.create(
            model=fleet.model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=120 if chat.schema else 48,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"thinking_token_budget": BUDGET},
            timeout=300,
            **chat.params,
            **extra,
        )
        async for chunk in stream:
            if chunk.usage is not None:
                got.completion_tokens = chunk.usage.completion_tokens
                details = chunk.usage.completion_tokens_details
                got.reasoning_tokens = details.reasoning_tokens if details else None
            for choice in chunk.choices:
                got.reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                got.content += choice.delta.content or ""
                got.finish_reason = choice.finish_reason or got.finish_reason
            total += 1
            if on_chunk is not None:
                on_chunk(total)
        return got

    try:
        names = list(WORKLOAD)
        streams = await asyncio.gather(*(one(WORKLOAD[n], prompt_of(WORKLOAD[n])) for n in names))
        return dict(zip(names, streams, strict=True))
    finally:
        await client.close()


def check_valid(streams: dict[str, Stream]) -> None:
    for name, got in streams.items():
        assert got.reasoning, name
        # The block took at most the budget plus the closing text (the prompt opened it).
        assert got.reasoning_tokens is not None
        assert 0 < got.reasoning_tokens <= BUDGET + CLOSING_TOKENS, (name, got)
        assert got.completion_tokens > got.reasoning_tokens, (name, got)
        if WORKLOAD[name].schema:
            assert got.finish_reason == "stop", (name, got)
            jsonschema.validate(json.loads(got.content), BOUNDED_SCHEMA)
        else:
            assert got.content, name


@pytest.fixture(scope="module")
def baseline(fleet: FleetStack) -> dict[str, Stream]:
    streams = asyncio.run(run_chats(fleet))
    check_valid(streams)
    # The random model leaves its blocks open: the budget closed them.
    assert sum(s.reasoning_tokens == BUDGET + CLOSING_TOKENS for s in streams.values()) >= 12
    fleet.assert_no_leak()
    return streams


def test_a_worker_kill_changes_no_byte(fleet: FleetStack, baseline: dict[str, Stream]) -> None:
    fired: list[int] = []
    # About a third of the undisturbed run's chunks: every stream started, most unfinished.
    at = sum(s.completion_tokens or 0 for s in baseline.values()) // 3

    def kill(total: int) -> None:
        if total >= at and not fired:
            fired.append(total)
            fleet.workers[0].kill()

    streams = asyncio.run(run_chats(fleet, kill))
    assert fired, "the workload ended before the kill"
    check_valid(streams)
    assert streams == baseline
    log = fleet.scheduler.log.read_text(errors="replace")  # type: ignore[union-attr]
    assert '"event": "request migrated"' in log, "the kill moved no request"
    fleet.assert_no_leak()
    fleet.workers[0].start()
    fleet.wait_for(lambda s: len(fleet.ready_replicas(s)) == 2, "the restarted worker ready")


def test_a_scheduler_restart_changes_no_byte(
    fleet: FleetStack, baseline: dict[str, Stream]
) -> None:
    """The gateway re-submits each stream with what it already sent; the new scheduler
    replays it through a fresh matcher: inside the block, or past it under the schema."""
    scheduler = fleet.scheduler
    assert scheduler is not None
    fired: list[int] = []
    at = sum(s.completion_tokens or 0 for s in baseline.values()) // 3

    def restart(total: int) -> None:
        if total >= at and not fired:
            fired.append(total)
            scheduler.kill()
            scheduler.start(wait=False)

    streams = asyncio.run(run_chats(fleet, restart))
    assert fired, "the workload ended before the restart"
    check_valid(streams)
    assert streams == baseline
    fleet.wait_for(lambda s: len(fleet.ready_replicas(s)) == 2, "workers back")
    fleet.assert_no_leak()


def test_the_model_dir_thinks(tmp_path: Path) -> None:
    """The builder's tokenizer has the tags as single tokens, and its template opens the block:
    what the gateway's parser and the scheduler rely on above."""
    from transformers import AutoTokenizer

    model = build_tiny_thinker(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(model)
    assert len(tok.encode("<think></think>", add_special_tokens=False)) == 2
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<think>\n")
