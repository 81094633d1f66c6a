"""Moving a sequence's KV blocks between two workers against computing them again (issue #29).

Two real `llmserve worker` processes on loopback; this script plays the scheduler on their
Execute streams. For each context length L: worker A prefills an L-token prompt (timed: the
recompute a migration by recompute pays), exports the blocks; worker B imports them in a step
of its own (timed, request to result: what a stop-and-copy migration pays), then decodes the
next token from the imported blocks, which must equal A's next token.

    .venv/bin/python bench/kv_transfer.py --model smollm2 --contexts 250 500 1000 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmserve.grpc_utils import channel_options  # noqa: E402
from llmserve.ports import free_ports  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402
from llmserve.step_proto import step_input_to_proto, step_result_from_proto  # noqa: E402
from llmserve.steps import (  # noqa: E402
    BlockExport,
    BlockImport,
    CachedSequence,
    NewSequence,
    StepInput,
    StepResult,
)
from llmserve.supervisor import stop_process  # noqa: E402
from llmserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402
from tests.support.stack import wait_healthy  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=2)


class Driver:
    """One worker's Execute stream, a step at a time, with each step's wall time."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=channel_options())
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.queue: asyncio.Queue[worker_pb2.ExecuteRequest | None] = asyncio.Queue()
        self.call = None
        self.step_id = 0

    async def open(self) -> worker_pb2.InfoResponse:
        info = await self.stub.Info(worker_pb2.InfoRequest())
        await self.stub.InitializeCache(
            worker_pb2.InitializeCacheRequest(num_gpu_blocks=info.num_gpu_blocks_available)
        )
        self.call = self.stub.Execute(self._requests())
        return info

    async def _requests(self) -> AsyncIterator[worker_pb2.ExecuteRequest]:
        while (message := await self.queue.get()) is not None:
            yield message

    async def step(self, **fields) -> tuple[StepResult, float]:  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        self.queue.put_nowait(step_input_to_proto(StepInput(self.step_id, **fields)))
        self.step_id += 1
        result = step_result_from_proto(await self.call.read())  # type: ignore[union-attr]
        return result, time.perf_counter() - start

    async def close(self) -> None:
        self.queue.put_nowait(None)
        await self.channel.close()


def start_worker(
    args: argparse.Namespace, name: str, log_dir: Path
) -> tuple[str, subprocess.Popen]:  # type: ignore[type-arg]
    port, metrics = free_ports(2)
    log = log_dir / f"{name}.log"
    popen = subprocess.Popen(
        [sys.executable, "-m", "llmserve.cli", "worker", "--model", args.model, "--port", str(port),
         "--metrics-port", str(metrics), "--dtype", args.dtype, "--kv-cache-memory",
         str(args.kv_cache_memory), "--num-threads", str(args.threads), "--max-model-len", "4096"],
        stdout=log.open("ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    wait_healthy(address, popen, name, log)
    return address, popen


async def measure(a: Driver, b: Driver, block_size: int, length: int, seq_id: int) -> dict:  # type: ignore[type-arg]
    rng = random.Random(length)
    prompt = [rng.randrange(100, 40000) for _ in range(length)]
    blocks = list(range(-(-(length + 1) // block_size)))  # room for the next token too
    new = NewSequence(seq_id, f"r{seq_id}", 0, prompt, length, 0, blocks, length, GREEDY)
    result, prefill_s = await a.step(new_seqs=[new])
    first = result.outputs[0].samples[0].token_id
    await a.step(exports=[BlockExport(seq_id, blocks)])
    reading = a.stub.ReadBlocks(worker_pb2.ReadBlocksRequest(transfer_id=seq_id))
    block_bytes = (await reading.read()).block_bytes  # the header; the rest is not read
    reading.cancel()
    imported, transfer_s = await b.step(imports=[BlockImport(seq_id, a.address, blocks)])
    assert imported.imported_transfer_ids == [seq_id], imported.failed_imports
    tokens = [*prompt, first]
    moved = NewSequence(seq_id, f"r{seq_id}", 0, tokens, length, length, blocks, 1, GREEDY)
    on_b, _ = await b.step(new_seqs=[moved])
    on_a, _ = await a.step(cached_seqs=[CachedSequence(seq_id, [first], len(blocks), [], 1)])
    same = on_b.outputs[0].samples[0].token_id == on_a.outputs[0].samples[0].token_id
    await a.step(released_transfer_ids=[seq_id], freed_seq_ids=[seq_id])
    await b.step(freed_seq_ids=[seq_id])
    return {
        "context_tokens": length,
        "blocks": len(blocks),
        "prefill_ms": round(prefill_s * 1000, 1),
        "prefill_forward_ms": round(result.forward_ns / 1e6, 1),
        "bytes": len(blocks) * block_bytes,
        "transfer_ms": round(transfer_s * 1000, 1),
        "transfer_gb_s": round(len(blocks) * block_bytes / transfer_s / 1e9, 3),
        "recompute_over_transfer": round(prefill_s / transfer_s, 1),
        "same_next_token": same,
    }


async def run(args: argparse.Namespace, a_address: str, b_address: str) -> list[dict]:  # type: ignore[type-arg]
    a, b = Driver(a_address), Driver(b_address)
    info = await a.open()
    await b.open()
    rows = []
    try:
        for repeat in range(args.repeats):
            for i, length in enumerate(args.contexts):
                row = await measure(a, b, info.block_size, length, 1 + i + 100 * repeat)
                rows.append(row)
    finally:
        await a.close()
        await b.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--contexts", type=int, nargs="+", default=[250, 500, 1000, 2000])
    p.add_argument("--kv-cache-memory", type=float, default=0.25, help="GiB per worker")
    p.add_argument("--threads", type=int, default=1, help="per worker (two share the machine)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory(prefix="llmserve-kv-transfer-") as tmp:
        workers = [start_worker(args, name, Path(tmp)) for name in ("a", "b")]
        try:
            rows = asyncio.run(run(args, workers[0][0], workers[1][0]))
        finally:
            for _, popen in workers:
                stop_process(popen, grace_s=10)
    print(json.dumps(rows, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows},
                                       indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
