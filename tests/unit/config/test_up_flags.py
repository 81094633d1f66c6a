"""`llmserve up` passes each flag to the service that owns it, and each service's own parser
takes the command line `up` builds for it (nothing is started)."""

from __future__ import annotations

import argparse

import pytest

import llmserve.supervisor
from llmserve import cli
from llmserve.supervisor import ServiceSpec, StackConfig, plan_stack


@pytest.fixture
def up(monkeypatch: pytest.MonkeyPatch) -> list[StackConfig]:
    """Runs `llmserve up ARGS` and records its stack config instead of starting processes."""
    seen: list[StackConfig] = []

    async def fake_run_stack(config: StackConfig) -> int:
        seen.append(config)
        return 0

    monkeypatch.setattr(llmserve.supervisor, "run_stack", fake_run_stack)
    # Configuring the process's logging would change what later tests capture.
    monkeypatch.setattr(cli, "configure_logging", lambda *args: None)
    return seen


def services(config: StackConfig) -> dict[str, ServiceSpec]:
    return {spec.name: spec for spec in plan_stack(config)}


def parsed(spec: ServiceSpec) -> argparse.Namespace:
    """The service's own options, parsed from the command line `up` gives it."""
    from gateway.__main__ import parse_args as gateway_args
    from scheduler_service.__main__ import parse_args as scheduler_args
    from worker_service.__main__ import parse_args as worker_args

    command, *argv = spec.args
    parse = {"worker": worker_args, "scheduler": scheduler_args, "gateway": gateway_args}
    return parse[command](argv)


def test_vllm_serve_flags_reach_the_services_that_own_them(up: list[StackConfig]) -> None:
    argv = ["up", "--device", "cpu", "--max-model-len", "512", "--quantization", "q8_0"]
    argv += ["--quant-mode", "exact", "--linear-impl", "gguf", "--kv-cache-dtype", "model"]
    argv += ["--served-model-name", "my-model", "--tool-call-parser", "generic"]
    argv += ["--stream-interval", "4"]
    assert cli.main(argv) == 0
    (config,) = up
    plan = services(config)
    worker, scheduler, gateway = plan["worker-0"], plan["scheduler"], plan["gateway"]

    def has(spec: ServiceSpec, flag: str, value: str) -> bool:
        return flag in spec.args and spec.args[spec.args.index(flag) + 1] == value

    # The workers decide the context (the scheduler and the gateway learn it from them).
    assert has(worker, "--max-model-len", "512") and has(worker, "--quantization", "q8_0")
    assert has(gateway, "--served-model-name", "my-model")
    assert has(gateway, "--tool-call-parser", "generic")
    for spec, foreign in (
        (worker, ["--served-model-name", "--tool-call-parser", "--stream-interval"]),
        (
            scheduler,
            [
                "--max-model-len",
                "--quantization",
                "--quant-mode",
                "--kv-cache-dtype",
                "--served-model-name",
            ],
        ),
        (gateway, ["--max-model-len", "--quantization", "--stream-interval"]),
    ):
        assert not set(foreign) & set(spec.args), (spec.name, spec.args)

    worker_opts = parsed(worker)
    assert (worker_opts.max_model_len, worker_opts.quantization) == (512, "q8_0")
    assert (worker_opts.quant_mode, worker_opts.linear_impl) == ("exact", "gguf")
    assert worker_opts.kv_cache_dtype == "model"
    scheduler_opts = parsed(scheduler)
    assert scheduler_opts.max_model_len is None
    assert scheduler_opts.stream_interval == 4
    gateway_opts = parsed(gateway)
    assert (gateway_opts.served_model_name, gateway_opts.tool_call_parser) == (
        "my-model",
        "generic",
    )


def test_without_them_every_service_keeps_its_default(up: list[StackConfig]) -> None:
    assert cli.main(["up", "--device", "cpu"]) == 0
    plan = services(up[0])
    flags = ["--max-model-len", "--quantization", "--quant-mode", "--kv-cache-dtype"]
    for flag in (*flags, "--served-model-name"):
        assert all(flag not in spec.args for spec in plan.values()), flag
    assert parsed(plan["gateway"]).served_model_name is None  # the gateway serves --model's


def test_an_unknown_tool_call_parser_is_refused_before_anything_starts(
    up: list[StackConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["up", "--tool-call-parser", "mistral"])
    assert exited.value.code == 2
    assert "--tool-call-parser: invalid choice: 'mistral'" in capsys.readouterr().err
    assert up == []
