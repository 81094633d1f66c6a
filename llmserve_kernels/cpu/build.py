"""Builds and loads the C++ kernel library of this package.

The sources are compiled with the system C++ compiler (`$CXX`, default `g++`) for this
machine's CPU (`-march=native`, then the flags in `$LLMSERVE_KERNEL_FLAGS`, e.g.
`-mno-avx512f` for the AVX2 kernels on an AVX-512 CPU) and cached under
`$LLMSERVE_KERNEL_CACHE` (default `~/.cache/llmserve/kernels`), keyed by the sources, the
flags, the compiler and the CPU, so a change to any of them rebuilds it (a few seconds).
`isa()` names the instruction sets the kernels were compiled for. Several processes may
build at once: each writes its own file and the last rename wins. The library is loaded with
ctypes; calls release the GIL, and its parallel loops run on its own threads (pool.h), never
OpenMP's.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
COMMON_FLAGS = ("-O3", "-march=native", "-pthread", "-fPIC", "-std=c++20")
FLAGS_ENV = "LLMSERVE_KERNEL_FLAGS"  # extra compiler flags, after COMMON_FLAGS
# llmserve_kernel_isa()'s bits, in order.
ISA_NAMES = ("avx2", "avx512", "avx512vnni", "avx512bf16")
# The kernels that can run on the matrix engine, in amx::Path's order: fast mode's linear
# layers (quant_amx.cpp) and its prompt attention (prefill_amx.h).
MATRIX_ENGINE_PATHS = ("linear", "prefill")
# Per source: extra flags. ops.cpp and sampling_rows.cpp mirror torch's rounding, so no
# multiply-add contraction.
SOURCES = {
    "paged_attention.cpp": (),
    "paged_prefill.cpp": (),
    "ops.cpp": ("-ffp-contract=off",),
    "sampling_rows.cpp": ("-ffp-contract=off",),
    "decode.cpp": (),
    "pool.cpp": (),
    # Dequantized weights must round as numpy's d * q + m does (two roundings).
    "quant.cpp": ("-ffp-contract=off",),
    "quant_fast.cpp": (),
    "quant_interleaved.cpp": (),
    "quant_amx.cpp": (),
    "amx.cpp": (),
    "linear_attention.cpp": (),
    "linear_prefill.cpp": (),
    "isa.cpp": (),
}
HEADERS = (
    "vec.h",
    "pool.h",
    "linear.h",
    "attention.h",
    "prefill_chunk.h",
    "prefill_amx.h",
    "amx.h",
    "quant.h",
    "quant_dequant.h",
    "quant_fast.h",
    "quant_amx.h",
    "quant_chunked.h",
    "quant_interleaved.h",
    "quant_wide.h",
    "linear_attention.h",
)


class NativeKernelUnavailable(RuntimeError):
    """The C++ kernels cannot be built or loaded here (no compiler, build error)."""


_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None


def library() -> ctypes.CDLL:
    """The loaded kernel library, built first if needed. Raises NativeKernelUnavailable."""
    global _library, _failure
    with _lock:
        if _library is None and _failure is None:
            try:
                _library = _declare(ctypes.CDLL(str(_build())))
            except (OSError, subprocess.SubprocessError, NativeKernelUnavailable) as exc:
                _failure = str(exc)
        if _library is None:
            raise NativeKernelUnavailable(f"CPU kernels unavailable: {_failure}")
        return _library


def is_available() -> bool:
    try:
        library()
    except NativeKernelUnavailable:
        return False
    return True


def isa() -> list[str]:
    """The instruction sets the loaded kernels were compiled for (ISA_NAMES), which choose
    their code paths. Raises NativeKernelUnavailable."""
    bits = library().llmserve_kernel_isa()
    return [name for i, name in enumerate(ISA_NAMES) if bits >> i & 1]


def set_matrix_engine(on: bool | None) -> bool:
    """Let the kernels use the matrix engine (AMX tiles, amx.h) or not (None: leave it as it
    is; on by default): fast mode's linear layers on calls of `quant.matrix_engine_rows()`
    rows or more (the same outputs bit for bit) and fast mode's prompt attention (bfloat16
    tiles). Returns whether it is on: False when off, or where the CPU, the build or the OS
    lacks it. Raises NativeKernelUnavailable."""
    return bool(library().llmserve_set_matrix_engine(-1 if on is None else int(on)))


def matrix_engine_calls(path: str) -> int:
    """How many calls a matrix-engine path (MATRIX_ENGINE_PATHS) has taken in this process."""
    return int(library().llmserve_matrix_engine_calls(MATRIX_ENGINE_PATHS.index(path)))


def _flags() -> tuple[str, ...]:
    return (*COMMON_FLAGS, *shlex.split(os.environ.get(FLAGS_ENV, "")))


def _compiler() -> str:
    compiler = os.environ.get("CXX", "g++")
    path = shutil.which(compiler)
    if path is None:
        raise NativeKernelUnavailable(f"no C++ compiler ({compiler!r} not found; set $CXX)")
    return path


def _cpu_signature() -> str:
    """-march=native binds the build to the CPU: key the cache by its model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features")
    lines = {line.split(":")[0].strip(): line for line in text.splitlines() if ":" in line}
    return platform.machine() + "".join(lines.get(k, "") for k in wanted)


def _build() -> Path:
    compiler = _compiler()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update(name.encode() + (HERE / name).read_bytes())
    flags = _flags()
    digest.update(repr((flags, SOURCES)).encode() + version.encode())
    digest.update(_cpu_signature().encode())
    root = Path(
        os.environ.get("LLMSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "llmserve" / "kernels"
    )
    target = root / digest.hexdigest()[:16] / "libllmserve_cpu.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        objects = [str(Path(scratch) / (name + ".o")) for name in SOURCES]
        compiles = [
            [compiler, *flags, *extra, "-c", str(HERE / name), "-o", obj]
            for (name, extra), obj in zip(SOURCES.items(), objects, strict=True)
        ]
        # One compiler per core: the sources are independent until the link.
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as compilers:
            list(compilers.map(_run, compiles))
        linked = Path(scratch) / target.name
        _run([compiler, "-shared", "-pthread", *objects, "-o", str(linked)])
        os.replace(linked, target)  # atomic: a concurrent build's file is equally good
    return target


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise NativeKernelUnavailable(f"build failed: {' '.join(command)}\n{result.stderr[-4000:]}")


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    common: list[Any] = [
        i32,
        i64,
        ptr,
        ptr,
        ptr,
        ptr,
        i64,
    ]  # dtype, head_dim, q, k, v, tables, stride
    # seqs, heads, kv heads, block size, block stride (elements between blocks), scale
    shape: list[Any] = [i64, i64, i64, i64, i64, f32]
    signatures: dict[str, list[Any]] = {
        # ..., seq_lens, out, shape, kv heads per work item, query row stride, window, softcap,
        # sinks (float32 [num_heads] or NULL)
        "llmserve_paged_decode": [*common, ptr, ptr, *shape, i64, i64, i64, f32, ptr],
        # ..., query_start_loc, seq_lens, out, shape, query row stride, window, softcap, sinks,
        # bf16_dots (0 / 1)
        "llmserve_paged_prefill": [*common, ptr, ptr, ptr, *shape, i64, i64, f32, ptr, i32],
        # dtype, x, residual (or NULL), weight, out, n, hidden, eps
        # dtype, norm kind, x, residual, weight, out, n, hidden, eps
        "llmserve_norm": [i32, i32, ptr, ptr, ptr, ptr, i64, i64, f32],
        # dtype, norm kind, x, row stride, n, heads, head_dim, weight, eps
        "llmserve_head_norm": [i32, i32, ptr, i64, i64, i64, i64, ptr, f32],
        # dtype, qkv, row stride, positions, cos, sin, n, heads, head stride, rotary_dim
        "llmserve_rotary": [i32, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64],
        # dtype, gate_up, out, n, intermediate size
        "llmserve_silu_mul": [i32, ptr, ptr, i64, i64],
        "llmserve_gelu_tanh_mul": [i32, ptr, ptr, i64, i64],
        # dtype, x (in place), count, cap
        "llmserve_softcap": [i32, ptr, i64, f32],
        # dtype, key, value, row stride, slots, n, row elems, key cache, value cache, block
        # size, block stride
        "llmserve_write_kv": [i32, ptr, ptr, i64, ptr, i64, i64, ptr, ptr, i64, i64],
        # source dtype, destination dtype, source, source row stride, rows, columns, destination
        "llmserve_convert_rows": [i32, i32, ptr, i64, i64, i64, ptr],
        # dtype, logits, n, vocab, argmax out, lse out, max out
        "llmserve_argmax_logsumexp": [i32, ptr, i64, i64, ptr, ptr, ptr],
        # dtype, logits, refused (bytes), n, vocab, argmax out, rank out
        "llmserve_masked_argmax": [i32, ptr, ptr, i64, i64, ptr, ptr],
        # dtype, x, n, in, weight, bias (or NULL), out, out features
        "llmserve_linear_rows": [i32, ptr, i64, i64, ptr, ptr, ptr, i64],
        # dtype, x, conv state, taps ([kernel size, dim]), bias (or NULL), slots, n, dim,
        # kernel size, silu, out
        "llmserve_conv1d_update": [i32, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i32, ptr],
        # dtype, q, k, v, their row strides, g, beta, state, slots, n, key heads, value heads,
        # k dim, v dim, scale, l2norm, out
        "llmserve_gated_delta_decode": [
            i32,
            *[ptr] * 3,
            *[i64] * 3,
            *[ptr] * 4,
            *[i64] * 5,
            f32,
            i32,
            ptr,
        ],
        # dtype, x, its row stride, conv state, taps, bias (or NULL), query_start_loc, slots,
        # has_initial_state (bytes, or NULL), num seqs, dim, kernel size, silu, out
        "llmserve_causal_conv1d": [i32, ptr, i64, *[ptr] * 6, i64, i64, i64, i32, ptr],
        # dtype, q, k, v, their row strides, g, beta, state, query_start_loc, slots,
        # has_initial_state (bytes, or NULL), num seqs, key heads, value heads, k dim, v dim,
        # scale, l2norm, out
        "llmserve_gated_delta_prefill": [
            i32,
            *[ptr] * 3,
            *[i64] * 3,
            *[ptr] * 6,
            *[i64] * 5,
            f32,
            i32,
            ptr,
        ],
        # threads
        "llmserve_set_num_threads": [i32],
        # -> instruction-set bits (ISA_NAMES)
        "llmserve_kernel_isa": [],
        # chunk counts, how many, loops, threads, spin -> loops with a chunk not run once
        "llmserve_pool_check": [ptr, i64, i64, i32, i64],
        # ggml type -> bytes per 32-weight block (0: no kernel)
        "llmserve_quant_block_bytes": [i32],
        # ggml type -> weights per block (32; 256 for the k-quants)
        "llmserve_quant_block_weights": [i32],
        # ggml type, weights, rows, cols, out
        "llmserve_quant_dequantize": [i32, ptr, i64, i64, ptr],
        # ggml type, x, n, in, weights, out features, out
        "llmserve_quant_linear": [i32, ptr, i64, i64, ptr, i64, ptr],
        "llmserve_quant_linear_fast": [i32, ptr, i64, i64, ptr, i64, ptr],
        # ggml type -> 1 when this build interleaves it for fast mode (quant_interleaved.cpp)
        "llmserve_quant_interleaves": [i32],
        # ggml type, weights, rows, in, dst: to the interleaved layout and back
        "llmserve_quant_interleave": [i32, ptr, i64, i64, ptr],
        "llmserve_quant_deinterleave": [i32, ptr, i64, i64, ptr],
        # on (1), off (0) or as it is (-1) -> 1 when the matrix-engine paths are on (amx.h)
        "llmserve_set_matrix_engine": [i32],
        # path (MATRIX_ENGINE_PATHS' index) -> calls it has taken in this process
        "llmserve_matrix_engine_calls": [i32],
        # -> the fewest activation rows a call needs to go to the matrix engine
        "llmserve_quant_matrix_engine_rows": [],
        # x, n, cols, out (40-byte activation blocks)
        "llmserve_quant_activations": [ptr, i64, i64, ptr],
        # dtype, dims, params, layer pointers, weight types, layer windows, embed, final
        # norm, lm head, input ids, positions, slots, block tables, table stride, seq lens,
        # n, logits, argmax out (or NULL), argmax logprob out
        "llmserve_decode_step": [i32, *[ptr] * 13, i64, i64, ptr, i64, ptr, ptr, ptr],
    }
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = i32
    lib.llmserve_pool_check.restype = i64
    lib.llmserve_matrix_engine_calls.restype = i64
    lib.llmserve_quant_matrix_engine_rows.restype = i64
    return lib
