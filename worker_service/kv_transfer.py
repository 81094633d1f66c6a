"""KV blocks between workers: the ReadBlocks stream that serves this worker's exports
(`exports.Exports`), and the imports that read a peer's export into this worker's cache
(steps.py: Transfers).

The scheduler owns both block tables, so a transfer needs no negotiation between workers: it
exports blocks on the source under a transfer id, and tells the destination to import that id
from the source's address into blocks it has allocated there. The destination pulls (one
ReadBlocks call; the bytes come in chunks of `CHUNK_BYTES`) on its model thread, before the
step's forward pass, and reports the import done or failed in the step's result. The channel
is the workers' gRPC port, with the internal credential and TLS of every other hop. A model
with recurrent layers may export a state slot beside the blocks (a prefix snapshot): its
bytes follow the blocks' in the stream, and the import writes them into the slot the
scheduler named.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import torch

from llmserve import failpoints, security
from llmserve.grpc_utils import channel_options
from llmserve.logs import get_logger
from llmserve.steps import BlockImport, TransferFailure
from llmserve.v1 import worker_pb2, worker_pb2_grpc
from worker_service import metrics
from worker_service.cache_engine import CacheEngine

log = get_logger(__name__)

# Bytes of block data per ReadBlocks message.
CHUNK_BYTES = 4 << 20
# An import that has not arrived in this long fails (the scheduler falls back to recompute).
# Below the scheduler's step watchdog floor (30 s), so a stalled peer fails the import, not the
# importing worker's step.
IMPORT_TIMEOUT_S = 20.0


def header(cache: CacheEngine, num_blocks: int, state_bytes: int = 0) -> worker_pb2.BlockChunk:
    """ReadBlocks' first message: what the blocks (and the state after them) are."""
    return worker_pb2.BlockChunk(
        num_blocks=num_blocks,
        block_bytes=cache.block_bytes,
        dtype=str(cache.dtype),
        state_bytes=state_bytes,
    )


def read_export(cache: CacheEngine, block_ids: list[int], state_slot: int | None) -> memoryview:
    """An export's bytes: its blocks read with `CacheEngine.read_blocks`, then its state slot's
    (`StatePools.read_slot`), if it has one."""
    blocks = cache.read_blocks(block_ids).view(torch.uint8).numpy().reshape(-1)
    if state_slot is None:
        return blocks.data
    assert cache.states is not None, "a state slot exported by a model without states"
    return memoryview(blocks.tobytes() + cache.states.read_slot(state_slot))


def data_chunks(data: memoryview) -> Iterator[worker_pb2.BlockChunk]:
    """ReadBlocks' data messages for an export's bytes (`read_export`)."""
    for start in range(0, len(data), CHUNK_BYTES):
        yield worker_pb2.BlockChunk(data=bytes(data[start : start + CHUNK_BYTES]))


def import_blocks(
    cache: CacheEngine, imports: list[BlockImport]
) -> tuple[list[int], list[TransferFailure]]:
    """Read each import from its peer into the cache; (done transfer ids, failures)."""
    if not imports:
        return [], []
    done: list[int] = []
    failed: list[TransferFailure] = []
    for item in imports:
        start = time.perf_counter()
        try:
            blocks, state = _pull(cache, item)
        except (grpc.RpcError, ValueError) as exc:
            reason = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            code = exc.code().name if isinstance(exc, grpc.RpcError) else "INVALID"
            failed.append(TransferFailure(item.transfer_id, f"{item.peer}: {code}: {reason}"))
            metrics.IMPORT_FAILURES.inc()
            log.warning("KV import failed", transfer=item.transfer_id, peer=item.peer,
                        code=code, reason=reason)  # fmt: skip
            continue
        cache.write_blocks(item.block_ids, blocks)
        if state is not None and item.state_slot is not None:
            assert cache.states is not None
            cache.states.write_slot(item.state_slot, state)
        done.append(item.transfer_id)
        metrics.BLOCKS_IMPORTED.inc(len(item.block_ids))
        metrics.IMPORT_BYTES.inc(blocks.numel() * blocks.element_size())
        metrics.IMPORT_SECONDS.observe(time.perf_counter() - start)
    return done, failed


def _pull(cache: CacheEngine, item: BlockImport) -> tuple[torch.Tensor, memoryview | None]:
    """The peer's exported blocks, laid out as `CacheEngine.read_blocks` returns them, and its
    state slot's bytes (None: it exports none). Raises grpc.RpcError (peer unreachable,
    refused, export unknown) or ValueError (layout)."""
    request = worker_pb2.ReadBlocksRequest(transfer_id=item.transfer_id)
    with security.channel(item.peer, options=channel_options()) as channel:
        chunks = worker_pb2_grpc.WorkerStub(channel).ReadBlocks(request, timeout=IMPORT_TIMEOUT_S)
        header = next(chunks)
        failpoints.crash("worker.import_blocks", item.peer)
        expected = (len(item.block_ids), cache.block_bytes, str(cache.dtype))
        if (header.num_blocks, header.block_bytes, header.dtype) != expected:
            raise ValueError(
                f"the export holds {header.num_blocks} blocks of {header.block_bytes} bytes "
                f"({header.dtype}); this import wants {expected[0]} of {expected[1]} ({expected[2]})"
            )
        state_bytes = header.state_bytes
        if state_bytes and state_bytes != (cache.states.slot_bytes() if cache.states else 0):
            raise ValueError(f"the export's state of {state_bytes} bytes does not fit a slot here")
        if (item.state_slot is not None) != bool(state_bytes):
            raise ValueError(
                f"the export {'sends' if state_bytes else 'holds no'} state; the import "
                f"{'names no' if item.state_slot is None else 'names a'} state slot"
            )
        blocks_bytes = expected[0] * expected[1]
        data = bytearray(blocks_bytes + state_bytes)
        received = 0
        for chunk in chunks:
            end = received + len(chunk.data)
            if end > len(data):
                raise ValueError(f"the export sent more than {len(data)} bytes")
            data[received:end] = chunk.data
            received = end
    if received != len(data):
        raise ValueError(f"the export sent {received} bytes, not {len(data)}")
    count = blocks_bytes // cache.device_cache.element_size()
    # A round may carry a state snapshot alone (its blocks copied by earlier rounds).
    blocks = (
        torch.frombuffer(data, dtype=cache.dtype, count=count)
        if count
        else torch.empty(0, dtype=cache.dtype)
    )
    state = memoryview(data)[blocks_bytes:] if state_bytes else None
    return blocks.view(expected[0], *cache.device_cache.shape[1:]), state
