"""Kernel tests run on CPU under the Triton interpreter, and on CUDA when present.

TRITON_INTERPRET is read when a kernel is decorated, so it must be set before `llmserve_kernels` is
first imported; conftest.py is loaded before the test modules of this directory.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """The interpreter runs CPU tensors; compiled kernels need CUDA ones."""
    if request.param == "cpu" and not INTERPRETED:
        pytest.skip("CPU tensors need TRITON_INTERPRET=1")
    return request.param
