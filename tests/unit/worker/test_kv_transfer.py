"""KV blocks from one worker to another through the step contract (steps.py: Transfers): two
real Worker services over a tiny random Llama on loopback. A sequence prefilled on A, its
blocks exported there and imported on B, decodes on B to the token A decodes; failed imports
are reported and leave the step running; released exports are gone; a peer without the
internal credential is refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from llmserve import security
from llmserve.ports import free_port
from llmserve.security import Security
from llmserve.step_proto import step_input_to_proto, step_result_from_proto
from llmserve.steps import BlockExport, BlockImport, CachedSequence, StepInput, StepResult
from llmserve.v1 import worker_pb2
from worker_service import kv_transfer

from .factories import new_seq
from .test_server_lifecycle import PROMPT, Served, Stream, served_worker


async def step_result(stream: Stream, step: StepInput) -> StepResult:
    await stream.outbox.put(step_input_to_proto(step))
    return step_result_from_proto(await stream.call.read())


async def start(w: Served, blocks: int = 32) -> Stream:
    await w.stub.InitializeCache(worker_pb2.InitializeCacheRequest(num_gpu_blocks=blocks))
    return Stream(w.stub)


def test_blocks_moved_to_another_worker_decode_the_same_token(tiny_llama, monkeypatch):
    monkeypatch.setattr(kv_transfer, "CHUNK_BYTES", 1000)  # several chunks per transfer

    async def main() -> None:
        async with served_worker(tiny_llama[0]) as a, served_worker(tiny_llama[0]) as b:
            on_a, on_b = await start(a), await start(b)
            first = (await on_a.step(StepInput(0, new_seqs=[new_seq(1, PROMPT, [0, 1])])))[1]
            exported = await step_result(on_a, StepInput(1, exports=[BlockExport(7, [0, 1])]))
            assert exported.outputs == []
            imported = await step_result(
                on_b, StepInput(0, imports=[BlockImport(7, a.address, [5, 9])])
            )
            assert imported.imported_transfer_ids == [7] and imported.failed_imports == []
            cache_a, cache_b = a.worker.cache_engine, b.worker.cache_engine
            assert torch.equal(cache_a.read_blocks([0, 1]), cache_b.read_blocks([5, 9]))
            # B holds the prompt's K/V: it computes only the new token, as A does.
            tokens = [*PROMPT, first]
            moved = new_seq(1, tokens, [5, 9], scheduled=1, computed=len(PROMPT))
            on_b_next = (await on_b.step(StepInput(1, new_seqs=[moved])))[1]
            on_a_next = (await on_a.step(StepInput(2, cached_seqs=[
                CachedSequence(1, [first], 2, [], 1)
            ])))[1]  # fmt: skip
            assert on_b_next == on_a_next
            # Released, the export is gone.
            await step_result(on_a, StepInput(3, released_transfer_ids=[7]))
            again = await step_result(
                on_b, StepInput(2, imports=[BlockImport(7, a.address, [3, 4])])
            )
            assert [f.transfer_id for f in again.failed_imports] == [7]
            assert "NOT_FOUND" in again.failed_imports[0].reason
            for stream in (on_a, on_b):
                stream.call.cancel()

    asyncio.run(main())


def test_a_failed_import_is_reported_and_the_step_still_runs(tiny_llama):
    async def main() -> None:
        async with served_worker(tiny_llama[0]) as w:
            stream = await start(w)
            nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there
            result = await step_result(stream, StepInput(
                0,
                new_seqs=[new_seq(1, PROMPT, [0, 1])],
                imports=[BlockImport(3, nowhere, [4]), BlockImport(4, w.address, [5])],
            ))  # fmt: skip
            failed = {f.transfer_id: f.reason for f in result.failed_imports}
            assert result.imported_transfer_ids == []
            assert failed.keys() == {3, 4}
            assert "UNAVAILABLE" in failed[3] and nowhere in failed[3]
            assert "NOT_FOUND" in failed[4]  # this worker exports nothing under 4
            assert [o.seq_id for o in result.outputs] == [1]
            stream.call.cancel()

    asyncio.run(main())


def test_a_layout_that_differs_is_refused(tiny_llama):
    async def main() -> None:
        async with served_worker(tiny_llama[0]) as w:
            stream = await start(w)
            await step_result(stream, StepInput(0, exports=[BlockExport(1, [0, 1, 2])]))
            # Three blocks exported, two destinations: the import names its layout mismatch.
            result = await step_result(
                stream, StepInput(1, imports=[BlockImport(1, w.address, [5, 6])])
            )
            assert "3 blocks" in result.failed_imports[0].reason
            stream.call.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await anext(aiter(w.stub.ReadBlocks(worker_pb2.ReadBlocksRequest(transfer_id=9))))
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(main())


def test_a_peer_without_the_internal_credential_is_refused(tiny_llama, monkeypatch):
    async def main() -> None:
        async with (
            served_worker(tiny_llama[0], internal_token="s3cret") as a,
            served_worker(tiny_llama[0]) as b,
        ):
            on_a, on_b = await start(a), await start(b)
            await step_result(on_a, StepInput(0, exports=[BlockExport(2, [0, 1])]))
            # B's process holds another token: A refuses the read, B reports the import failed.
            monkeypatch.setattr(security, "_installed", Security(internal_tokens=("wrong",)))
            refused = await step_result(
                on_b, StepInput(0, imports=[BlockImport(2, a.address, [3, 4])])
            )
            assert "UNAUTHENTICATED" in refused.failed_imports[0].reason
            monkeypatch.setattr(security, "_installed", Security(internal_tokens=("s3cret",)))
            allowed = await step_result(
                on_b, StepInput(1, imports=[BlockImport(2, a.address, [3, 4])])
            )
            assert allowed.imported_transfer_ids == [2]
            for stream in (on_a, on_b):
                stream.call.cancel()

    asyncio.run(main())
