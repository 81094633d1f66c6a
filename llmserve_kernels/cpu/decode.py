"""A whole decode step in one native call (decode.cpp).

`DecodeStep` holds the raw pointers of a dense model's weights (`DecodeLayer`; its
model-wide features in `DecodeShape`), laid out once, and of its KV caches, rebound when the
caches change. The caches are in the model dtype, or bfloat16 in a float32 model (the step
then rounds its q, k and v rows to bfloat16 for the cache write and the attention). In a
float32 model the projections, the embedding and the LM head may be GGUF blocks
(`llmserve_kernels.cpu.quant.QuantWeight`), multiplied in `DecodeShape.quant_mode`; `run` computes
the logits of n decode tokens (one per sequence, each attending to its paged context) with a
single ctypes call, and each row's argmax with its logprob (`ArgmaxLogprobs`) while those
logits are still in cache. The tensors it points into must outlive it: it keeps references to
them.

Its projection kernel on its own is `llmserve_kernels.cpu.linear_rows.linear_rows`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmserve_kernels._checks import KernelArgumentError, check_block_layout
from llmserve_kernels.cpu.attention import DTYPE_CODES, unsupported_shape_reason
from llmserve_kernels.cpu.build import library
from llmserve_kernels.cpu.ops import NORM_KINDS
from llmserve_kernels.cpu.quant import MAX_IN_FEATURES, MODES, QuantMode, QuantWeight

Weight = torch.Tensor | QuantWeight

# Fields per layer in the pointer table, in decode.cpp's LayerField order.
_LAYER_FIELDS = 18
# decode.cpp's codes of the model-wide features (ops.cpp's NormKind: NORM_KINDS; QkNorm,
# Activation).
_QK_NORMS: dict[str | None, int] = {None: 0, "head": 1, "full": 2}
_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
# Indices of the caches' block size, block stride and dtype code in the dims array
# (decode.cpp's Dim order).
_BLOCK_SIZE_DIM = 7
_BLOCK_STRIDE_DIM = 8
_CACHE_DTYPE_DIM = 14


@dataclass(frozen=True, slots=True)
class ArgmaxLogprobs:
    """Per logits row: the first argmax and its logprob (max - log-sum-exp, float32), as
    `llmserve_kernels.cpu.argmax_logsumexp` gives them; all a greedy sampler needs of the logits."""

    tokens: list[int]
    logprobs: list[float]


@dataclass(frozen=True, slots=True)
class DecodeLayer:
    """One layer's weights in their plain [out, in] layout (not prepacked); None where the
    layer has no such weight, and no cos/sin in a NoPE layer."""

    input_norm: torch.Tensor | None  # [hidden]
    qkv: Weight  # [q + 2 * kv, hidden]
    qkv_bias: torch.Tensor | None  # [q + 2 * kv]
    o: Weight  # [hidden, q]
    post_norm: torch.Tensor | None  # [hidden]
    gate_up: Weight  # [2 * intermediate, hidden]
    down: Weight  # [hidden, intermediate]
    o_bias: torch.Tensor | None = None  # [hidden]
    gate_up_bias: torch.Tensor | None = None  # [2 * intermediate]
    down_bias: torch.Tensor | None = None  # [hidden]
    q_norm: torch.Tensor | None = None  # [head_dim] (per head) or [q] (full width)
    k_norm: torch.Tensor | None = None  # [head_dim] (per head) or [kv] (full width)
    attn_out_norm: torch.Tensor | None = None  # [hidden]
    mlp_out_norm: torch.Tensor | None = None  # [hidden]
    cos: torch.Tensor | None = None  # [max_positions, rotary_dim]
    sin: torch.Tensor | None = None  # [max_positions, rotary_dim]
    sliding_window: int | None = None  # keys with query_pos - key_pos < window; None = all

    def pointers(self) -> list[int | None]:
        """Its tensors' addresses in decode.cpp's LayerField order, before the caches."""
        return [None if t is None else t.data_ptr() for t in self._all()]

    def projections(self) -> tuple[Weight, ...]:
        """In decode.cpp's WeightType order."""
        return self.qkv, self.o, self.gate_up, self.down

    def tensors(self) -> list[torch.Tensor]:
        """The dense ones."""
        return [t for t in self._all() if isinstance(t, torch.Tensor)]

    def _all(self) -> tuple[Weight | None, ...]:
        return (
            self.input_norm,
            self.qkv,
            self.qkv_bias,
            self.q_norm,
            self.k_norm,
            self.o,
            self.o_bias,
            self.attn_out_norm,
            self.post_norm,
            self.gate_up,
            self.gate_up_bias,
            self.down,
            self.down_bias,
            self.mlp_out_norm,
            self.cos,
            self.sin,
        )


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """A model's sizes and its model-wide features (the names are arch.py's)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rotary_dim: int | None = None  # leading dims of each head that rotate; None: all
    norm: str = "rms"  # how every norm applies its weight: rms | rms_f32 | gemma
    qk_norm: str | None = None  # None | head (one norm per head) | full (over q, over k)
    activation: str = "silu"  # silu | gelu_tanh
    attention_scale: float | None = None  # None: head_dim ** -0.5
    embed_scale: float | None = None  # embeddings times this (already in the model dtype)
    residual_scale: float | None = None  # each block's output times this
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    logits_divisor: float | None = None  # logits / this
    quant_mode: QuantMode = (
        "exact"  # how weights in GGUF blocks multiply (llmserve_kernels.cpu.quant)
    )

    def unsupported_reason(self) -> str | None:
        widths = {
            "hidden size": self.hidden_size,
            "intermediate size": self.intermediate_size,
            "query width": self.num_heads * self.head_dim,
            "head size": self.head_dim,
        }
        odd = [f"{name} {value}" for name, value in widths.items() if value % 8]
        if odd:
            return f"{', '.join(odd)} not a multiple of 8"
        rotary = self.head_dim if self.rotary_dim is None else self.rotary_dim
        if rotary % 2 or not 0 < rotary <= self.head_dim:
            return f"rotary dims {rotary}: even, at most head_dim {self.head_dim}"
        for name, value, codes in (
            ("norm", self.norm, NORM_KINDS),
            ("qk_norm", self.qk_norm, _QK_NORMS),
            ("activation", self.activation, _ACTIVATIONS),
            ("quant_mode", self.quant_mode, {m: i for i, m in enumerate(MODES)}),
        ):
            if value not in codes:
                return f"{name} {value!r}: one of {', '.join(map(repr, codes))}"
        # Its attention is the paged decode kernel's.
        return unsupported_shape_reason(self.num_heads, self.num_kv_heads, self.head_dim)

    def blocks_unsupported_reason(self) -> str | None:
        """Why the step cannot take GGUF blocks at this shape (decode.cpp refuses widths
        that are not multiples of 32 once a weight is in blocks), or None."""
        widths = {
            "hidden size": self.hidden_size,
            "intermediate size": self.intermediate_size,
            "query width": self.num_heads * self.head_dim,
        }
        odd = [f"{name} {value}" for name, value in widths.items() if value % 32]
        return f"{', '.join(odd)} not a multiple of 32" if odd else None

    def dims(self) -> list[int]:
        """decode.cpp's Dim order; the caches' block size, stride and dtype (set by
        bind_caches) are 0."""
        return [
            self.num_layers,
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.vocab_size,
            0,
            0,
            self.head_dim if self.rotary_dim is None else self.rotary_dim,
            NORM_KINDS[self.norm],
            _QK_NORMS[self.qk_norm],
            _ACTIVATIONS[self.activation],
            MODES.index(self.quant_mode),
            0,
        ]

    def params(self) -> list[float]:
        """decode.cpp's Param order; 0 for an absent multiplier, divisor or cap."""
        scale = self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale
        optional = (
            self.embed_scale,
            self.residual_scale,
            self.attn_softcap,
            self.final_softcap,
            self.logits_divisor,
        )
        return [self.rms_norm_eps, scale, *(0.0 if v is None else v for v in optional)]


class DecodeStep:
    """The native decode step of one model (see the module docstring)."""

    def __init__(
        self,
        shape: DecodeShape,
        layers: Sequence[DecodeLayer],
        embed: Weight,  # [vocab, hidden]
        final_norm: torch.Tensor,  # [hidden]
        lm_head: Weight,  # [vocab, hidden]
    ) -> None:
        reason = shape.unsupported_reason()
        if reason is not None:
            raise KernelArgumentError("shape", reason)
        if len(layers) != shape.num_layers:
            raise KernelArgumentError("layers", f"{len(layers)}, expected {shape.num_layers}")
        weights: list[Weight] = [embed, final_norm, lm_head]
        for layer in layers:
            weights += layer.tensors() + [p for p in layer.projections() if not _dense(p)]
        tensors = [t for t in weights if isinstance(t, torch.Tensor)]
        blocks = [t for t in weights if isinstance(t, QuantWeight)]
        dtype = final_norm.dtype
        if any(t.dtype != dtype or not t.is_contiguous() for t in tensors):
            raise KernelArgumentError("weights", "all must be contiguous, of one dtype")
        if dtype not in DTYPE_CODES or final_norm.device.type != "cpu":
            raise KernelArgumentError("weights", f"CPU float32 or bfloat16, not {dtype}")
        if blocks:
            _check_blocks(shape, dtype, blocks)
        self.shape = shape
        self.dtype = dtype
        self._tensors = weights  # kept alive: the pointer table points into them
        self._layers = list(layers)
        self._globals = [t.data_ptr() for t in (embed, final_norm, lm_head)]
        types = [_ggml_type(w) for layer in layers for w in layer.projections()]
        types += [_ggml_type(embed), _ggml_type(lm_head)]
        self._types = (ctypes.c_int64 * len(types))(*types)
        dims, params = shape.dims(), shape.params()
        self._dims = (ctypes.c_int64 * len(dims))(*dims)
        self._params = (ctypes.c_float * len(params))(*params)
        windows = [layer.sliding_window or 0 for layer in layers]
        self._windows = (ctypes.c_int64 * len(windows))(*windows)
        # Each layer's KV group (`bind_groups`): which of a step's slots and tables it uses.
        self._layer_groups = (ctypes.c_int64 * len(layers))()
        self._num_groups = 1
        self._table: ctypes.Array[ctypes.c_void_p] | None = None
        # Each row's argmax and its logprob, written by the step; grown to the largest batch.
        self._argmax: ctypes.Array[ctypes.c_int64] = (ctypes.c_int64 * 0)()
        self._argmax_logprob: ctypes.Array[ctypes.c_float] = (ctypes.c_float * 0)()
        self._bound_list: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._bound_first = 0

    def bind_caches(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point the layers at these K/V caches (each [blocks, block_size, kv_heads, dim]),
        whose blocks are dense and lie one stride apart in every layer's caches
        (`check_block_layout`; views into one block-major pool of all layers are)."""
        # The runner passes the same list every step until the caches are reallocated: that
        # list (held, so its identity cannot be reused) and its first cache identify the
        # binding without touching every tensor.
        first = kv_caches[0][0].data_ptr() if kv_caches else 0
        if kv_caches is self._bound_list and first == self._bound_first:
            return
        if len(kv_caches) != len(self._layers):
            raise KernelArgumentError(
                "kv_caches", f"{len(kv_caches)} layers, expected {len(self._layers)}"
            )
        block_stride = _block_stride(kv_caches)
        cache_dtype = _cache_dtype(kv_caches, self.dtype)
        pointers: list[int | None] = []
        for layer, (key_cache, value_cache) in zip(self._layers, kv_caches, strict=True):
            pointers += [*layer.pointers(), key_cache.data_ptr(), value_cache.data_ptr()]
        assert len(pointers) == _LAYER_FIELDS * len(self._layers)
        self._dims[_BLOCK_SIZE_DIM] = kv_caches[0][0].shape[1]
        self._dims[_BLOCK_STRIDE_DIM] = block_stride
        self._dims[_CACHE_DTYPE_DIM] = DTYPE_CODES[cache_dtype]
        self._table = (ctypes.c_void_p * len(pointers))(*pointers)
        self._bound_list, self._bound_first = kv_caches, first

    def bind_groups(self, layer_groups: Sequence[int]) -> None:
        """Each layer's KV group (`llmserve.kv_layout`): layer i writes and reads through
        group layer_groups[i]'s slots and block tables. All 0 until bound."""
        if len(layer_groups) != len(self._layers) or min(layer_groups) < 0:
            raise KernelArgumentError(
                "layer_groups", f"{len(self._layers)} group indices >= 0, got {layer_groups}"
            )
        self._layer_groups = (ctypes.c_int64 * len(layer_groups))(*layer_groups)
        self._num_groups = max(layer_groups) + 1

    def run(
        self,
        input_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64, each < max_positions
        slots: torch.Tensor,  # [groups, n] (or [n] for one group) int64 flat cache slots
        block_tables: torch.Tensor,  # [groups, n, max_blocks] (or [n, max_blocks]) int32
        seq_lens: torch.Tensor,  # [n] int32, including the new token
    ) -> tuple[torch.Tensor, ArgmaxLogprobs]:  # [n, vocab] logits in the model dtype
        """Unchecked beyond the table's binding and the groups' count: the model runner built
        every index. Each group's tables have contiguous rows."""
        assert self._table is not None, "bind_caches() first"
        num_groups = block_tables.shape[0] if block_tables.dim() == 3 else 1
        if num_groups != self._num_groups or slots.numel() != num_groups * input_ids.shape[0]:
            raise KernelArgumentError(
                "block_tables", f"tables and slots of {self._num_groups} KV groups expected"
            )
        n = input_ids.shape[0]
        if len(self._argmax) < n:
            self._argmax = (ctypes.c_int64 * n)()
            self._argmax_logprob = (ctypes.c_float * n)()
        logits = torch.empty(n, self.shape.vocab_size, dtype=self.dtype)
        embed, final_norm, lm_head = self._globals
        status = library().llmserve_decode_step(
            DTYPE_CODES[self.dtype],
            self._dims,
            self._params,
            self._table,
            self._types,
            self._windows,
            self._layer_groups,
            embed,
            final_norm,
            lm_head,
            input_ids.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(-2),
            block_tables.stride(0) if num_groups > 1 else 0,
            seq_lens.data_ptr(),
            n,
            logits.data_ptr(),
            self._argmax,
            self._argmax_logprob,
        )
        if status != 0:
            raise RuntimeError(f"llmserve_decode_step failed with status {status}")
        return logits, ArgmaxLogprobs(self._argmax[:n], self._argmax_logprob[:n])


def _block_stride(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """The one block stride of every layer's caches (the step takes one)."""
    strides = []
    for i, (key_cache, value_cache) in enumerate(kv_caches):
        try:
            strides.append(check_block_layout(key_cache, value_cache))
        except KernelArgumentError as exc:
            raise KernelArgumentError("kv_caches", f"layer {i}: {exc}") from exc
    if len(set(strides)) > 1:
        raise KernelArgumentError("kv_caches", f"the layers' block strides differ: {strides}")
    return strides[0]


def _cache_dtype(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], model_dtype: torch.dtype
) -> torch.dtype:
    """The one dtype of every layer's caches: the model's, or bfloat16 in a float32 model."""
    dtypes = {cache.dtype for pair in kv_caches for cache in pair}
    allowed = {model_dtype, torch.bfloat16} if model_dtype == torch.float32 else {model_dtype}
    if len(dtypes) != 1 or not dtypes <= allowed:
        raise KernelArgumentError(
            "kv_caches",
            f"one dtype, the model's ({model_dtype}) or bfloat16 in a float32 model; got "
            f"{sorted(map(str, dtypes))}",
        )
    return dtypes.pop()


def _dense(weight: Weight) -> bool:
    return isinstance(weight, torch.Tensor)


def _ggml_type(weight: Weight) -> int:
    """decode.cpp's weight type: the type code of blocks (`QuantWeight.code`), 0 for a dense
    tensor."""
    return 0 if isinstance(weight, torch.Tensor) else weight.code


def _check_blocks(shape: DecodeShape, dtype: torch.dtype, blocks: list[QuantWeight]) -> None:
    if dtype != torch.float32:
        raise KernelArgumentError("weights", f"GGUF blocks in a float32 model only, not {dtype}")
    if reason := shape.blocks_unsupported_reason():
        raise KernelArgumentError("weights", f"GGUF blocks need widths of 32s: {reason}")
    for weight in blocks:
        weight.check()
    if shape.quant_mode == "exact" and any(weight.interleaved for weight in blocks):
        raise KernelArgumentError("weights", "interleaved blocks are for fast mode only")
    widest = max((weight.in_features for weight in blocks), default=0)
    if shape.quant_mode == "exact" and widest > MAX_IN_FEATURES:
        raise KernelArgumentError(
            "weights", f"rows of {widest} weights, over exact mode's {MAX_IN_FEATURES}"
        )
