"""The CPU kernels' instruction sets: the default build uses every one this CPU has
(`-march=native`), and on a CPU with AVX-512 the AVX2 code paths (what CPUs without it run)
still pass the kernel tests, built with `$LLMSERVE_KERNEL_FLAGS=-mno-avx512f`."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmserve_kernels.cpu import build
from tests.kernels.other_build import probe, run_tests


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def test_the_default_build_uses_what_this_cpu_has():
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    expected = {
        "avx2": {"avx2", "fma", "f16c"} <= flags,
        "avx512": {"avx512f", "avx512bw", "avx512vl"} <= flags,
        "avx512vnni": "avx512_vnni" in flags,
        "avx512bf16": "avx512_bf16" in flags,
    }
    assert build.isa() == [name for name in build.ISA_NAMES if expected[name]]


@pytest.mark.slow
def test_the_avx2_paths_pass_the_kernel_tests_on_an_avx512_cpu():
    """One build of the library without AVX-512 (about 30 s), then the tests of the kernels
    whose code differs by instruction set: fast mode's integer dots (maddubs against VNNI's
    dpbusd), on the file's layout and interleaved, exact mode's tiles (4 x 2 against 4 x 4),
    paged attention (bfloat16 keys widened or dotted by AVX512-BF16; the prompts' bfloat16
    dots, which fall back to fp32) and the fused ops."""
    if "avx512" not in build.isa():
        pytest.skip("this CPU has no AVX-512: the default build is the AVX2 one")
    flags = "-mno-avx512f"
    assert probe(flags, "from llmserve_kernels.cpu.build import isa; print('+'.join(isa()))") == [
        "avx2"
    ]
    tests = [
        "test_quant_linear.py",
        "test_quant_interleaved.py",
        "test_cpu_kernels.py",
        "test_prefill_bf16_dots.py",
    ]
    assert " passed" in run_tests(flags, tests, "-m", "not slow")
