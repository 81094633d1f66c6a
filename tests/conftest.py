"""Shared test configuration."""

from __future__ import annotations

import os

import pytest

from tests.support.background import BackgroundScenario

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Without CUDA the Triton kernels run in Triton's interpreter. Set before anything imports
# triton, whichever test module is collected first.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Background scenarios (tests/support/background.py), started when collection has finished.
_BACKGROUND = pytest.StashKey[dict[str, BackgroundScenario]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    started = session.config.stash.setdefault(_BACKGROUND, {})
    if session.config.option.collectonly:
        return
    for item in session.items:
        marker = item.get_closest_marker("background")
        if marker is not None:
            started[item.nodeid] = BackgroundScenario(marker.args[0])


def pytest_sessionfinish(session: pytest.Session) -> None:
    for scenario in session.config.stash.get(_BACKGROUND, {}).values():
        scenario.stop()


@pytest.fixture
def background_result(request: pytest.FixtureRequest) -> dict:
    """What the marked test's background scenario printed (tests/support/background.py)."""
    marker = request.node.get_closest_marker("background")
    assert marker is not None, "background_result needs @pytest.mark.background(module, ...)"
    started = request.config.stash.setdefault(_BACKGROUND, {})
    scenario = started.get(request.node.nodeid) or BackgroundScenario(marker.args[0])
    started[request.node.nodeid] = scenario
    return scenario.result(marker.kwargs["timeout_s"])
