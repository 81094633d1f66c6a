"""Long-lived streams between our services survive idle minutes under keepalive pings.

The scheduler's Execute stream to each worker and the gateway's Connect stream to the scheduler
stay open while no request runs. Our clients ping every 30 s; a server with gRPC's default
policy answers the third ping without data with GOAWAY "too_many_pings", 150 s (at times
210 s) after the last message, and the next request then met a dead stream. The scenario
(keepalive_scenario.py) runs the production options against a control server that keeps
gRPC's defaults, over real loopback connections. It takes minutes, with no way to shorten
them (scaled-down intervals do not trip gRPC's throttled pings), so it runs in the background
from the session's start (tests/support/background.py) and this test reads its result.
"""

from __future__ import annotations

import pytest

from tests.integration.keepalive_scenario import TOTAL_LIMIT_S

pytestmark = [
    pytest.mark.slow,
    pytest.mark.background("tests.integration.keepalive_scenario", timeout_s=TOTAL_LIMIT_S),
]


def test_idle_streams_survive_keepalive_pings(background_result: dict) -> None:
    assert background_result["ours_alive"], (
        "the stream to a server with our options died while idle"
    )
    assert background_result["control_lasted"] is not None, (
        "the control server kept the stream: the test no longer shows the bug"
    )
