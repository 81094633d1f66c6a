"""The matrix-engine paths (llmserve_kernels/cpu/amx.h: fast mode's linear layers on 8-bit tiles,
its prompt attention on bfloat16 tiles) on a CPU without AMX: the library built with
`$LLMSERVE_KERNEL_FLAGS=-DLLMSERVE_AMX_EMULATE`, whose tile instructions are a C++ model of
their definitions, then those paths' tests, which need the engine to run. What this checks is
the kernels' use of the tiles (indexing, padding, scaling, the switch); the hardware's own
rounding of bfloat16 sums is only checked on a CPU with AMX, where the same tests run on it."""

from __future__ import annotations

import pytest

from llmserve_kernels.cpu import build
from tests.kernels.other_build import probe, run_tests


@pytest.mark.slow
def test_the_tile_paths_pass_their_tests_on_the_model_of_the_tiles():
    if "avx512bf16" not in build.isa():
        pytest.skip("the tile paths need AVX-512 with BF16 around the tiles")
    flags = "-DLLMSERVE_AMX_EMULATE"
    assert probe(
        flags, "from llmserve_kernels.cpu import build; print(build.set_matrix_engine(None))"
    ) == ["True"]
    summary = run_tests(flags, ["test_quant_amx.py", "test_prefill_amx.py"], "-rs")
    assert " passed" in summary and "skipped" not in summary, summary
