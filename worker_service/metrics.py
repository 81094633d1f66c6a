"""The worker's Prometheus metrics (served at /metrics on --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Waits between steps, from a tenth of a millisecond to seconds (an idle stream).
_GAP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 1.0, 10.0)

STEPS = Counter("llmserve_worker_steps", "Steps executed")
TOKENS = Counter("llmserve_worker_tokens", "Tokens computed (prefill and decode)")
FORWARD_SECONDS = Histogram(
    "llmserve_worker_forward_seconds",
    "Forward pass time per step: inputs built and the model called (not swaps or copies)",
    buckets=_TIME_BUCKETS,
)
# KV transfers between workers (worker_service/kv_transfer.py).
BLOCKS_EXPORTED = Counter("llmserve_worker_kv_blocks_sent", "KV blocks sent to peers (ReadBlocks)")
BLOCKS_IMPORTED = Counter("llmserve_worker_kv_blocks_received", "KV blocks imported from peers")
IMPORT_BYTES = Counter("llmserve_worker_kv_import_bytes", "Bytes of KV blocks imported from peers")
IMPORT_SECONDS = Histogram(
    "llmserve_worker_kv_import_seconds",
    "One import from a peer, request to the blocks in the cache",
    buckets=_TIME_BUCKETS,
)
IMPORT_FAILURES = Counter("llmserve_worker_kv_import_failures", "Imports that failed")
# Decode CUDA graphs (worker_service/cuda_graphs.py): steps served by a replay, and steps run
# eagerly by why (`cuda_graphs.eager_reason`; on a CUDA worker without graphs every step, as
# `cuda_graphs.graphs_off` says). Neither counts on a CPU worker.
GRAPH_STEPS = Counter("llmserve_worker_graph_steps", "Steps served by a decode CUDA graph")
EAGER_STEPS = Counter(
    "llmserve_worker_eager_steps", "Steps run eagerly on a CUDA worker, by why", ["reason"]
)
# Multi-step decoding (`llmserve.steps`): sequences whose run of passes ended before its last
# one, at the scheduler's word (`ExecuteRequest.end_passes`: a request arrived).
RUNS_ENDED = Counter(
    "llmserve_worker_multi_step_runs_ended",
    "Multi-step runs ended early because a request arrived (one per sequence)",
)
SAMPLE_SECONDS = Histogram(
    "llmserve_worker_sample_seconds", "Sampler time per step", buckets=_TIME_BUCKETS
)
# The worker's idle time between forward passes at steady decode: from the end of one step's
# forward pass (the model call, before sampling) to the start of the next step's (preparing
# its inputs), on the same Execute stream. `next_step="queued"`: the next step had arrived by
# the time the forward pass ended, so the gap is the worker's own overhead (sampling, handing
# the result to the relay thread, applying the next step: the result is encoded and sent on
# the event loop's thread); asynchronous scheduling makes this the usual case.
# `next_step="awaited"`: the worker waited for it (the result's trip to the scheduler, output
# processing, scheduling, the next step's trip; and idle time when no request is running).
FORWARD_GAP_SECONDS = Histogram(
    "llmserve_worker_forward_gap_seconds",
    "Time from the end of one step's forward pass to the start of the next step's",
    ["next_step"],
    buckets=_GAP_BUCKETS,
)
# Host time of a step before its model call: applying the step's updates, swaps and copies
# (Worker.execute) and building each pass's inputs (step_inputs.prepare_inputs). The input
# building is also inside llmserve_worker_forward_seconds, which times the whole pass up to
# sampling; on a CUDA worker the device waits for the next launch during this time.
PREPARE_SECONDS = Histogram(
    "llmserve_worker_prepare_seconds",
    "Host time per step before the model call: updates applied and inputs built",
    buckets=_TIME_BUCKETS,
)
# How long the model thread sat idle between two steps of an Execute stream, waiting for the
# next one to arrive: from the end of a step's execution (its result handed on) to the start
# of the next's. With asynchronous scheduling at steady decode it is the part of the
# scheduler's turnaround that the worker's own step did not cover; on a CUDA worker, whose
# forward pass returns before the device is done, this rather than the forward gap says how
# long the worker had nothing to run. Idle time with no request running counts too.
STEP_WAIT_SECONDS = Histogram(
    "llmserve_worker_step_wait_seconds",
    "Time the model thread waited for the next step of a stream after finishing one",
    buckets=_GAP_BUCKETS,
)
# Structured output: how long a step with deferred token masks waited for them after its
# forward pass (0 when the scheduler's masks were there first). The scheduler computes them
# while the forward pass runs, so this is the part of mask computation the worker still sees.
MASK_WAIT_SECONDS = Histogram(
    "llmserve_worker_mask_wait_seconds",
    "Time a step waited after its forward pass for its deferred token masks",
    buckets=(0.00001, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0),
)
KV_BLOCKS = Gauge("llmserve_worker_kv_blocks", "KV cache blocks allocated", ["device"])
# The process's resident memory is prometheus_client's process_resident_memory_bytes.
WEIGHT_BYTES = Gauge(
    "llmserve_worker_weight_bytes",
    "Bytes of model weights held, by format (the dtype, or 'gguf <types> <mode>')",
    ["format"],
)


def observe_step(num_tokens: int, forward_ns: int, sample_ns: int) -> None:
    STEPS.inc()
    TOKENS.inc(num_tokens)
    FORWARD_SECONDS.observe(forward_ns / 1e9)
    SAMPLE_SECONDS.observe(sample_ns / 1e9)


def observe_mask_wait(wait_ns: int) -> None:
    MASK_WAIT_SECONDS.observe(wait_ns / 1e9)


def observe_prepare(prepare_ns: int) -> None:
    PREPARE_SECONDS.observe(prepare_ns / 1e9)


def observe_step_wait(seconds: float) -> None:
    STEP_WAIT_SECONDS.observe(seconds)


def observe_forward_gap(seconds: float, queued: bool) -> None:
    FORWARD_GAP_SECONDS.labels("queued" if queued else "awaited").observe(seconds)


class ForwardGap:
    """Observes `llmserve_worker_forward_gap_seconds` between consecutive steps of a stream:
    from the end of one step's forward pass to the start of the next one's."""

    def __init__(self) -> None:
        self._prev_end_ns: int | None = None

    def observe(self, arrived_ns: int, forward: tuple[int, int] | None) -> None:
        """`arrived_ns`: when this step was read; `forward`: its forward pass (start, end)."""
        if forward is None:
            self._prev_end_ns = None  # nothing computed: no forward to measure from
            return
        start, end = forward
        prev_end = self._prev_end_ns
        if prev_end is not None:
            observe_forward_gap((start - prev_end) / 1e9, queued=arrived_ns <= prev_end)
        self._prev_end_ns = end
