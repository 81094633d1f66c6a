"""LLMSERVE_<FLAG> variables: flag > environment > default, converted and checked like flags."""

from __future__ import annotations

import argparse

import pytest

from llmserve.config_env import EnvConfigError, apply_env_defaults, env_name, env_options
from llmserve.service_main import add_common_flags


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="test")
    add_common_flags(p, default_port=50061)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--preemption-mode", choices=["auto", "recompute", "swap"], default="auto")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--verbose", action="store_true")
    return p


def parse(argv: list[str], environ: dict[str, str]) -> argparse.Namespace:
    p = make_parser()
    apply_env_defaults(p, environ)
    return p.parse_args(argv)


def test_env_name_is_the_flag_in_upper_case_with_underscores():
    assert env_name("--max-num-seqs") == "LLMSERVE_MAX_NUM_SEQS"
    assert env_name("--host") == "LLMSERVE_HOST"


def test_default_when_neither_flag_nor_variable():
    args = parse([], {})
    assert (args.host, args.port, args.max_num_seqs) == ("127.0.0.1", 50061, 256)


def test_variable_over_default_converted_by_the_flags_type():
    args = parse(
        [],
        {
            "LLMSERVE_HOST": "0.0.0.0",
            "LLMSERVE_PORT": "7000",
            "LLMSERVE_MAX_NUM_SEQS": "8",
            "LLMSERVE_PREEMPTION_MODE": "swap",
        },
    )
    assert (args.host, args.port, args.max_num_seqs) == ("0.0.0.0", 7000, 8)
    assert args.preemption_mode == "swap"


def test_flag_over_variable():
    args = parse(
        ["--port", "9000", "--no-enable-prefix-caching"],
        {"LLMSERVE_PORT": "7000", "LLMSERVE_ENABLE_PREFIX_CACHING": "true"},
    )
    assert args.port == 9000
    assert args.enable_prefix_caching is False


@pytest.mark.parametrize(("text", "expected"), [("false", False), ("0", False), ("YES", True)])
def test_boolean_variables(text: str, expected: bool):
    args = parse([], {"LLMSERVE_ENABLE_PREFIX_CACHING": text, "LLMSERVE_VERBOSE": text})
    assert args.enable_prefix_caching is expected
    assert args.verbose is expected


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("LLMSERVE_PORT", "http", "LLMSERVE_PORT: invalid value 'http'"),
        ("LLMSERVE_PREEMPTION_MODE", "never", "LLMSERVE_PREEMPTION_MODE: invalid choice 'never'"),
        ("LLMSERVE_ENABLE_PREFIX_CACHING", "maybe", "expected true or false, got 'maybe'"),
    ],
)
def test_bad_variable_is_reported_under_its_own_name(name: str, text: str, message: str):
    with pytest.raises(EnvConfigError, match=message):
        parse([], {name: text})


def test_every_long_flag_has_a_variable_and_help_does_not():
    names = set(env_options(make_parser()))
    assert "LLMSERVE_METRICS_PORT" in names
    assert "LLMSERVE_LOG_JSON" in names
    assert "LLMSERVE_HELP" not in names
