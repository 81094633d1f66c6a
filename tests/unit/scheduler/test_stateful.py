"""Random add / step / abort sequences (forks come from n > 1 and beam search, preemptions
from memory pressure and from priorities) keep the block manager consistent after every step, and free every block once all requests finish."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler_service.engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig

from .fake_model import FakeModel

GPU, CPU, BLOCK = 24, 64, 4

PARAMS = st.one_of(
    st.builds(lambda m: SamplingParams(max_tokens=m), st.integers(1, 12)),
    st.builds(
        lambda n, m: SamplingParams(n=n, max_tokens=m), st.integers(2, 3), st.integers(1, 12)
    ),
    st.builds(
        lambda m: SamplingParams(
            n=1, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=m
        ),
        st.integers(1, 8),
    ),
)


class EngineMachine(RuleBasedStateMachine):
    # KV groups (`llmserve.kv_layout`): one full group here.
    WINDOWS: tuple[int | None, ...] = (None,)

    def __init__(self) -> None:
        super().__init__()
        self.caching = True
        windows = self.WINDOWS
        gpu, cpu = GPU * len(windows), CPU * len(windows)  # the same memory in smaller blocks
        self.engine = LLMEngine(
            SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=24, max_model_len=40),
            CacheConfig(
                BLOCK, gpu, cpu, watermark=0.0, enable_prefix_caching=True, kv_windows=windows
            ),
            FakeModel(gpu, cpu, BLOCK, windows=windows),
        )
        self.next_id = 0
        self.live: list[str] = []

    @rule(
        prompt=st.lists(st.integers(1, 8), min_size=1, max_size=20),
        params=PARAMS,
        priority=st.integers(-2, 2),
    )
    def add(self, prompt, params, priority):
        request_id = f"r{self.next_id}"
        self.next_id += 1
        self.engine.add_request(request_id, prompt, params, eos_token_id=0, priority=priority)
        self.live.append(request_id)

    @rule()
    def step(self):
        for out in self.engine.step():
            if out.finished and out.request_id in self.live:
                self.live.remove(out.request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(self.live))
        assert self.engine.abort_request(request_id)
        self.live.remove(request_id)

    @invariant()
    def blocks_consistent(self):
        self.engine.scheduler.block_manager.check_invariants()

    def teardown(self):
        for _ in range(2000):
            if not self.engine.has_unfinished_requests():
                break
            self.step()
            self.engine.scheduler.block_manager.check_invariants()
        assert not self.engine.has_unfinished_requests()
        self.engine.step()  # flush the last frees to the worker
        bm = self.engine.scheduler.block_manager
        assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks - bm.num_reserved
        assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
        assert self.engine.executor.seqs == {}


EngineMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngineMachine = EngineMachine.TestCase


class WindowedEngineMachine(EngineMachine):
    """The same, on a hybrid layout: a full group beside a window of 5 tokens."""

    WINDOWS = (None, 5)


WindowedEngineMachine.TestCase.settings = EngineMachine.TestCase.settings
TestWindowedEngineMachine = WindowedEngineMachine.TestCase
