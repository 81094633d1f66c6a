"""Token masks that follow their step (structured output): a real WorkerServicer on a tiny
random Llama over a loopback gRPC server. A step that defers its masks samples under the masks
sent after it (or before it); its wait is counted in the mask-wait histogram; a step whose
masks never come fails the stream within the timeout, naming the step; and a closed board ends
a wait at once."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from prometheus_client import REGISTRY

from llmserve.proto_masks import step_masks_to_proto
from llmserve.step_proto import step_input_to_proto, step_result_from_proto
from llmserve.steps import MaskKind, StepInput, TokenMask
from llmserve.v1 import worker_pb2
from worker_service.late_masks import MaskBoard, MaskWaitError

from .factories import new_seq
from .test_server_lifecycle import PROMPT, Served, Stream, run


def mask_waits() -> float:
    return REGISTRY.get_sample_value("llmserve_worker_mask_wait_seconds_count") or 0.0


def only(seq_id: int, token_id: int, vocab: int) -> TokenMask:
    return TokenMask(seq_id, MaskKind.ALLOW, vocab, [token_id])


def deferred_first_step(seq_id: int) -> StepInput:
    return StepInput(0, new_seqs=[new_seq(seq_id, PROMPT, [0, 1])], deferred_mask_seq_ids=[seq_id])


@pytest.mark.parametrize("masks_first", [False, True])
def test_a_step_samples_under_the_masks_sent_after_it(tiny_llama, masks_first) -> None:
    async def body(w: Served) -> None:
        await w.stub.InitializeCache(worker_pb2.InitializeCacheRequest(num_gpu_blocks=32))
        vocab = w.worker.model_info.vocab_size
        free = Stream(w.stub)
        greedy = (await free.step(StepInput(0, new_seqs=[new_seq(1, PROMPT, [0, 1])])))[1]
        free.call.cancel()
        # A token greedy sampling would not pick: only the mask can make the worker take it.
        wanted = (greedy + 7) % vocab
        before = mask_waits()
        stream = Stream(w.stub)
        step = step_input_to_proto(deferred_first_step(2))
        masks = step_masks_to_proto(0, [only(2, wanted, vocab)])
        for message in (masks, step) if masks_first else (step, masks):
            await stream.outbox.put(message)
        result = step_result_from_proto(await stream.call.read())
        assert result.step_id == 0
        assert [o.samples[0].token_id for o in result.outputs] == [wanted]
        assert mask_waits() == before + 1
        stream.call.cancel()

    run(tiny_llama, body)


def test_a_step_whose_masks_never_come_fails_the_stream(tiny_llama) -> None:
    async def body(w: Served) -> None:
        await w.stub.InitializeCache(worker_pb2.InitializeCacheRequest(num_gpu_blocks=32))
        stream = Stream(w.stub)
        await stream.outbox.put(step_input_to_proto(deferred_first_step(4)))
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await asyncio.wait_for(stream.call.read(), 20)
        assert time.monotonic() - start < 20  # ended by the worker's timeout, not ours
        details = failed.value.details() or ""
        assert "step 0" in details and "did not come within 0.5 s" in details, details
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        # The failed stream's sequence state is dropped, as after any failed step.
        for _ in range(100):
            if w.worker.num_sequences == 0:
                break
            await asyncio.sleep(0.05)
        assert w.worker.num_sequences == 0

    run(tiny_llama, body, mask_wait_timeout_s=0.5)


def test_closing_the_board_ends_a_wait_at_once() -> None:
    board = MaskBoard(timeout_s=60.0)
    failures: list[BaseException] = []

    def take() -> None:
        try:
            board.take(3)
        except MaskWaitError as exc:
            failures.append(exc)

    waiter = threading.Thread(target=take)
    waiter.start()
    time.sleep(0.05)
    board.close()
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert len(failures) == 1 and "closed before its masks came" in str(failures[0])


def test_the_board_hands_each_steps_masks_once() -> None:
    board = MaskBoard(timeout_s=0.1)
    mask = only(1, 5, 10)
    board.post(7, [mask])
    with pytest.raises(ValueError, match="step 7 came twice"):
        board.post(7, [mask])
    masks, waited_ns = board.take(7)
    assert masks == [mask] and waited_ns >= 0
    with pytest.raises(MaskWaitError, match="step 7: its masks did not come within 0.1 s"):
        board.take(7)
