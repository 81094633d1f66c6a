"""Speculative decoding through the services (worker, scheduler and gateway processes on the
tiny Llama, drafts crossing the Execute stream as proto): greedy outputs equal an in-process
engine's without drafts, drafts were made and kept, the usage block and the scheduler's
/metrics report them, and every block comes back."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmserve.client import Client
from llmserve.sampling_params import SamplingParams
from scheduler_service.engine import CacheConfig, LLMEngine, SchedulerConfig
from scheduler_service.engine.offline import generate
from tests.integration.test_services import wait_all_blocks_free
from tests.support.stack import RunningStack, start_stack
from worker_service.config import WorkerConfig
from worker_service.worker import Worker

pytestmark = [pytest.mark.e2e, pytest.mark.services]

# Prompts that repeat themselves, so that prompt lookup has something to draft.
PROMPTS = [
    "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,",
    "the cat sat on the mat, the cat sat on the mat, the cat",
    "def f(x): return x\ndef g(x): return x\ndef h(x):",
]
NEW = 32


@pytest.fixture(scope="module", params=["default", "continue-after-drafts"])
def stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RunningStack]:
    """The scheduler with drafts, and with steps after drafts sent before their result
    (`after_drafts` updates on the real worker)."""
    args = ["--num-speculative-tokens", "4", "--ngram-min", "1", "--ngram-max", "3"]
    if request.param == "continue-after-drafts":
        args.append("--continue-after-drafts")
    running = start_stack(
        str(tiny_model_dir), tmp_path_factory.mktemp("spec-stack-logs"), scheduler_args=args
    )
    yield running
    running.stop()


def test_drafted_outputs_equal_the_engine_without_drafts(
    stack: RunningStack, tiny_model_dir: Path, request: pytest.FixtureRequest
) -> None:
    with Client(stack.gateway) as client:
        prompt_ids = [client.tokenize(p) for p in PROMPTS]
        served = [
            client.complete(ids, temperature=0.0, max_tokens=NEW, ignore_eos=True).token_ids[0]
            for ids in prompt_ids
        ]
    worker = Worker(WorkerConfig(model=str(tiny_model_dir), num_threads=1))
    worker.load_model()
    worker.initialize_cache(256, 0)
    engine = LLMEngine(
        SchedulerConfig(max_model_len=512),
        CacheConfig(num_gpu_blocks=256, num_cpu_blocks=0),
        worker,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    local = generate(engine, prompt_ids, greedy)
    assert served == [out.outputs[0].token_ids for out in local]

    # The same requests over HTTP: the usage block reports the drafts, and /metrics too.
    drafted = kept = 0
    with httpx.Client(base_url=stack.http_url, timeout=60) as http:
        for ids in prompt_ids:
            body = {"prompt": ids, "max_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
            reply = http.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            usage = reply.json()["usage"]
            assert usage["completion_tokens"] == NEW
            spec = usage.get("speculative_decoding", {"draft_tokens": 0, "accepted_tokens": 0})
            assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
            drafted += spec["draft_tokens"]
            kept += spec["accepted_tokens"]
    assert kept > 0
    page = httpx.get(f"http://127.0.0.1:{stack.metrics_ports['scheduler']}/metrics").text

    def counter(name: str) -> float:
        return sum(
            float(v) for v in re.findall(rf"^{name}_total{{[^}}]*}} (\S+)$", page, re.MULTILINE)
        )

    # Both rounds of requests drafted (the HTTP round's are the usage blocks' figures).
    assert counter("llmserve_spec_decode_draft_tokens") > drafted
    assert counter("llmserve_spec_decode_accepted_tokens") > kept
    # With --continue-after-drafts, steps went out before their drafts were verified.
    after_drafts = counter("llmserve_spec_decode_after_drafts")
    continued = request.node.callspec.params["stack"] == "continue-after-drafts"
    assert (after_drafts > 0) == continued
    assert counter("llmserve_spec_decode_after_drafts_dropped") <= after_drafts
    free, total = wait_all_blocks_free(stack)
    assert free == total
