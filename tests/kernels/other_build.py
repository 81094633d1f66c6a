"""Kernel tests on another build of the CPU library: the library is built once per process
with `$LLMSERVE_KERNEL_FLAGS`, so another build's probe and tests each run in a child process
with those flags."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from llmserve_kernels.cpu import build

ROOT = Path(__file__).resolve().parents[2]


def _run(flags: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, build.FLAGS_ENV: flags}
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True
    )


def probe(flags: str, code: str) -> list[str]:
    """What `code` prints (split into words) on the build with `flags`, built if needed."""
    done = _run(flags, ["-c", code])
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def run_tests(flags: str, files: list[str], *pytest_args: str) -> str:
    """tests/kernels' `files` on the build with `flags`; their output's last line, once they
    passed."""
    done = _run(
        flags,
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
        + [str(ROOT / "tests" / "kernels" / name) for name in files],
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return done.stdout.splitlines()[-1]
