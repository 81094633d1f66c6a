"""max_model_len is decided once: by the worker's model and cache, lowered (never raised) by
the scheduler's --max-model-len; an engine refuses to start without it."""

from __future__ import annotations

import pytest

from scheduler_service.__main__ import build_fleet_config, parse_args
from scheduler_service.engine import CacheConfig, ConfigError, LLMEngine, SchedulerConfig


def test_the_worker_decides_by_default() -> None:
    assert SchedulerConfig().with_worker_max_model_len(300).max_model_len == 300


def test_an_override_may_only_lower_it() -> None:
    assert SchedulerConfig(max_model_len=128).with_worker_max_model_len(300).max_model_len == 128
    with pytest.raises(ConfigError) as info:
        SchedulerConfig(max_model_len=512).with_worker_max_model_len(300)
    assert info.value.field == "max_model_len"
    assert "512" in str(info.value) and "300" in str(info.value)


def test_prefill_first_budget_is_checked_against_the_decided_length() -> None:
    config = SchedulerConfig(max_num_batched_tokens=256, enable_chunked_prefill=False)
    assert config.with_worker_max_model_len(256).max_model_len == 256
    with pytest.raises(ConfigError) as info:
        config.with_worker_max_model_len(257)
    assert info.value.field == "max_num_batched_tokens"


@pytest.mark.parametrize(
    ("chunked", "worker_len", "budget"),
    [
        (True, 8192, 2048),  # chunked prefill: the default budget, whatever the length
        (False, 8192, 8192),  # prefill-first: a whole context fits one step
        (False, 1024, 2048),  # ... and never less than the default
    ],
)
def test_an_unset_budget_fits_the_policy(chunked: bool, worker_len: int, budget: int) -> None:
    config = SchedulerConfig(enable_chunked_prefill=chunked)
    assert config.with_worker_max_model_len(worker_len).token_budget == budget


def test_a_set_budget_is_kept_whatever_the_policy() -> None:
    for chunked in (True, False):
        config = SchedulerConfig(max_num_batched_tokens=4096, enable_chunked_prefill=chunked)
        assert config.with_worker_max_model_len(4096).token_budget == 4096


def test_an_engine_needs_it_decided() -> None:
    with pytest.raises(ConfigError) as info:
        LLMEngine(SchedulerConfig(), CacheConfig(num_gpu_blocks=8, num_cpu_blocks=0), None)  # type: ignore[arg-type]
    assert info.value.field == "max_model_len"


def test_the_cli_leaves_it_to_the_worker() -> None:
    assert build_fleet_config(parse_args([])).replica.scheduler.max_model_len is None
    args = parse_args(["--max-model-len", "64"])
    assert build_fleet_config(args).replica.scheduler.max_model_len == 64
