"""StepChain (worker_service/step_chain.py) on a real model thread and event loop, with a
step function in place of the model: steps run in order, and the model thread's wait for the
next step is observed only when it ran out of steps, not for a step queued behind another."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import REGISTRY

from llmserve.steps import StepInput
from worker_service.step_chain import Received, StepChain


def waits() -> float:
    return REGISTRY.get_sample_value("llmserve_worker_step_wait_seconds_count") or 0.0


def test_a_wait_is_observed_only_when_the_model_thread_ran_out_of_steps() -> None:
    release = threading.Event()

    def execute(received: Received) -> tuple:
        assert isinstance(received.step, StepInput)
        if received.step.step_id == 0:
            assert release.wait(30)  # holds the model thread until steps 1 and 2 are queued
        return received.step.step_id, None

    async def body() -> None:
        with ThreadPoolExecutor(1) as model_thread:
            chain = StepChain(model_thread, execute, asyncio.get_running_loop())  # type: ignore[arg-type]

            async def outcome() -> object:
                got = await chain.outcomes.get()
                assert got is not None and not isinstance(got.result, BaseException)
                return got.result[0]

            before = waits()
            for step_id in range(3):
                chain.submit(Received(StepInput(step_id), "", 0))
            release.set()
            assert [await outcome() for _ in range(3)] == [0, 1, 2]
            assert waits() == before  # 1 and 2 were queued behind 0: no wait
            # The model thread runs one task at a time: this one starts once the chain's
            # drain has returned, out of steps.
            await asyncio.wrap_future(model_thread.submit(lambda: None))
            chain.submit(Received(StepInput(3), "", 0))
            assert await outcome() == 3
            assert waits() == before + 1
            chain.submit(None)
            assert await chain.outcomes.get() is None
            chain.close()

    asyncio.run(body())
