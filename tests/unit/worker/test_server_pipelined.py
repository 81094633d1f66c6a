"""The Worker service with steps sent ahead (asynchronous scheduling): a real WorkerServicer on
a tiny random Llama over a loopback gRPC server. Steps sent before the previous result is
read run in order and equal the same steps sent one at a time; the forward-gap histogram
counts them as queued; a placeholder with no sample behind it ends the stream with a status
that names the sequence."""

from __future__ import annotations

import time

import grpc
import pytest
from prometheus_client import REGISTRY

from llmserve.step_proto import step_input_to_proto, step_result_from_proto
from llmserve.steps import SAMPLED_TOKEN, CachedSequence, StepInput
from llmserve.v1 import worker_pb2

from .factories import new_seq
from .test_server_lifecycle import PROMPT, Served, Stream, run

STEPS = 6


def queued_gaps() -> float:
    """How many forward gaps the worker counted with the next step already there."""
    value = REGISTRY.get_sample_value(
        "llmserve_worker_forward_gap_seconds_count", {"next_step": "queued"}
    )
    return value or 0.0


def prepare_count() -> float:
    return REGISTRY.get_sample_value("llmserve_worker_prepare_seconds_count") or 0.0


def test_steps_sent_ahead_run_in_order_and_fill_in_their_tokens(tiny_llama) -> None:
    async def body(w: Served) -> None:
        prepared = prepare_count()
        await w.stub.InitializeCache(worker_pb2.InitializeCacheRequest(num_gpu_blocks=32))
        # One at a time, each sampled token sent back explicitly.
        one = Stream(w.stub)
        tokens = [(await one.step(StepInput(0, new_seqs=[new_seq(1, PROMPT, [0, 1, 2])])))[1]]
        for i in range(1, STEPS):
            step = StepInput(i, cached_seqs=[CachedSequence(1, tokens[-1:], 3, [], 1)])
            tokens.append((await one.step(step))[1])
        one.call.cancel()
        # All steps sent at once, every decode naming the previous sample by placeholder. The
        # first waits a moment on the model thread, so the others have arrived when its
        # forward pass ends whatever else the machine runs (on a loaded one, a tiny model's
        # steps could otherwise each end before the next is read).
        before = queued_gaps()
        execute = w.worker.execute

        def first_one_late(*args: object) -> object:
            w.worker.execute = execute  # type: ignore[method-assign]
            time.sleep(0.2)
            return execute(*args)  # type: ignore[arg-type]

        w.worker.execute = first_one_late  # type: ignore[method-assign, assignment]
        ahead = Stream(w.stub)
        await ahead.outbox.put(
            step_input_to_proto(StepInput(0, new_seqs=[new_seq(2, PROMPT, [4, 5, 6])]))
        )
        for i in range(1, STEPS):
            step = StepInput(i, cached_seqs=[CachedSequence(2, [SAMPLED_TOKEN], 3, [], 1)])
            await ahead.outbox.put(step_input_to_proto(step))
        got = []
        for i in range(STEPS):
            result = step_result_from_proto(await ahead.call.read())
            assert result.step_id == i
            got.append(result.outputs[0].samples[0].token_id)
        assert got == tokens
        assert queued_gaps() > before  # later steps were waiting when a forward pass ended
        assert prepare_count() == prepared + 2 * STEPS  # each step's host preparation timed
        ahead.call.cancel()

    run(tiny_llama, body)


def test_a_placeholder_without_a_sample_ends_the_stream_naming_the_sequence(tiny_llama) -> None:
    async def body(w: Served) -> None:
        await w.stub.InitializeCache(worker_pb2.InitializeCacheRequest(num_gpu_blocks=32))
        stream = Stream(w.stub)
        # A prefill chunk short of the prompt's end samples nothing.
        await stream.step(StepInput(0, new_seqs=[new_seq(3, PROMPT, [0, 1], scheduled=3)]))
        step = StepInput(1, cached_seqs=[CachedSequence(3, [SAMPLED_TOKEN], 2, [], 1)])
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stream.step(step)
        assert "seq 3" in (failed.value.details() or "")
        assert "sampled nothing" in (failed.value.details() or "")

    run(tiny_llama, body)
