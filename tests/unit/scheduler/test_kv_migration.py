"""Requests moved between engines with their KV blocks (`scheduler_service.fleet.kv_mover`) finish
exactly as if they had never moved, and the target computes only what was not copied.

Each engine runs its own FakeModel, whose next token depends on the tokens it reads back from
its own simulated cache; an import copies the peer's simulated slots. A block the target
counted as computed without the right content, or a block reused while a transfer held it,
changes the output. The replicas here are stand-ins for `Replica` (no gRPC): each step moves the
replica's queued transfer maps into the step, as the replica's step pipeline does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from llmserve.sampling_params import SamplingParams
from llmserve.v1 import worker_pb2
from scheduler_service.engine.offline import accumulate, generate
from scheduler_service.engine.request_output import RequestOutput
from scheduler_service.engine.snapshots import snapshot_from_choices
from scheduler_service.fleet import tracing
from scheduler_service.fleet.fleet_config import MigrationMode
from scheduler_service.fleet.kv_move import LinearFit, Rates
from scheduler_service.fleet.kv_mover import KvMover
from scheduler_service.fleet.move_policy import after_step, maybe_fetch
from scheduler_service.fleet.placement import cached_prefix_tokens
from scheduler_service.fleet.replica_events import Evicted, MoveFinished, ReplicaState, StepDone
from scheduler_service.fleet.transfer_queue import TransferQueue, transfer_news

from .fake_model import FakeModel
from .test_migration import assert_empty, make_engine, reference, summarize
from .test_preemption_equivalence import BLOCK, EOS, workload

NUM = 60


class StubReplica:
    """What `KvMover` uses of a `Replica`, stepping an in-process engine."""

    def __init__(
        self,
        address: str,
        num_gpu_blocks: int = 400,
        windows: tuple[int | None, ...] = (None,),
    ) -> None:
        self.address = address
        self.engine = make_engine(num_gpu_blocks, 0, windows=windows)
        self.model: FakeModel = self.engine.executor  # type: ignore[assignment]
        self.transfers: TransferQueue | None = TransferQueue(lambda: None)
        self.state = ReplicaState.READY
        self.block_size = BLOCK
        self.info: worker_pb2.InfoResponse | None = None  # role: mixed
        self.tracer = None  # no request spans

    def take_requests(self, request_ids: list[str]):  # type: ignore[no-untyped-def]
        return self.engine.export_requests(request_ids), {}

    def step(self, moves: KvMover) -> list[RequestOutput]:
        engine = self.engine
        sched_out, step_input = engine.begin_step()
        assert self.transfers is not None
        self.transfers.attach(step_input)
        engine.attach_masks(step_input)
        result = None if step_input.is_empty() else self.model.execute(step_input)
        outputs = engine.finish_step(sched_out, step_input, result)
        # As the fleet does on the replica's StepDone event.
        step = StepDone(self, transfer_news(step_input, result), 0, 0.0)
        after_step(moves, step, moves.report.pick_target)  # type: ignore[arg-type, attr-defined]
        return outputs

    def busy(self) -> bool:
        assert self.transfers is not None
        return self.engine.has_unfinished_requests() or self.transfers.busy


@dataclass
class Host:
    """The fleet's side (the mover's `report`): a moved request goes to its target if it is
    ready; a fallback to `fallback`."""

    fallback: StubReplica
    moved: list[str] = field(default_factory=list)
    fell_back: list[str] = field(default_factory=list)

    def pick_target(self, source, prompt):  # type: ignore[no-untyped-def]
        return self.fallback

    def __call__(self, event) -> None:  # type: ignore[no-untyped-def]
        if isinstance(event, MoveFinished) and event.target.state is ReplicaState.READY:
            event.target.engine.import_request(event.snapshot)
            self.moved.append(event.snapshot.request_id)
            return
        snapshots = [event.snapshot] if isinstance(event, MoveFinished) else event.snapshots
        assert isinstance(event, MoveFinished | Evicted), event
        for snapshot in snapshots:
            self.fallback.engine.import_request(snapshot)
            self.fell_back.append(snapshot.request_id)


def linked(*replicas: StubReplica) -> None:
    for replica in replicas:
        replica.model.peers = {r.address: r.model for r in replicas}


def run(
    replicas: list[StubReplica],
    moves: KvMover,
    on_step=lambda step: None,  # type: ignore[no-untyped-def]
    totals: dict[str, RequestOutput] | None = None,
) -> dict[str, RequestOutput]:
    totals = {} if totals is None else totals
    for step in range(3000):
        on_step(step)
        live = [r for r in replicas if r.engine is not None]
        if not any(r.busy() for r in live) and not moves.moves:
            break
        for replica in live:
            for delta in replica.step(moves):
                totals[delta.request_id] = accumulate(totals.get(delta.request_id), delta)
    else:
        raise AssertionError("the run did not end")
    return totals


def start(source: StubReplica) -> None:
    prompts, params = workload(NUM)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        source.engine.add_request(f"r{i}", prompt, p, eos_token_id=EOS)


def move_running(moves: KvMover, source: StubReplica, target: StubReplica) -> int:
    return sum(
        moves.start(source, target, g.request_id, "drain")  # type: ignore[arg-type]
        for g in list(source.engine.scheduler.running)
    )


def finished_as_reference(totals: dict[str, RequestOutput]) -> None:
    assert summarize([totals[f"r{i}"] for i in range(NUM)]) == reference(NUM)


@pytest.mark.parametrize("mode", [MigrationMode.PRE_COPY, MigrationMode.STOP_AND_COPY])
def test_moved_with_their_blocks_requests_finish_as_if_they_never_moved(mode: MigrationMode):
    a, b = StubReplica("a"), StubReplica("b")
    linked(a, b)
    host = Host(fallback=b)
    moves = KvMover(host, mode)  # type: ignore[arg-type]
    start(a)
    started: list[int] = []

    def on_step(step: int) -> None:
        if step in (6, 9):
            started.append(move_running(moves, a, b))

    totals = run([a, b], moves, on_step)
    finished_as_reference(totals)
    assert started[0] >= 5 and not host.fell_back
    assert len(host.moved) >= started[0]
    for replica in (a, b):
        assert replica.engine.scheduler.block_manager.transfers.pins == {}
        assert replica.model.exports == {}, "every export was released"
        assert_empty(replica.engine)


# A hybrid layout: a full KV group beside two windows (`llmserve.kv_layout`), in blocks of a
# third of the layers (three times as many in the same memory).
HYBRID = dict(num_gpu_blocks=1200, windows=(None, 6, 9))


@pytest.mark.parametrize("layout", [{}, HYBRID], ids=["one-group", "hybrid"])
def test_a_move_computes_on_the_target_only_what_was_not_copied(layout):  # type: ignore[no-untyped-def]
    """The same moves by transfer and by recompute (every import failing): the transfer run's
    target computes far fewer tokens, and both finish as the reference. On the hybrid layout
    (the fake model reads each window back) the windows' blocks move with the full group's."""
    computed = {}
    for fail in (False, True):
        a, b = StubReplica("a", **layout), StubReplica("b", **layout)
        linked(a, b)
        b.model.fail_imports = fail
        host = Host(fallback=b)
        moves = KvMover(host, MigrationMode.STOP_AND_COPY)  # type: ignore[arg-type]
        start(a)

        def on_step(step: int, a: StubReplica = a, b: StubReplica = b, moves=moves) -> None:  # type: ignore[no-untyped-def]
            if step == 8:
                move_running(moves, a, b)

        totals = run([a, b], moves, on_step)
        windows = layout.get("windows", (None,))
        assert summarize([totals[f"r{i}"] for i in range(NUM)]) == reference(NUM, windows)
        assert (host.fell_back == []) != fail
        assert_empty(a.engine)
        assert_empty(b.engine)
        computed[fail] = b.model.num_computed_tokens
    # Recompute re-runs every moved context; a transfer re-runs at most the partial blocks.
    assert computed[False] < computed[True] * 0.6, computed


@pytest.mark.parametrize("phase", ["queued", "exported"])
@pytest.mark.parametrize("lost", ["source", "target"])
@pytest.mark.parametrize("mode", [MigrationMode.PRE_COPY, MigrationMode.STOP_AND_COPY])
def test_a_side_lost_mid_move_falls_back_to_recompute_and_leaks_nothing(lost, mode, phase):  # type: ignore[no-untyped-def]
    """A replica's engine dropped while its moves have a round in flight (the export queued, or
    registered on the source with the import queued on the target): requests still on a lost
    source were evicted (to `c`, as the fleet would place them); those stopped for their last
    round, or still on a draining source when the target is lost, move by recompute."""
    a, b, c = StubReplica("a"), StubReplica("b"), StubReplica("c")
    linked(a, b, c)
    host = Host(fallback=c)
    moves = KvMover(host, mode)  # type: ignore[arg-type]
    start(a)
    a.state = ReplicaState.DRAINING  # a drain's moves: what stays on the source is evicted
    totals: dict[str, RequestOutput] = {}

    def on_step(step: int) -> None:
        if step != 6:
            return
        assert move_running(moves, a, b) >= 5
        if phase == "exported":
            for delta in a.step(moves):
                totals[delta.request_id] = accumulate(totals.get(delta.request_id), delta)
            assert b.transfers is not None and b.transfers.imports
        assert any(m.transfer_id is not None for m in moves.moves.values())
        gone = a if lost == "source" else b
        engine = gone.engine
        for snapshot in engine.export_requests():  # the lost replica's requests move
            c.engine.import_request(snapshot)
        gone.engine, gone.transfers = None, None  # type: ignore[assignment]
        moves.on_engine_dropped(engine)
        assert moves.moves == {}
        engine.scheduler.block_manager.check_invariants()

    run([a, b, c], moves, on_step, totals)
    finished_as_reference(totals)
    assert host.fell_back or lost == "source"
    for replica in (a, b, c):
        if replica.engine is not None:
            assert replica.engine.scheduler.block_manager.transfers.pins == {}
            assert_empty(replica.engine)


def test_a_prefill_replica_hands_each_request_to_a_decode_replica_after_its_first_token():
    """A prefill worker's requests stop there once every running sequence has its first token,
    and finish on the decode worker, as the reference; the decode worker computes fewer tokens
    than when every hand-off's import fails (and it recomputes the contexts)."""
    computed = {}
    for fail in (False, True):
        a, b = StubReplica("a"), StubReplica("b")
        a.info = worker_pb2.InfoResponse(role=worker_pb2.WORKER_ROLE_PREFILL)
        b.info = worker_pb2.InfoResponse(role=worker_pb2.WORKER_ROLE_DECODE)
        linked(a, b)
        b.model.fail_imports = fail
        host = Host(fallback=b)
        moves = KvMover(host, MigrationMode.RECOMPUTE)  # hand-offs copy in every mode
        start(a)
        totals = run([a, b], moves)
        finished_as_reference(totals)
        # Every request that wanted more than its first token went on on b (by recompute when
        # its import failed; one with no full block to copy has nothing to fail).
        longer = {f"r{i}" for i in range(NUM) if len(totals[f"r{i}"].outputs[0].token_ids) > 1}
        assert longer <= set(host.moved) | set(host.fell_back)
        assert bool(host.fell_back) == fail
        for replica in (a, b):
            assert replica.engine.scheduler.block_manager.transfers.pins == {}
            assert_empty(replica.engine)
        computed[fail] = b.model.num_computed_tokens
    assert computed[False] < computed[True], computed


def fetch_setup(fail: bool = False):  # type: ignore[no-untyped-def]
    """`a` has computed a 40-token prefix (then finished its request); the returned request
    shares it and is to be queued on `b`, which holds nothing."""
    a, b = StubReplica("a"), StubReplica("b")
    linked(a, b)
    b.model.fail_imports = fail
    prefix = [(7 * i) % 61 + 1 for i in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)
    a.engine.add_request("warm", prefix + [3], params, eos_token_id=EOS)
    moves = KvMover(Host(fallback=b), MigrationMode.PRE_COPY)  # type: ignore[arg-type]
    run([a], moves)
    prompt = prefix + [5, 9, 11]
    snapshot = snapshot_from_choices("fetched", prompt, params, EOS, 0.0, [])
    expected = generate(make_engine(400, 0), [prompt], params, eos_token_id=EOS)[0]
    expected.request_id = "fetched"
    return a, b, moves, snapshot, expected


def test_a_request_fetches_a_cached_prefix_from_a_peer_and_runs_as_if_computed_there():
    a, b, moves, snapshot, expected = fetch_setup()
    assert cached_prefix_tokens(a.engine, snapshot.prompt_token_ids) == 40
    assert not maybe_fetch(moves, [a, b], b, 0, snapshot, None, min_tokens=41)  # type: ignore[arg-type]
    before = b.model.num_computed_tokens
    assert maybe_fetch(moves, [a, b], b, 0, snapshot, None, min_tokens=8)  # type: ignore[arg-type]
    totals = run([a, b], moves)
    assert summarize([totals["fetched"]]) == summarize([expected])
    assert moves.report.moved == ["fetched"]  # type: ignore[attr-defined]
    # b computed the 3 uncached prompt tokens and the decode steps, not the 40 fetched ones.
    assert b.model.num_computed_tokens - before == 3 + 5
    for replica in (a, b):
        assert replica.engine.scheduler.block_manager.transfers.pins == {}
        assert replica.model.exports == {}
        assert_empty(replica.engine)


def test_a_failed_fetch_places_the_request_by_recompute():
    a, b, moves, snapshot, expected = fetch_setup(fail=True)
    assert maybe_fetch(moves, [a, b], b, 0, snapshot, None, min_tokens=8)  # type: ignore[arg-type]
    totals = run([a, b], moves)
    assert summarize([totals["fetched"]]) == summarize([expected])
    assert moves.report.fell_back == ["fetched"]  # type: ignore[attr-defined]
    for replica in (a, b):
        assert replica.engine.scheduler.block_manager.transfers.pins == {}
        assert_empty(replica.engine)


def test_measured_rates_decide_whether_a_copy_pays():
    rates = Rates()
    assert rates.copy_beats_compute(10, 160)  # nothing measured yet
    # Rounds: 50 ms of two steps' latency plus 1 ms a block.
    for blocks in (4, 8, 60, 120, 8, 60):
        rates.on_round(blocks, 0.050 + 0.001 * blocks)
    # Steps: 20 ms of overhead plus 1 ms a token (decodes and prefills).
    for tokens in (8, 16, 200, 1000, 8):
        rates.on_step(tokens, 0.020 + 0.001 * tokens)
    fixed, per_block = rates.rounds.fit()  # type: ignore[misc]
    assert fixed == pytest.approx(0.050) and per_block == pytest.approx(0.001)
    assert rates.steps.fit()[1] == pytest.approx(0.001)  # type: ignore[index]
    # 4 blocks (64 tokens): 54 ms to copy, 64 ms to compute; 2 blocks: 52 ms against 32.
    assert rates.copy_beats_compute(4, 64)
    assert not rates.copy_beats_compute(2, 32)
    # One size only: all of the time counts per unit.
    single = LinearFit()
    single.add(10, 0.5)
    assert single.fit() == (0.0, 0.05)


@pytest.mark.parametrize("fail", [False, True])
def test_each_transfer_round_is_a_span_that_says_how_it_ended(monkeypatch, fail: bool):  # type: ignore[no-untyped-def]
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "tracer", provider.get_tracer("test"))
    a, b = StubReplica("a"), StubReplica("b")
    linked(a, b)
    b.model.fail_imports = fail
    moves = KvMover(Host(fallback=b), MigrationMode.STOP_AND_COPY)  # type: ignore[arg-type]
    start(a)

    def on_step(step: int) -> None:
        if step == 6:
            move_running(moves, a, b)

    run([a, b], moves, on_step)
    spans = [s for s in exporter.get_finished_spans() if s.name == "scheduler.kv_transfer"]
    assert len(spans) >= 5
    for span in spans:
        assert span.attributes["llmserve.transfer.from_worker"] == "a"
        assert span.attributes["llmserve.transfer.to_worker"] == "b"
        assert span.attributes["llmserve.transfer.blocks"] > 0
        assert span.attributes["llmserve.transfer.cause"] == "drain"
        assert (span.status.status_code is StatusCode.ERROR) == fail


def long_hand_off(max_tokens: int):  # type: ignore[no-untyped-def]
    """A prefill replica `a` holding a 122-token request ("long"), which prefills in two
    chunks (96 tokens a step), and a decode replica `b`; with the prompt and the request's
    output from an engine that never moved it."""
    a, b = StubReplica("a"), StubReplica("b")
    a.info = worker_pb2.InfoResponse(role=worker_pb2.WORKER_ROLE_PREFILL)
    b.info = worker_pb2.InfoResponse(role=worker_pb2.WORKER_ROLE_DECODE)
    linked(a, b)
    prompt = [(5 * i) % 59 + 1 for i in range(122)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    a.engine.add_request("long", prompt, params, eos_token_id=EOS)
    expected = generate(make_engine(400, 0), [prompt], params, eos_token_id=EOS)[0]
    expected.request_id = "long"
    return a, b, prompt, expected


def test_a_long_prompt_streams_its_blocks_to_the_decode_replica_chunk_by_chunk():
    """A 122-token prompt prefills in two chunks (96 tokens a step) on the prefill replica:
    the first chunk's blocks are copied while the second computes, the rest after the first
    token; the decode replica computes only the tokens after the last full block and the
    decodes."""
    a, b, prompt, expected = long_hand_off(max_tokens=5)
    moves = KvMover(Host(fallback=b), MigrationMode.PRE_COPY)  # type: ignore[arg-type]
    totals = run([a, b], moves)
    assert summarize([totals["long"]]) == summarize([expected])
    assert b.model.num_imports == 2  # the first chunk's blocks, then the second's
    assert a.model.num_computed_tokens == len(prompt)  # a computed the prefill only
    # b: the 3 tokens after the last full block (122 = 30 * 4 + 2, and the first token),
    # which sample the second token, then 3 decodes for the other 3.
    assert b.model.num_computed_tokens == 3 + 3
    for replica in (a, b):
        assert replica.engine.scheduler.block_manager.transfers.pins == {}
        assert_empty(replica.engine)


def test_a_request_aborted_while_its_prefix_is_fetched_is_never_queued():
    a, b, moves, snapshot, _ = fetch_setup()
    assert maybe_fetch(moves, [a, b], b, 0, snapshot, None, min_tokens=8)  # type: ignore[arg-type]
    assert moves.abort("fetched")
    totals = run([a, b], moves)
    assert "fetched" not in totals and moves.report.moved == []  # type: ignore[attr-defined]
    for replica in (a, b):
        assert replica.engine.scheduler.block_manager.transfers.pins == {}
        assert replica.model.exports == {}
        assert_empty(replica.engine)


@pytest.mark.parametrize("fail", [False, True])
def test_a_request_stops_on_the_prefill_replica_at_its_first_token_while_a_round_is_in_flight(
    fail: bool,
) -> None:
    """The decode replica steps only every fourth step, so the first chunk's round is still in
    flight when the prompt's last chunk samples the first token: the request stops on the
    prefill replica then (its last blocks pinned for the round after), rather than decoding
    there until the round is done and racing the hand-off to its end. When the import fails,
    the stopped request goes on by recompute and its pins are let go."""
    a, b, prompt, expected = long_hand_off(max_tokens=12)
    b.model.fail_imports = fail
    b_step, calls = b.step, iter(range(10**6))
    b.step = lambda moves: b_step(moves) if next(calls) % 4 == 3 else []  # type: ignore[method-assign]
    host = Host(fallback=b)
    moves = KvMover(host, MigrationMode.PRE_COPY)
    totals = run([a, b], moves)
    assert summarize([totals["long"]]) == summarize([expected])
    assert (host.moved, host.fell_back) == (([], ["long"]) if fail else (["long"], []))
    assert a.model.num_computed_tokens == len(prompt)  # a computed the prefill only
    for replica in (a, b):
        assert replica.engine.scheduler.block_manager.transfers.pins == {}
        assert_empty(replica.engine)
