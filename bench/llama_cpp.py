"""llama.cpp's own server, built here from source, and GGUFs of the embedded model for it.

`llama_server()` builds `llama-server` and `llama-quantize` on first use from the llama.cpp
sources vendored in the `llama-cpp-python` source distribution (fetched with pip from the
package index this machine uses), with CMake, Ninja and the system compiler: Release,
`GGML_NATIVE=ON` (tuned for this CPU, as our kernels are with -march=native), and
`LLAMA_USE_PREBUILT_UI=OFF`, without which the build tries to download its web UI. ggml's CPU
backend adds its own `-march=native` after the flags given here, so on a CPU with AMX (a Xeon
of the 4th generation on) llama-server runs its AMX kernels ("AMX model buffer" in its log):
earlier builds here passed `-mno-amx-*`, which that later flag undid. ggml builds its tile
configuration in a local, and GCC 12's `_tile_loadconfig` tells the compiler it reads only 8
bytes of it, so the stores filling the rest may be dropped as dead and LDTILECFG then faults
(llmserve_kernels/cpu/quant_amx.cpp met it; a build here once died so at its first matmul): on x86
the build keeps dead stores (`-fno-dse -fno-tree-dse`), a flag, not a change to its sources.
About 12 minutes on 2 cores; the binaries are cached under `$LLMSERVE_BENCH_CACHE` (default
`~/.cache/llmserve/bench`), keyed by the sdist's version and the build flags. They load
llama.cpp's shared libraries from the build directory, so each set of flags has a build
directory of its own.

`llama_server(blas=True)` builds with ggml's BLAS backend, which multiplies prompt-sized
batches (32 rows and more) with `cblas_sgemm` on weights it dequantizes to float32: OpenBLAS
from the `scipy-openblas32` wheel, whose symbols carry a `scipy_` prefix, behind a small
library of ours (`openblas()`) that exports the names ggml calls and CMake's FindBLAS links.

`gguf_for(dtype, spec)` requantizes a model's GGUF (default: the embedded SmolLM2 Q4_1) to F32 or BF16 with
`llama-quantize --allow-requantize`, so both servers read the same weights (dequantized from
the same Q4_1 file) at the same width.

    .venv/bin/python bench/llama_cpp.py          # build (if needed) and print the paths
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

SDIST_PACKAGE = "llama-cpp-python"
TARGETS = ("llama-server", "llama-quantize")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
# On x86: GCC 12's tile-configuration intrinsic (the module comment says why).
KEEP_DEAD_STORES = "-fno-dse -fno-tree-dse"
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0"}
OPENBLAS_WHEEL = "scipy-openblas32"
# The names ggml's BLAS backend calls, and FindBLAS's link test (sgemm_), on the wheel's
# prefixed ones.
OPENBLAS_SHIM_C = """\
#include <cblas.h>

extern void scipy_sgemm_(const char*, const char*, const blasint*, const blasint*,
                         const blasint*, const float*, const float*, const blasint*,
                         const float*, const blasint*, const float*, float*, const blasint*);

void sgemm_(const char* ta, const char* tb, const blasint* m, const blasint* n,
            const blasint* k, const float* alpha, const float* a, const blasint* lda,
            const float* b, const blasint* ldb, const float* beta, float* c,
            const blasint* ldc) {
  scipy_sgemm_(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_sgemm(enum CBLAS_ORDER order, enum CBLAS_TRANSPOSE ta, enum CBLAS_TRANSPOSE tb,
                 blasint m, blasint n, blasint k, float alpha, const float* a, blasint lda,
                 const float* b, blasint ldb, float beta, float* c, blasint ldc) {
  scipy_cblas_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void openblas_set_num_threads(int n) { scipy_openblas_set_num_threads(n); }

int openblas_get_parallel(void) { return scipy_openblas_get_parallel(); }
"""
OPENBLAS_SHIM_H = """\
#pragma once
#include "{wheel_include}/cblas.h"
#ifdef __cplusplus
extern "C" {{
#endif
void cblas_sgemm(enum CBLAS_ORDER, enum CBLAS_TRANSPOSE, enum CBLAS_TRANSPOSE, blasint, blasint,
                 blasint, float, const float*, blasint, const float*, blasint, float, float*,
                 blasint);
void openblas_set_num_threads(int);
int openblas_get_parallel(void);
#ifdef __cplusplus
}}
#endif
"""


def cache_dir() -> Path:
    root = os.environ.get("LLMSERVE_BENCH_CACHE") or Path.home() / ".cache" / "llmserve" / "bench"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _log(message: str) -> None:
    print(f"[llama.cpp] {message}", file=sys.stderr, flush=True)


def _tool(name: str) -> str:
    """cmake / ninja from PATH, else from this venv (pip install cmake ninja)."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", name], check=True)
        found = shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError(f"{name} is needed to build llama.cpp and could not be installed")
    return found


def _sdist() -> Path:
    downloads = cache_dir() / "sdist"
    existing = sorted(downloads.glob("llama_cpp_python-*.tar.gz"))
    if existing:
        return existing[-1]
    downloads.mkdir(exist_ok=True)
    _log(f"fetching the {SDIST_PACKAGE} source distribution")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            SDIST_PACKAGE,
            "--no-binary",
            ":all:",
            "--no-deps",
            "-d",
            str(downloads),
        ],
        check=True,
    )
    return sorted(downloads.glob("llama_cpp_python-*.tar.gz"))[-1]


def openblas_dir() -> Path:
    """Where `openblas()` puts the library and header that ggml's BLAS backend builds on."""
    return cache_dir() / "openblas"


def openblas() -> Path:
    """A directory holding lib/libopenblas.so and include/cblas.h for ggml's BLAS backend
    (the module comment says why), made on first use."""
    root = openblas_dir()
    library = root / "lib" / "libopenblas.so"
    if library.exists():
        return root
    wheels = cache_dir() / "wheels"
    wheels.mkdir(exist_ok=True)
    if not list(wheels.glob("scipy_openblas32-*.whl")):
        _log(f"fetching the {OPENBLAS_WHEEL} wheel")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                OPENBLAS_WHEEL,
                "--only-binary",
                ":all:",
                "--no-deps",
                "-d",
                str(wheels),
            ],
            check=True,
        )
    wheel = sorted(wheels.glob("scipy_openblas32-*.whl"))[-1]
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(root / "wheel")
    wheel_lib = root / "wheel" / "scipy_openblas32" / "lib"
    wheel_include = root / "wheel" / "scipy_openblas32" / "include"
    (root / "include").mkdir(parents=True, exist_ok=True)
    (root / "include" / "cblas.h").write_text(OPENBLAS_SHIM_H.format(wheel_include=wheel_include))
    (root / "shim.c").write_text(OPENBLAS_SHIM_C)
    library.parent.mkdir(exist_ok=True)
    subprocess.run(
        [
            shutil.which("cc") or "gcc",
            "-O2",
            "-shared",
            "-fPIC",
            f"-I{root / 'include'}",
            str(root / "shim.c"),
            "-o",
            str(library),
            f"-L{wheel_lib}",
            "-lscipy_openblas",
            f"-Wl,-rpath,{wheel_lib}",
        ],
        check=True,
    )
    return root


def build_flags(blas: bool = False) -> list[str]:
    """CMAKE_FLAGS, on x86 the compiler told to keep dead stores, and with `blas` ggml's BLAS
    backend on `openblas()` (which `llama_server` makes before building)."""
    flags = list(CMAKE_FLAGS)
    if platform.machine() in ("x86_64", "AMD64"):
        flags += [f"-DCMAKE_C_FLAGS={KEEP_DEAD_STORES}", f"-DCMAKE_CXX_FLAGS={KEEP_DEAD_STORES}"]
    if blas:
        shim = openblas_dir()
        flags += [
            "-DGGML_BLAS=ON",
            "-DGGML_BLAS_VENDOR=OpenBLAS",
            f"-DCMAKE_PREFIX_PATH={shim}",
            f"-DBLAS_INCLUDE_DIRS={shim / 'include'}",
        ]
    return flags


def llama_server(blas: bool = False) -> tuple[Path, Path]:
    """Paths of `llama-server` and `llama-quantize`, built on first use (`blas`: with ggml's
    BLAS backend)."""
    sdist = _sdist()
    version = sdist.name.removesuffix(".tar.gz").split("-", 1)[1]
    flags = build_flags(blas)
    tag = hashlib.sha256("\0".join(flags).encode()).hexdigest()[:8]
    bin_dir = cache_dir() / f"llama.cpp-{version}" / f"bin-{tag}"
    binaries = tuple(bin_dir / name for name in TARGETS)
    if all(path.exists() for path in binaries):
        return binaries[0], binaries[1]
    source_root = cache_dir() / f"llama.cpp-{version}" / "src"
    if not (source_root / "CMakeLists.txt").exists():
        with tempfile.TemporaryDirectory(dir=cache_dir()) as scratch:
            with tarfile.open(sdist) as archive:
                archive.extractall(scratch, filter="data")
            (top,) = Path(scratch).iterdir()
            shutil.rmtree(source_root, ignore_errors=True)
            source_root.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(top / "vendor" / "llama.cpp"), source_root)
    build = source_root.parent / f"build-{tag}"  # the binaries load its shared libraries
    if blas:
        openblas()
    _log(f"building {', '.join(TARGETS)} in {build} (about 12 minutes on 2 cores)")
    subprocess.run(
        [
            _tool("cmake"),
            "-S",
            str(source_root),
            "-B",
            str(build),
            "-G",
            "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={_tool('ninja')}",
            *flags,
        ],
        check=True,
    )
    subprocess.run(
        [_tool("cmake"), "--build", str(build), "--target", *TARGETS, "-j", str(os.cpu_count())],
        check=True,
    )
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in TARGETS:
        shutil.copy2(build / "bin" / name, bin_dir / name)
    return binaries[0], binaries[1]


def model_gguf(spec: str = "smollm2") -> Path:
    """The GGUF file behind an llmserve model spec (default: the embedded SmolLM2)."""
    from llmserve.model_spec import resolve_model

    source = resolve_model(spec)
    if source.gguf_file is None:
        raise ValueError(f"model {spec!r} is not a GGUF file")
    return Path(source.path) / source.gguf_file


def gguf_for(dtype: str, spec: str = "smollm2") -> Path:
    """The model's GGUF requantized to `dtype` (float32, bfloat16, q8_0 or q4_0) by llama-quantize;
    `dtype` "file": the model's GGUF file as it is."""
    if dtype == "file":
        return model_gguf(spec)
    kind = GGUF_TYPES[dtype]
    source = model_gguf(spec)
    stem = source.name.split(".")[0]  # SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct
    target = cache_dir() / f"{stem}.{kind}.gguf"
    if target.exists():
        return target
    _, quantize = llama_server()
    partial = target.with_suffix(".partial")
    subprocess.run(
        [str(quantize), "--allow-requantize", str(source), str(partial), kind],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    os.replace(partial, target)
    return target


if __name__ == "__main__":
    server, quantize = llama_server()
    print(server)
    print(quantize)
    for name in GGUF_TYPES:
        print(gguf_for(name))
