"""A replica's wait for the grammar compiles its next step needs (the engine's side of a
compile is `scheduler_service.engine.grammar_requests`)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

from llmserve.grammar.backend import CompiledGrammar


async def wait_for_compiles(futures: list[Future[CompiledGrammar]], timeout_s: float) -> None:
    """Wait until every compile of `futures` has ended, or for `timeout_s`. A failed compile
    is not raised here: `GrammarRequests.take_failures` ends its request."""
    wrapped = [asyncio.wrap_future(f) for f in futures]
    for w in wrapped:
        w.add_done_callback(_retrieve)
    await asyncio.wait(wrapped, timeout=timeout_s)


def _retrieve(future: asyncio.Future[CompiledGrammar]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved, so asyncio does not log it as never retrieved
