"""The matrix-engine paths (kernels/cpu/amx.h: fast mode's linear layers on 8-bit tiles,
its prompt attention on bfloat16 tiles) on a CPU without AMX: the library built with
`$LLMSERVE_KERNEL_FLAGS=-DLLMSERVE_AMX_EMULATE`, whose tile instructions are a C++ model of
their definitions, then those paths' tests, which need the engine to run. What this checks is
the kernels' use of the tiles (indexing, padding, scaling, the switch); the hardware's own
rounding of bfloat16 sums is only checked on a CPU with AMX, where the same tests run on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cpu import build

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_tile_paths_pass_their_tests_on_the_model_of_the_tiles():
    if "avx512bf16" not in build.isa():
        pytest.skip("the tile paths need AVX-512 with BF16 around the tiles")
    env = {**os.environ, build.FLAGS_ENV: "-DLLMSERVE_AMX_EMULATE"}
    probe = "from kernels.cpu import build; print(build.set_matrix_engine(None))"
    built = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert built.returncode == 0, built.stderr
    assert built.stdout.split() == ["True"]
    tests = ["test_quant_amx.py", "test_prefill_amx.py"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
        + [str(ROOT / "tests" / "kernels" / name) for name in tests],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, run.stdout[-2000:]
