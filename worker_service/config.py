"""Worker configuration: one frozen dataclass, built once by the service entry point."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from llmserve.batch_limits import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    GivenBatchLimits,
)
from llmserve.config_flags import flag
from llmserve.errors import FieldError
from llmserve_kernels.cpu.quant import MODES as QUANT_MODES
from llmserve_kernels.cpu.quant import QuantMode

GiB = 1 << 30

DtypeName = Literal["auto", "float32", "bfloat16", "float16"]
DeviceName = Literal["auto", "cpu", "cuda"]
AttentionBackendName = Literal["auto", "cpu", "triton", "torch"]
LinearImplName = Literal["auto", "torch", "onednn", "native", "gguf"]
QuantizationName = Literal["none", "q8_0", "q4_1"]
KvCacheDtypeName = Literal["auto", "model", "bfloat16"]
KV_CACHE_DTYPES: tuple[KvCacheDtypeName, ...] = ("auto", "model", "bfloat16")
QUANTIZATIONS: tuple[QuantizationName, ...] = ("none", "q8_0", "q4_1")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class WorkerConfigError(FieldError):
    """A worker option is invalid: the one FieldError shape (`field`, `detail`)."""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a worker needs to load its model and size its KV cache.

    `dtype="auto"` is float32 on CPU and bfloat16 on CUDA. On CPU the device KV cache is
    `kv_cache_memory_bytes`; on CUDA it is what a profile run leaves of
    `gpu_memory_utilization` of the device. The host swap space is `swap_space_bytes`.
    """

    model: str = flag("smollm2", "alias, local dir, .gguf file or hub id")
    dtype: DtypeName = flag("auto", "float32 on CPU and bfloat16 on CUDA when auto")
    device: DeviceName = flag("auto", "cuda where one is available when auto")
    attention_backend: AttentionBackendName = flag(
        "auto", "triton on CUDA, cpu (the C++ kernels) on a CPU, torch: the reference"
    )
    # Matmuls: `torch` (F.linear), `onednn` (weights prepacked once at load; CPU float32 / bfloat16
    # where oneDNN supports it), or `native` (llmserve_kernels/cpu/decode.cpp's projections, which
    # widen bfloat16 in registers: on CPUs without AVX-512 they run bfloat16 matmuls several times
    # faster than F.linear). `gguf` keeps a GGUF file's blocks as they are and multiplies with them
    # (Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q5_K / Q6_K, CPU float32: models/gguf_weights.py). `auto`,
    # with the native `cpu` attention backend, takes gguf for a GGUF file with such blocks, else
    # onednn where it can run, else native; with other backends torch, so the `torch` backend stays
    # the plain-torch reference.
    linear_impl: LinearImplName = flag(
        "auto",
        "matmuls: onednn prepacks the weights (CPU); native = llmserve_kernels/cpu projections; "
        "gguf = on a GGUF file's blocks as they are (CPU float32); auto = with the cpu backend gguf "
        "for a quantized GGUF file, else onednn where oneDNN runs the dtype, else native",
    )
    # `q8_0` / `q4_1` quantize a float checkpoint's projections, embedding and LM head at load
    # into those GGUF blocks (per row, 32 weights per scale) and multiply with them as `gguf`
    # does (models/quantize_at_load.py): CPU float32, not a GGUF file, linear_impl auto or
    # gguf. `none` keeps the weights dense (a GGUF file dequantized, unless `gguf`).
    quantization: QuantizationName = flag(
        "none",
        "quantize a float checkpoint's weights at load into GGUF Q8_0 or Q4_1 blocks (per row, "
        "a scale per 32 weights) and multiply on them as --linear-impl gguf does (CPU float32, "
        "not a GGUF file); none = dense weights",
    )
    # How `gguf` and `quantization` multiply (llmserve_kernels/cpu/quant.py): `exact` dequantizes
    # each block to float32 (the model equals HF's dequantized one up to summation order); `fast`
    # rounds the activations to 8 bits per block of 32 and takes integer dot products, as
    # llama.cpp does, and (with the `cpu` backend, on CPUs with AVX512-BF16) computes the
    # prompts' attention scores and value sums as bfloat16 dot products. Fast is the default:
    # its quality on each file type is measured in bench/RESULTS.md ("Defaults", "Prompts'
    # integer dots and bfloat16 attention"); exact is for work that must equal HF's model.
    quant_mode: QuantMode = flag(
        "fast",
        "on GGUF blocks (a quantized GGUF file, or --quantization): fast = activations "
        "rounded to 8 bits, integer dot products, as llama.cpp, and bfloat16 dot products in "
        "the prompts' attention where the CPU has AVX512-BF16; exact = blocks dequantized to "
        "float32 (HF's model up to summation order)",
    )
    # The K/V cache's dtype. `auto`: bfloat16 where a float32 model runs in fast mode on GGUF
    # blocks with the `cpu` backend (a decode step's attention reads every cached byte of
    # its sequences, half as many as float32; llama.cpp keeps float16 by default; quality in
    # bench/RESULTS.md), else the model dtype (`model`). bfloat16 in a float32 model needs
    # the `cpu` backend: the step's q, k and v rows are rounded to it and the attention runs
    # on bfloat16 rows, its output widened back.
    kv_cache_dtype: KvCacheDtypeName = flag(
        "auto",
        "K/V cache dtype: model = the model dtype; bfloat16 (a float32 model: cpu backend "
        "only); auto = bfloat16 in fast mode on GGUF blocks with the cpu backend, else model",
    )
    # Pure decode steps of up to this many sequences run every layer in one native call
    # (llmserve_kernels/cpu/decode.cpp) with the `cpu` attention backend; 0 turns it off; None picks
    # the model's measured default (models/native.py: default_native_max_batch). Larger
    # steps and prefills keep the per-layer path and its (prepacked) matmuls.
    native_decode_max_batch: int | None = flag(
        None,
        "decode steps of up to this many sequences run as one native call (cpu backend); 0 = "
        "per-layer path only; unset: 8, or 4 for models with a large LM head "
        "(worker_service/models/native.py)",
    )
    block_size: int = flag(16, "tokens per KV block (a power of two)")
    # Lay the layers out in KV groups by kind (llmserve/kv_layout.py), so windowed layers keep
    # only their windows' blocks; False keeps every layer's K/V for every token in one group
    # (the layout before groups: for comparisons, or a scheduler that predates groups).
    hybrid_kv_cache: bool = flag(
        True,
        "group layers by attention kind so sliding-window layers keep only their windows' "
        "K/V (off: every layer keeps every token's)",
    )
    # Caps the model's own max_position_embeddings (None = the model's limit).
    max_model_len: int | None = flag(
        None, "the longest prompt + output served (unset: the model's own limit)"
    )
    kv_cache_memory_bytes: int = 2 * GiB
    swap_space_bytes: int = 4 * GiB
    gpu_memory_utilization: float = flag(
        0.9, "CUDA: the fraction of the device's memory the worker may use, KV cache included"
    )
    # CUDA: decode steps replay CUDA graphs captured per batch size (worker_service/
    # cuda_graphs.py) up to the batch limits' max_num_seqs; True runs every step eagerly.
    enforce_eager: bool = flag(
        False, "CUDA: run decode steps eagerly instead of replaying captured CUDA graphs"
    )
    # The batch limits (llmserve/batch_limits.py), which size the CUDA profile run and the
    # graphs: None follows what the scheduler sends at InitializeCache (the defaults until
    # then); set, the scheduler must send the same value or is refused.
    max_num_batched_tokens: int | None = flag(
        None,
        f"unset: the scheduler's, sent at InitializeCache ({DEFAULT_MAX_NUM_BATCHED_TOKENS} "
        "before it, or where none is sent); set, a scheduler that sends another value is "
        "refused",
    )
    max_num_seqs: int | None = flag(
        None,
        f"unset: the scheduler's, sent at InitializeCache ({DEFAULT_MAX_NUM_SEQS} before it, "
        "or where none is sent); set, a scheduler that sends another value is refused",
    )
    # torch intra-op threads on CPU (None = all cores of this machine).
    num_threads: int | None = flag(
        None, "CPU threads of torch and of the C++ kernels (unset: every core)"
    )
    # Seed of the stream used by requests without their own seed.
    seed: int = flag(0, "seed of the sampling stream of requests without their own seed")
    # How long a step waits, after its forward pass, for the token masks the scheduler sends
    # after it (structured output) before it fails (worker_service/late_masks.py).
    mask_wait_timeout_s: float = flag(
        30.0,
        "fail a step whose deferred token masks (structured output) do not come from the "
        "scheduler within this many seconds after its forward pass",
    )

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise WorkerConfigError("block_size", f"must be a power of two, got {self.block_size}")
        if self.dtype not in ("auto", *_DTYPES):
            raise WorkerConfigError("dtype", f"must be auto|{'|'.join(_DTYPES)}, got {self.dtype}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise WorkerConfigError(
                "kv_cache_dtype",
                f"must be {'|'.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype}",
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise WorkerConfigError("device", f"must be auto|cpu|cuda, got {self.device}")
        if self.attention_backend not in ("auto", "cpu", "triton", "torch"):
            raise WorkerConfigError(
                "attention_backend", f"must be auto|cpu|triton|torch, got {self.attention_backend}"
            )
        if self.linear_impl not in ("auto", "torch", "onednn", "native", "gguf"):
            raise WorkerConfigError(
                "linear_impl", f"must be auto|torch|onednn|native|gguf, got {self.linear_impl}"
            )
        self._check_quantization()
        if self.quant_mode not in QUANT_MODES:
            raise WorkerConfigError(
                "quant_mode", f"must be {'|'.join(QUANT_MODES)}, got {self.quant_mode}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise WorkerConfigError(
                "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.native_decode_max_batch is not None and self.native_decode_max_batch < 0:
            raise WorkerConfigError("native_decode_max_batch", "must be non-negative")
        if self.kv_cache_memory_bytes <= 0:
            raise WorkerConfigError("kv_cache_memory_bytes", "must be positive")
        if self.swap_space_bytes < 0:
            raise WorkerConfigError("swap_space_bytes", "must be non-negative")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise WorkerConfigError("max_model_len", "must be positive")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise WorkerConfigError(name, f"must be at least 1, got {value}")
        if self.num_threads is not None and self.num_threads < 1:
            raise WorkerConfigError("num_threads", "must be positive")
        if not self.mask_wait_timeout_s > 0:
            raise WorkerConfigError("mask_wait_timeout_s", "must be positive")

    def _check_quantization(self) -> None:
        """What can be told before the model and device are known (the rest:
        linear_impl.choose_linear_impl)."""
        q = self.quantization
        if q not in QUANTIZATIONS:
            raise WorkerConfigError("quantization", f"must be {'|'.join(QUANTIZATIONS)}, got {q}")
        if q == "none":
            return
        if self.linear_impl not in ("auto", "gguf"):
            raise WorkerConfigError(
                "quantization",
                f"{q} multiplies on its blocks (the gguf kernels): linear_impl must be auto or "
                f"gguf, not {self.linear_impl}",
            )
        if self.device == "cuda" or self.dtype in ("bfloat16", "float16"):
            raise WorkerConfigError(
                "quantization",
                f"{q}'s kernels run on the CPU in float32, not device {self.device} dtype "
                f"{self.dtype}",
            )

    @property
    def given_batch_limits(self) -> GivenBatchLimits:
        """The batch limits this worker's flags set (None: not set)."""
        return GivenBatchLimits(self.max_num_seqs, self.max_num_batched_tokens)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise WorkerConfigError("device", "cuda requested but no CUDA device is available")
        return torch.device(self.device)

    def resolve_kv_cache_dtype(
        self, model_dtype: torch.dtype, attention_backend: str, linear_impl: str
    ) -> torch.dtype:
        """The K/V cache's dtype, once the backend and the matmuls are chosen."""
        wanted = self.kv_cache_dtype
        if wanted == "auto":
            fast_blocks = linear_impl == "gguf" and self.quant_mode == "fast"
            wanted = "bfloat16" if fast_blocks and attention_backend == "cpu" else "model"
        if wanted == "model" or model_dtype == torch.bfloat16:
            return model_dtype
        if model_dtype != torch.float32 or attention_backend != "cpu":
            raise WorkerConfigError(
                "kv_cache_dtype",
                f"bfloat16 beside a {str(model_dtype).removeprefix('torch.')} model needs a "
                f"float32 model on the cpu attention backend, not {attention_backend}",
            )
        return torch.bfloat16

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]
