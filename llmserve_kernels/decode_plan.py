"""The decode attention launch planned once per step: `DecodePlan` checks the step's block
tables and lengths, chooses the split-K partitioning and launch configuration, allocates the
scratch and keeps the compiled kernels; `llmserve_kernels.paged_attention` describes the kernels.

The sliding window and the attention sinks are chosen per `run` (layers differ), the soft-cap
per plan (per model). Their
compiled variants on a GPU are untested so far (only the interpreter has run them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from llmserve_kernels._checks import (
    KernelArgumentError,
    check_block_tables,
    check_device,
    check_dtype,
    check_inner_contiguous,
    check_ndim,
    check_out,
    check_paged_cache,
    check_seq_lens,
    check_sinks,
    check_window_softcap,
    next_power_of_2,
)
from llmserve_kernels.paged_decode_kernels import (
    DEFAULT_PARTITION_SIZE,
    LOG2E,
    MAX_TILE_TOKENS,
    MIN_DOT_ROWS,
    MIN_PARTITION_SIZE,
    PROGRAMS_PER_SM,
    REDUCE_CHUNK,
    _paged_attention_decode_kernel,
    _paged_attention_reduce_kernel,
    dot_precision,
)


@dataclass(frozen=True, slots=True)
class DecodeLaunchConfig:
    """How the decode kernel is launched: context tokens per inner-loop tile, warps per
    program, software-pipelining depth (None: Triton's default)."""

    tile_tokens: int = MAX_TILE_TOKENS
    num_warps: int = 4
    num_stages: int | None = None


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_partition_size(
    num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device
) -> int:
    """Split-K partition length: 512 tokens, halved (down to 128) while the grid of
    (sequence, KV head, partition) programs is too small to keep every SM busy, which is the
    case for small batches of long contexts."""
    size = DEFAULT_PARTITION_SIZE
    if device.type != "cuda":
        return size
    target = PROGRAMS_PER_SM * _sm_count(device.index or 0)
    while size > MIN_PARTITION_SIZE and (
        num_seqs * num_kv_heads * triton.cdiv(max_context, size) < target
    ):
        size //= 2
    return size


class DecodePlan:
    """One decode step's attention launch, checked and sized once for all layers.

    The model attends over the same sequences (block tables, lengths) in every layer; only
    the queries, the layer's caches and the output change. The plan checks the step's
    arguments, chooses the partitioning and launch configuration, and allocates the split-K
    scratch once; `run` checks only what a layer can change (shapes, dtype, device, strides)
    and launches. After the first launch it keeps Triton's compiled kernel and launches it
    directly, skipping the JIT's per-call argument binding and cache lookup, for as long as
    the arguments keep the specialization it was compiled for (16-byte aligned pointers, the
    same strides, window and sinks), one kept kernel per window, as layers alternate windows.

    softcap (None: off) is the model's, fixed for the plan; the sliding window and the sinks
    are per `run`.
    """

    def __init__(
        self,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        scale: float,
        max_seq_len: int | None = None,
        partition_size: int | None = None,
        launch: DecodeLaunchConfig | None = None,
        softcap: float | None = None,
    ) -> None:
        _, softcap_value = check_window_softcap(None, softcap)
        num_seqs = block_tables.shape[0] if block_tables.dim() == 2 else -1
        check_block_tables(block_tables, num_seqs)
        check_seq_lens(seq_lens, num_seqs)
        if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise KernelArgumentError(
                "query", f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        if partition_size is not None and (
            partition_size <= 0 or partition_size & (partition_size - 1)
        ):
            raise KernelArgumentError("partition_size", f"{partition_size} is not a power of 2")
        device = block_tables.device
        check_device(
            _paged_attention_decode_kernel,
            {"block_tables": block_tables, "seq_lens": seq_lens},
        )
        self.block_tables = block_tables
        self.seq_lens = seq_lens
        self.num_seqs, self.num_heads, self.num_kv_heads = num_seqs, num_heads, num_kv_heads
        self.head_dim, self.block_size, self.dtype, self.device = (
            head_dim,
            block_size,
            dtype,
            device,
        )
        self.qk_scale = scale * LOG2E
        # The kernels cap log2-domain scores: cap * log2(e) caps them as cap does scaled ones.
        self.softcap = softcap_value * LOG2E
        max_context = block_tables.shape[1] * block_size
        if max_seq_len is not None:
            max_context = min(max_context, max_seq_len)
        if partition_size is None:
            partition_size = choose_partition_size(num_seqs, num_kv_heads, max_context, device)
        self.num_partitions = max(triton.cdiv(max_context, partition_size), 1)
        self.split = self.num_partitions > 1
        self.launch = launch = launch or DecodeLaunchConfig()
        queries_per_kv = num_heads // num_kv_heads
        head_dim_pad = next_power_of_2(max(head_dim, 16))
        self.decode_constants = (
            queries_per_kv,  # QUERIES_PER_KV
            next_power_of_2(max(queries_per_kv, MIN_DOT_ROWS)),  # GROUP_ROWS
            head_dim,  # HEAD_DIM
            head_dim_pad,  # HEAD_DIM_PAD
            block_size,  # BLOCK_SIZE
            max(min(launch.tile_tokens, partition_size), 16),  # TILE_TOKENS
            partition_size,  # PARTITION_SIZE
            self.split,  # SPLIT
            dot_precision(dtype),  # DOT_PRECISION
            softcap_value > 0,  # USE_SOFTCAP
        )  # USE_WINDOW and USE_SINKS follow, per run
        self.reduce_constants = (
            head_dim,  # HEAD_DIM
            head_dim_pad,  # HEAD_DIM_PAD
            partition_size,  # PARTITION_SIZE
            next_power_of_2(self.num_partitions),  # PARTITIONS_PAD
            REDUCE_CHUNK,  # REDUCE_CHUNK
        )
        if self.split:
            stats_shape = (num_seqs, num_heads, self.num_partitions)
            # [num_seqs, num_heads, num_partitions] fp32, shared by every layer's launch
            self.max_logits = torch.empty(stats_shape, dtype=torch.float32, device=device)
            self.exp_sums = torch.empty(stats_shape, dtype=torch.float32, device=device)
            # [num_seqs, num_heads, num_partitions, head_dim] fp32
            self.partial_out = torch.empty(
                (*stats_shape, head_dim), dtype=torch.float32, device=device
            )
        self._query_shape = (num_seqs, num_heads, head_dim)
        self._cache_tail = (block_size, num_kv_heads, head_dim)
        # The compiled kernels by the specialization they were launched with (see the docstring).
        self._compiled: dict[tuple, tuple[object, object | None]] = {}

    def run(
        self,
        query: torch.Tensor,  # [num_seqs, num_heads, head_dim], rows may be strided
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
        *,
        sliding_window: int | None = None,  # None or 0: every key
        sinks: torch.Tensor | None = None,  # [num_heads] sink logits, or None
    ) -> torch.Tensor:  # out
        window, _ = check_window_softcap(sliding_window, None)
        check_sinks(sinks, self.num_heads, self.device)
        if query.shape != self._query_shape:
            check_ndim("query", query, 3, "[num_seqs, num_heads, head_dim]")
            raise KernelArgumentError(
                "query", f"shape {tuple(query.shape)}, expected {self._query_shape} (the plan's)"
            )
        if query.dtype != self.dtype:
            check_dtype("query", query, (self.dtype,))
        check_inner_contiguous("query", query)
        if key_cache.shape[1:] != self._cache_tail:
            check_ndim(
                "key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]"
            )
            raise KernelArgumentError(
                "key_cache",
                f"shape {tuple(key_cache.shape)}, expected [num_blocks, {self._cache_tail}]",
            )
        check_paged_cache(key_cache, value_cache, query, "query")
        out = check_out(out, query)
        if not (
            query.device == key_cache.device == value_cache.device == out.device == self.device
        ):
            check_device(
                _paged_attention_decode_kernel,
                {
                    "block_tables": self.block_tables,
                    "query": query,
                    "key_cache": key_cache,
                    "value_cache": value_cache,
                    "out": out,
                },
            )
        if self.num_seqs == 0:
            return out
        partial_out = self.partial_out if self.split else out
        max_logits = self.max_logits if self.split else out
        exp_sums = self.exp_sums if self.split else out
        strides = (
            *out.stride()[:2],
            *query.stride()[:2],
            *key_cache.stride()[:3],
            *value_cache.stride()[:3],
            self.block_tables.stride(0),
        )
        decode_args = (
            out,
            partial_out,
            max_logits,
            exp_sums,
            query,
            key_cache,
            value_cache,
            self.block_tables,
            self.seq_lens,
            self.seq_lens if sinks is None else sinks,  # any pointer when there are none
            self.qk_scale,
            self.num_heads,
            self.num_partitions,
            window,
            self.softcap,
            *strides,
        )
        # USE_WINDOW, USE_SINKS last
        decode_constants = (*self.decode_constants, window > 0, sinks is not None)
        reduce_args = (
            out,
            partial_out,
            max_logits,
            exp_sums,
            self.seq_lens,
            self.num_heads,
            self.num_partitions,
            *out.stride()[:2],
        )
        # Pointer alignment, strides and integer values (the window) decide Triton's
        # specialization of the compiled code.
        key = (
            *(t.data_ptr() % 16 == 0 for t in (query, key_cache, value_cache, out)),
            *strides,
            window,
            None if sinks is None else sinks.data_ptr() % 16 == 0,
        )
        compiled = self._compiled.get(key)
        if compiled is not None:
            decode, reduce = compiled
            decode[(self.num_seqs, self.num_kv_heads, self.num_partitions)](  # type: ignore[index]
                *decode_args, *decode_constants
            )
            if reduce is not None:
                reduce[(self.num_seqs, self.num_heads, 1)](  # type: ignore[index]
                    *reduce_args, *self.reduce_constants
                )
            return out
        self._launch_jit(decode_args, decode_constants, reduce_args, key)
        return out

    def _launch_jit(
        self,
        decode_args: tuple[object, ...],
        decode_constants: tuple[object, ...],
        reduce_args: tuple[object, ...],
        key: tuple,
    ) -> None:
        """Launch through Triton's JIT (compiling on first use); keep what it compiled."""
        launch = self.launch
        decode = _paged_attention_decode_kernel[
            (self.num_seqs, self.num_kv_heads, self.num_partitions)
        ](
            *decode_args,
            *decode_constants,
            num_warps=launch.num_warps,
            **({"num_stages": launch.num_stages} if launch.num_stages else {}),
        )
        reduce = None
        if self.split:
            reduce = _paged_attention_reduce_kernel[(self.num_seqs, self.num_heads)](
                *reduce_args, *self.reduce_constants, num_warps=4
            )
        # The interpreter returns no compiled kernel: it keeps going through the JIT.
        if hasattr(decode, "run") and (reduce is None or hasattr(reduce, "run")):
            self._compiled[key] = (decode, reduce)
