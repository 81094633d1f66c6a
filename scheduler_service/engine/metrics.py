"""The scheduler's Prometheus metrics, all `llmserve_*`, labelled by replica where per replica."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from llmserve.steps import StepInput, StepResult
from scheduler_service.engine.scheduler_outputs import SchedulerStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

_R = ["replica"]
SHARD_INFO = Gauge(
    "llmserve_scheduler_shard_info", "1, labelled with this scheduler's shard name", ["shard"]
)
RUNNING = Gauge("llmserve_requests_running", "Requests running", _R)
WAITING = Gauge("llmserve_requests_waiting", "Requests waiting to be scheduled", _R)
SWAPPED = Gauge("llmserve_requests_swapped", "Requests swapped out to host memory", _R)
WAITING_PREFILL_TOKENS = Gauge(
    "llmserve_waiting_prefill_tokens",
    "Tokens the waiting requests still have to prefill (the prefill pool's scaling metric)",
    _R,
)
ROLE = Gauge(
    "llmserve_replica_role",
    "1 per replica, labelled with its worker's role (mixed, prefill, decode): join on replica",
    [*_R, "role"],
)
KV_USAGE = Gauge(
    "llmserve_kv_cache_usage_ratio",
    "Fraction of KV blocks in use: of each device (group=all), and of the device blocks each "
    "KV group holds (group=0, 1, ...)",
    [*_R, "device", "group"],
)
PREFIX_QUERIES = Counter(
    "llmserve_prefix_cache_queries", "Prompt blocks looked up in the prefix cache", _R
)
PREFIX_HITS = Counter("llmserve_prefix_cache_hits", "Prompt blocks found in the prefix cache", _R)
PREEMPTIONS = Counter("llmserve_preemptions", "Preemptions", [*_R, "mode"])
PROMPT_TOKENS = Counter("llmserve_prompt_tokens", "Prompt tokens computed", _R)
GENERATION_TOKENS = Counter("llmserve_generation_tokens", "Tokens generated", _R)
ITERATION_SECONDS = Histogram(
    "llmserve_iteration_seconds",
    "One scheduler iteration, worker included",
    _R,
    buckets=_STEP_BUCKETS,
)
WORKER_FORWARD_SECONDS = Histogram(
    "llmserve_worker_forward_seconds_seen",
    "Worker forward time reported in step results",
    _R,
    buckets=_STEP_BUCKETS,
)
TTFT_SECONDS = Histogram(
    "llmserve_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS
)
TPOT_SECONDS = Histogram(
    "llmserve_time_per_output_token_seconds",
    "Mean time between output tokens of a request",
    buckets=_STEP_BUCKETS,
)
E2E_SECONDS = Histogram(
    "llmserve_e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS
)
QUEUE_SECONDS = Histogram(
    "llmserve_request_queue_time_seconds", "Arrival to first scheduled", buckets=_LATENCY_BUCKETS
)
FINISHED = Counter("llmserve_requests_finished", "Finished requests", ["finish_reason"])
# Per priority (label: the value, or "<-10" / ">10" beyond, so clients cannot add series).
TTFT_BY_PRIORITY_SECONDS = Histogram(
    "llmserve_time_to_first_token_by_priority_seconds",
    "Arrival to first token, by request priority (lower is served first)",
    ["priority"],
    buckets=_LATENCY_BUCKETS,
)
FINISHED_BY_PRIORITY = Counter(
    "llmserve_requests_finished_by_priority", "Finished requests, by priority", ["priority"]
)
_PRIORITY_LABEL_LIMIT = 10


def priority_label(priority: int) -> str:
    if priority < -_PRIORITY_LABEL_LIMIT:
        return f"<-{_PRIORITY_LABEL_LIMIT}"
    if priority > _PRIORITY_LABEL_LIMIT:
        return f">{_PRIORITY_LABEL_LIMIT}"
    return str(priority)


# Cumulative scheduler counters are mirrored into Prometheus counters by their increase.
_last: dict[tuple[Counter, tuple[str, ...]], float] = {}
# Each labelled series' child, looked up once: labels() takes a lock and checks its arguments
# on every call, and every step of every replica records a dozen series.
_children: dict[tuple[Counter | Gauge | Histogram, tuple[str, ...]], Any] = {}


def _child(metric: Counter | Gauge | Histogram, *key: str) -> Any:
    child = _children.get((metric, key))
    if child is None:
        child = _children[(metric, key)] = metric.labels(*key)
    return child


def _advance(counter: Counter, key: tuple[str, ...], total: float) -> None:
    previous = _last.get((counter, key), 0.0)
    if total > previous:
        _child(counter, *key).inc(total - previous)
    _last[(counter, key)] = total


# Speculative decoding, as vLLM v1 counts it (scheduler_service/engine/speculation.py).
SPEC_DRAFTS = Counter("llmserve_spec_decode_drafts", "Sequence-steps that carried draft tokens", _R)
SPEC_DRAFT_TOKENS = Counter("llmserve_spec_decode_draft_tokens", "Draft tokens verified", _R)
SPEC_ACCEPTED_TOKENS = Counter(
    "llmserve_spec_decode_accepted_tokens", "Draft tokens kept (equal to the target's sample)", _R
)
SPEC_ACCEPTED_PER_POS = Counter(
    "llmserve_spec_decode_accepted_tokens_per_pos",
    "Draft tokens kept, by position in the draft (0 = first)",
    [*_R, "position"],
)
# --continue-after-drafts (scheduler_service/engine/pipelined_steps.py).
SPEC_AFTER_DRAFTS = Counter(
    "llmserve_spec_decode_after_drafts",
    "Updates sent before their step's drafts were verified, assuming all kept",
    _R,
)
SPEC_AFTER_DRAFTS_DROPPED = Counter(
    "llmserve_spec_decode_after_drafts_dropped",
    "Updates sent assuming kept drafts that were dropped (the drafts were cut)",
    _R,
)


def record_stats(replica_id: int, stats: SchedulerStats) -> None:
    r = str(replica_id)
    _child(RUNNING, r).set(stats.num_running)
    _child(WAITING, r).set(stats.num_waiting)
    _child(SWAPPED, r).set(stats.num_swapped)
    _child(WAITING_PREFILL_TOKENS, r).set(stats.num_waiting_prefill_tokens)
    _child(KV_USAGE, r, "gpu", "all").set(stats.gpu_kv_usage)
    _child(KV_USAGE, r, "cpu", "all").set(stats.cpu_kv_usage)
    for group, usage in enumerate(stats.kv_group_usage):
        _child(KV_USAGE, r, "gpu", str(group)).set(usage)
    _advance(PREFIX_QUERIES, (r,), stats.prefix_cache_queries)
    _advance(PREFIX_HITS, (r,), stats.prefix_cache_hits)
    _advance(PREEMPTIONS, (r, "recompute"), stats.num_preemptions_recompute)
    _advance(PREEMPTIONS, (r, "swap"), stats.num_preemptions_swap)
    if stats.num_spec_drafts:
        _advance(SPEC_DRAFTS, (r,), stats.num_spec_drafts)
        _advance(SPEC_DRAFT_TOKENS, (r,), stats.num_spec_draft_tokens)
        _advance(SPEC_ACCEPTED_TOKENS, (r,), stats.num_spec_accepted_tokens)
        for position, kept in enumerate(stats.spec_accepted_per_position):
            _advance(SPEC_ACCEPTED_PER_POS, (r, str(position)), kept)
    if stats.num_spec_after_drafts:
        _advance(SPEC_AFTER_DRAFTS, (r,), stats.num_spec_after_drafts)
        _advance(SPEC_AFTER_DRAFTS_DROPPED, (r,), stats.num_spec_after_drafts_dropped)


def record_step(
    replica_id: int,
    stats: SchedulerStats,
    step: StepInput,
    result: StepResult | None,
    seconds: float,
    num_generated: int | None = None,
) -> None:
    """`num_generated`: tokens sequences got (default: the worker's samples,
    which with asynchronous scheduling counts outputs dropped for finished sequences)."""
    record_stats(replica_id, stats)
    r = str(replica_id)
    if step.is_empty():
        return
    _child(ITERATION_SECONDS, r).observe(seconds)
    # A decode computes one token of a sequence the worker holds (and its drafts); the rest
    # is prompt (prefill chunks and recomputes).
    decode_tokens = sum(
        s.num_scheduled_tokens
        for s in step.cached_seqs
        if s.num_scheduled_tokens == 1 + len(s.draft_token_ids)
    )
    _child(PROMPT_TOKENS, r).inc(step.num_scheduled_tokens - decode_tokens)
    if result is not None:
        _child(WORKER_FORWARD_SECONDS, r).observe(result.forward_ns / 1e9)
        if num_generated is None:
            num_generated = sum(1 for o in result.outputs if o.samples)
        _child(GENERATION_TOKENS, r).inc(num_generated)


def record_finished(
    finish_reason: str,
    arrival: float,
    first_scheduled: float | None,
    first_token: float | None,
    finished: float,
    num_output_tokens: int,
    priority: int = 0,
) -> None:
    FINISHED.labels(finish_reason).inc()
    label = priority_label(priority)
    FINISHED_BY_PRIORITY.labels(label).inc()
    E2E_SECONDS.observe(finished - arrival)
    if first_scheduled is not None:
        QUEUE_SECONDS.observe(first_scheduled - arrival)
    if first_token is not None:
        TTFT_SECONDS.observe(first_token - arrival)
        TTFT_BY_PRIORITY_SECONDS.labels(label).observe(first_token - arrival)
        if num_output_tokens > 1:
            TPOT_SECONDS.observe((finished - first_token) / (num_output_tokens - 1))


# -- structured output ----------------------------------------------------------------------------

GRAMMAR_COMPILE_SECONDS = Histogram(
    "llmserve_grammar_compile_seconds",
    "Compiling a grammar for the model's tokenizer (compile-cache misses), off the TTFT path",
    buckets=_STEP_BUCKETS,
)
GRAMMAR_ERRORS = Counter(
    "llmserve_grammar_errors",
    "Grammars that failed on the scheduler (the gateway refuses most at admission), by stage "
    "(compile, setup, timeout: past --max-grammar-compile-ms, refused_token)",
    ["stage"],
)
GRAMMAR_MASK_SECONDS = Histogram(
    "llmserve_grammar_mask_seconds",
    "Computing one step's token masks (while the worker runs its forward pass; what the "
    "worker still waits for is llmserve_worker_mask_wait_seconds)",
    _R,
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
)
GRAMMAR_MASKED_ROWS = Counter("llmserve_grammar_masked_rows", "Rows sampled under a mask", _R)
GRAMMAR_FORCED_TOKENS = Counter(
    "llmserve_grammar_forced_tokens",
    "Tokens a grammar forced, appended as inputs instead of sampled one step each",
    _R,
)


def record_grammar_compile(seconds: float, ok: bool) -> None:
    if ok:
        GRAMMAR_COMPILE_SECONDS.observe(seconds)
    else:
        GRAMMAR_ERRORS.labels("compile").inc()


def record_grammar_setup_error() -> None:
    GRAMMAR_ERRORS.labels("setup").inc()


def record_grammar_compile_timeout() -> None:
    GRAMMAR_ERRORS.labels("timeout").inc()


def record_grammar_refused_token() -> None:
    """A sampled token the grammar refused (a mask that was not applied): its sequence is
    aborted."""
    GRAMMAR_ERRORS.labels("refused_token").inc()


def record_grammar_step(
    replica_id: int, num_masks: int, mask_seconds: float, total_forced_tokens: int
) -> None:
    """A finished step's `num_masks` token masks (computed in `mask_seconds`)."""
    r = str(replica_id)
    if num_masks:
        GRAMMAR_MASK_SECONDS.labels(r).observe(mask_seconds)
        GRAMMAR_MASKED_ROWS.labels(r).inc(num_masks)
    _advance(GRAMMAR_FORCED_TOKENS, (r,), total_forced_tokens)


# -- the fleet ------------------------------------------------------------------------------------

WORKERS = Gauge("llmserve_workers", "Worker replicas by state", ["state"])
MIGRATIONS = Counter(
    "llmserve_request_migrations",
    "Requests moved to another replica, by cause (stream, watchdog, health, lease, dns, drain, "
    "removed, step_failed)",
    ["cause"],
)
DRAIN_SECONDS = Histogram(
    "llmserve_worker_drain_seconds",
    "From a drain's start to its replica's last request",
    buckets=_LATENCY_BUCKETS,
)
KV_MIGRATIONS = Counter(
    "llmserve_kv_migrations",
    "Requests moved with their KV blocks, by outcome (transfer: queued on the target with its "
    "blocks; fallback: a transfer failed or the target went away, moved by recompute)",
    ["outcome"],
)
KV_MIGRATION_SECONDS = Histogram(
    "llmserve_kv_migration_seconds",
    "From a move's start to its request queued on the target (copy rounds included)",
    buckets=_LATENCY_BUCKETS,
)
KV_MIGRATION_BLOCKS = Counter(
    "llmserve_kv_migration_blocks",
    "KV blocks copied between workers for moved requests",
)
ROUTING_DECISIONS = Counter(
    "llmserve_routing_decisions",
    "Placements of requests on replicas, by policy and whether the prompt hit the target's "
    "prefix cache",
    ["policy", "prefix_hit"],
)


def record_role(replica_id: int, role: str) -> None:
    ROLE.labels(str(replica_id), role).set(1)


def record_worker_states(states: list) -> None:  # type: ignore[type-arg]
    """Set the per-state gauge from every replica's state (an IntEnum with names)."""
    counts = {name: 0 for name in ("JOINING", "READY", "DRAINING", "LOST")}
    for state in states:
        counts[state.name] += 1
    for name, count in counts.items():
        WORKERS.labels(name.lower()).set(count)


def record_routing(policy: str, prefix_hit: bool) -> None:
    ROUTING_DECISIONS.labels(policy, "true" if prefix_hit else "false").inc()
