"""`llmserve <service> --check-config` through the real CLI, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.services


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # Variables of the developer's shell must not leak into what is being checked.
    base = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_")}
    return subprocess.run(
        [sys.executable, "-m", "llmserve.cli", *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("service", ["worker", "scheduler", "gateway"])
def test_defaults_pass(service: str):
    result = run_cli(service, "--check-config")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"llmserve {service}: configuration ok"


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (
            ["worker", "--block-size", "3"],
            {},
            "llmserve worker: invalid configuration: block_size: must be a power of two, got 3",
        ),
        (
            ["worker"],
            {"LLMSERVE_KV_CACHE_MEMORY": "lots"},
            "llmserve worker: invalid configuration: LLMSERVE_KV_CACHE_MEMORY: invalid value 'lots' "
            "(could not convert string to float: 'lots')",
        ),
        (
            ["scheduler"],
            {"LLMSERVE_ROUTING": "random"},
            "llmserve scheduler: invalid configuration: LLMSERVE_ROUTING: invalid choice 'random' "
            "(choose from cache_aware, least_loaded, round_robin)",
        ),
        (
            ["scheduler"],
            {"LLMSERVE_MAX_NUM_SEQS": "0"},
            "llmserve scheduler: invalid configuration: max_num_seqs: must be at least 1, got 0",
        ),
        (
            ["gateway", "--model", "/nonexistent/model"],
            {},
            "llmserve gateway: invalid configuration: model: model path '/nonexistent/model' is "
            "neither a directory nor a .gguf file",
        ),
        (
            ["gateway", "--chat-template", "/nonexistent/template.jinja"],
            {},
            "llmserve gateway: invalid configuration: --chat-template: cannot read "
            "'/nonexistent/template.jinja': No such file or directory",
        ),
        (
            ["gateway"],
            {"LLMSERVE_TOOL_CALL_PARSER": "mistral"},
            "llmserve gateway: invalid configuration: LLMSERVE_TOOL_CALL_PARSER: invalid choice "
            "'mistral' (choose from auto, generic, hermes, llama3_json)",
        ),
        (
            # SmolLM2's own template never renders tools.
            ["gateway", "--tool-call-parser", "hermes"],
            {},
            "llmserve gateway: invalid configuration: --tool-call-parser: hermes needs a chat "
            "template that renders tools (this one never uses `tools`); use generic, or give "
            "such a template with --chat-template",
        ),
        (
            ["gateway", "--no-such-flag"],
            {},
            "llmserve gateway: invalid configuration: unrecognized arguments: --no-such-flag",
        ),
    ],
)
def test_a_bad_configuration_is_one_line_and_exit_2(
    args: list[str], env: dict[str, str], message: str
):
    result = run_cli(*args, "--check-config", env=env)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == message + "\n"


def test_a_template_native_format_with_its_template_passes():
    from tests.support.templates import template_path

    for parser, template in (("hermes", "hermes"), ("llama3_json", "llama3"), ("auto", "llama3")):
        result = run_cli(
            "gateway",
            "--check-config",
            "--tool-call-parser",
            parser,
            "--chat-template",
            str(template_path(template)),
        )
        assert result.returncode == 0, result.stderr


def test_up_refuses_an_unknown_tool_call_parser():
    result = run_cli("up", "--tool-call-parser", "mistral")
    assert result.returncode == 2
    assert "argument --tool-call-parser: invalid choice: 'mistral'" in result.stderr


def test_flag_wins_over_variable_in_the_real_cli():
    # The variable alone is invalid; the flag on the command line replaces it.
    result = run_cli(
        "scheduler", "--check-config", "--max-num-seqs", "4", env={"LLMSERVE_MAX_NUM_SEQS": "0"}
    )
    assert result.returncode == 0, result.stderr


def test_help_names_the_environment_variables():
    result = run_cli("scheduler", "--help")
    assert result.returncode == 0
    assert "LLMSERVE_FLAG" in result.stdout


def test_health_of_nothing_listening_fails_with_one_line():
    import socket

    with socket.socket() as sock:  # bound, never listening: the connection is refused
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        result = run_cli("health", address, "--timeout", "2")
    assert result.returncode == 1
    assert result.stderr.startswith(f"{address}: UNAVAILABLE")
    assert result.stderr.count("\n") == 1
