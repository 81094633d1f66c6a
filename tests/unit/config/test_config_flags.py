"""Flags derived from config dataclasses (llmserve.config_flags): each kind of field becomes the
flag a user expects, and the services' flags default to their configs' defaults."""

from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass
from enum import Enum
from typing import Literal

import pytest

from gateway.__main__ import build_config as build_gateway_config
from gateway.__main__ import parse_args as gateway_args
from gateway.server import GatewayConfig
from llmserve.config_flags import add_flags, flag, flag_name, flag_values
from scheduler_service.__main__ import build_fleet_config
from scheduler_service.__main__ import parse_args as scheduler_args
from scheduler_service.engine.config import SchedulerConfig
from scheduler_service.fleet.fleet_config import FleetConfig, ReplicaConfig
from worker_service.__main__ import build_config
from worker_service.__main__ import parse_args as worker_args
from worker_service.config import WorkerConfig


class Colour(Enum):
    RED = "red"
    DARK_BLUE = "dark-blue"


@dataclass(frozen=True, slots=True)
class Example:
    count: int = flag(3, "how many")
    limit: int | None = flag(None, "an optional bound")
    ratio: float = flag(0.5, "a fraction")
    on: bool = flag(True, "a switch")
    colour: Colour = flag(Colour.RED, "an enum")
    size: Literal["small", "large"] = flag("small", "a literal")
    lease_s: float = flag(10.0, "a renamed flag", name="worker_lease_s")
    internal: int = 7  # no flag


def parse(argv: list[str]) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    add_flags(parser, Example)
    return flag_values(Example, parser.parse_args(argv))


def test_defaults_come_back_as_the_fields_defaults():
    assert Example(**parse([])) == Example()


def test_each_kind_of_field_parses_as_a_user_types_it():
    values = parse(
        [
            "--count=5",
            "--limit=9",
            "--ratio=0.25",
            "--no-on",
            "--colour=dark-blue",
            "--size=large",
            "--worker-lease-s=2.5",
        ]
    )
    assert Example(**values) == Example(5, 9, 0.25, False, Colour.DARK_BLUE, "large", 2.5)


@pytest.mark.parametrize("argv", [["--size=medium"], ["--colour=green"], ["--internal=1"]])
def test_values_outside_the_type_and_fields_without_a_flag_are_refused(argv: list[str]):
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, Example)
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parser.parse_args(argv)


def test_flag_names():
    assert flag_name(Example, "lease_s") == "--worker-lease-s"
    assert flag_name(SchedulerConfig, "enable_forced_tokens") == "--forced-tokens"


def test_the_scheduler_flags_default_to_its_configs_defaults():
    got = build_fleet_config(scheduler_args([]))
    assert got == FleetConfig(
        ReplicaConfig(SchedulerConfig()), shard=f"{socket.gethostname()}:50071"
    )


def test_the_worker_flags_default_to_its_configs_defaults():
    assert build_config(worker_args([])) == WorkerConfig()


def test_the_gateway_flags_default_to_its_configs_defaults(monkeypatch):
    for name in ("LLMSERVE_API_KEY", "LLMSERVE_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    assert build_gateway_config(gateway_args([])) == GatewayConfig()
