"""The scheduler has one source for its block size (each worker's Info): it takes no
--block-size, and `llmserve up` passes that flag to the workers only."""

from __future__ import annotations

import pytest

import llmserve.supervisor
from llmserve import cli
from scheduler_service.__main__ import parse_args


def test_the_scheduler_takes_no_block_size(capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(["--block-size", "16"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --block-size 16" in capsys.readouterr().err


def fake_up(monkeypatch) -> list:  # type: ignore[type-arg]
    """`llmserve up` records its stack config here instead of starting processes."""
    seen = []

    async def fake_run_stack(config):  # type: ignore[no-untyped-def]
        seen.append(config)
        return 0

    monkeypatch.setattr(llmserve.supervisor, "run_stack", fake_run_stack)
    # Configuring the process's logging would change what later tests capture.
    monkeypatch.setattr(cli, "configure_logging", lambda *args: None)
    return seen


def test_up_passes_block_size_to_the_workers_and_only_flags_the_scheduler_takes(monkeypatch):
    seen = fake_up(monkeypatch)
    argv = ["up", "--block-size", "8", "--num-gpu-blocks-override", "40", "--max-num-seqs", "4"]
    assert cli.main(argv) == 0
    (config,) = seen
    assert config.worker_args[:2] == ["--block-size", "8"]
    assert config.scheduler_args == [
        "--num-gpu-blocks-override", "40", "--max-num-seqs", "4", "--log-level", "INFO",
    ]  # fmt: skip
    args = parse_args(config.scheduler_args)
    assert (args.num_gpu_blocks_override, args.max_num_seqs) == (40, 4)


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], None, True),
        (["--no-async-scheduling"], None, False),
        (["--async-scheduling"], "false", True),  # the flag wins over the variable
        ([], "false", False),
    ],
)
def test_async_scheduling_flows_from_flag_or_env_into_the_replica_config(
    monkeypatch, argv, env, expected
):
    from scheduler_service.__main__ import build_fleet_config

    monkeypatch.delenv("LLMSERVE_ASYNC_SCHEDULING", raising=False)
    if env is not None:
        monkeypatch.setenv("LLMSERVE_ASYNC_SCHEDULING", env)
    assert build_fleet_config(parse_args(argv)).replica.async_scheduling is expected


def test_speculation_flags_flow_into_the_scheduler_config(monkeypatch, capsys):
    from scheduler_service.__main__ import build_fleet_config

    seen = fake_up(monkeypatch)
    monkeypatch.setenv("LLMSERVE_NGRAM_MAX", "5")
    assert cli.main(["up", "--num-speculative-tokens", "5"]) == 0
    config = build_fleet_config(parse_args(seen[0].scheduler_args)).replica.scheduler
    assert (config.num_speculative_tokens, config.ngram_min, config.ngram_max) == (5, 2, 5)
    monkeypatch.delenv("LLMSERVE_NGRAM_MAX")
    config = build_fleet_config(parse_args([])).replica.scheduler  # the documented defaults
    assert (config.num_speculative_tokens, config.ngram_min, config.ngram_max) == (0, 2, 6)
    with pytest.raises(SystemExit):
        build_fleet_config(parse_args(["--ngram-min", "5", "--ngram-max", "3"]))
    assert "ngram_min: need 1 <= ngram_min <= ngram_max, got 5 and 3" in capsys.readouterr().err
