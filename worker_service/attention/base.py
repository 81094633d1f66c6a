"""The attention backend interface: how a model layer reads and writes the paged KV cache.

A step's tokens are laid out prefill-first: the `num_prefills` sequences that compute more
than one token (prompt chunks, attending to their cached prefix and causally to each other),
then the `num_decodes` sequences that compute exactly one token. A backend gets, per layer,
this step's new queries/keys/values for all tokens, writes the keys/values into their cache
slots, and returns the attention output for every query token. A layer that reads another
layer's K/V (Gemma 4's KV sharing) passes that layer's keys/values of the step, already in
the cache it is given, with `write_kv=False`: nothing is written.

KV cache layout (per layer, see `cache_engine.py`): key and value caches are each
`[num_blocks, block_size, num_kv_heads, head_dim]`; token `i` of a sequence lives in block
`block_table[i // block_size]` at offset `i % block_size`, i.e. flat slot
`block_id * block_size + offset`. A block's rows are back to back, but blocks may lie
further apart than a block (a layer's caches are then views into one block-major pool of all
layers), so slot s is row s of a flat view only of a contiguous cache.

Backends are registered by name (`register_backend`) so that `--attention-backend` can pick
one without this package importing the optional ones eagerly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """What a backend is asked to run: one model's attention shape on one device."""

    device: torch.device
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # The smallest sliding window of any layer (None: every layer attends to all keys), and
    # the attention-score soft-cap (None: none): what not every backend implements.
    sliding_window: int | None = None
    softcap: float | None = None
    # Whether the layers add a learned per-head logit to every softmax's denominator.
    sinks: bool = False


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step inputs shared by all layers. Built once per step by the model runner.

    All tensors live on the model's device. Block tables are padded with block 0 (any valid
    id; backends mask by length and never read past `seq_lens`).
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    # Flat cache slot of every token of the step; negative = do not write (padding).
    slot_mapping: torch.Tensor  # [num_tokens] int64
    # Prefill part.
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, cumulative query lens
    prefill_query_lens: torch.Tensor  # [num_prefills] int32
    prefill_context_lens: torch.Tensor  # [num_prefills] int32, tokens cached before this step
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32, context + query
    prefill_block_tables: torch.Tensor  # [num_prefills, max_prefill_blocks] int32
    max_prefill_query_len: int
    max_prefill_seq_len: int
    # True when no prefill attends to a cached prefix (all context lens are 0).
    prefill_no_context: bool
    # Decode part.
    decode_seq_lens: torch.Tensor  # [num_decodes] int32, including the new token
    decode_block_tables: torch.Tensor  # [num_decodes, max_decode_blocks] int32
    max_decode_seq_len: int
    block_size: int

    @classmethod
    def for_decodes(
        cls,
        slot_mapping: torch.Tensor,  # [num_decodes] int64, negative = do not write
        seq_lens: torch.Tensor,  # [num_decodes] int32, including the new token
        block_tables: torch.Tensor,  # [num_decodes, max_decode_blocks] int32
        max_seq_len: int,
        block_size: int,
    ) -> AttentionMetadata:
        """A step of decodes only: one query token per row, no prefill. `max_seq_len` is
        given, not read from `seq_lens`, so that building the metadata never waits on the
        device."""
        empty = seq_lens.new_zeros(0)  # [0] int32
        return cls(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decodes=seq_lens.shape[0],
            slot_mapping=slot_mapping,
            prefill_query_start_loc=seq_lens.new_zeros(1),  # [1] int32
            prefill_query_lens=empty,
            prefill_context_lens=empty,
            prefill_seq_lens=empty,
            prefill_block_tables=block_tables[:0],  # [0, max_decode_blocks] int32
            max_prefill_query_len=0,
            max_prefill_seq_len=0,
            prefill_no_context=True,
            decode_seq_lens=seq_lens,
            decode_block_tables=block_tables,
            max_decode_seq_len=max_seq_len,
            block_size=block_size,
        )

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decodes


class AttentionBackend(ABC):
    """Computes paged attention for one model on one device.

    Lifecycle per step: `begin_step(metadata)` once (precompute what all layers share, e.g.
    masks or gather indices), then `forward` once per layer. Implementations must be
    vectorized over the batch: no Python loop over sequences in `forward`.
    """

    name: str = "abstract"
    # Whether `forward` takes attention sinks; a backend that does not is refused for models
    # that have them (`unsupported_reason`).
    supports_sinks: bool = False

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        softcap: float | None = None,
    ) -> None:
        assert num_heads % num_kv_heads == 0, "GQA needs num_heads divisible by num_kv_heads"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Scores (after `scale`) become softcap * tanh(score / softcap) before the softmax.
        self.softcap = softcap

    def begin_step(self, metadata: AttentionMetadata) -> None:  # noqa: B027 (optional hook)
        """Called once per step before the first layer."""

    def take_bf16_prompt_dots(self) -> bool:
        """Fast mode asks: prompt tokens' scores and value sums as bfloat16 dot products
        (operands rounded to bfloat16, sums in float32). Returns whether this backend now
        does, on this machine; by default it does not."""
        return False

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads], this layer's sink logits
        write_kv: bool = True,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write key/value into their slots (unless `write_kv` is False: they are there
        already, written by the layer whose K/V this one reads), then attend every query to
        its sequence: to every earlier key, or with `sliding_window` to the keys less than
        that many positions behind it (the query's own included). With `sinks`, head h's
        softmax denominator also holds exp(sinks[h]): a logit no value belongs to."""

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        """Why this backend cannot run `spec` in this environment, or None when it can.
        Subclasses add their own reasons after this one's (the model features they lack)."""
        if spec.sinks and not cls.supports_sinks:
            return "attention sinks are not implemented by this backend"
        return None


class PagedKernelBackend(AttentionBackend):
    """A backend made of three kernels with the signatures of the `llmserve_kernels` package: write
    the step's K/V into their slots, then prefill tokens (prompt chunks, causal over their
    cached prefix) and decode tokens, each kernel writing its rows of one output tensor.
    Both attention kernels read K/V from the paged cache by block table: nothing is gathered
    or padded per step."""

    # `take_bf16_prompt_dots` sets it where the prefill kernel takes `bf16_dots`.
    bf16_prompt_dots = False

    @staticmethod
    def cast_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`x` ([rows, ...], each row contiguous) in `dtype`, contiguous: for a cache in
        another dtype than the model's."""
        return x.to(dtype).contiguous()

    @staticmethod
    @abstractmethod
    def write_cache(
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = skip
    ) -> None: ...

    @staticmethod
    @abstractmethod
    def prefill_attention(*args: Any, **kwargs: Any) -> torch.Tensor: ...

    @staticmethod
    @abstractmethod
    def decode_attention(*args: Any, **kwargs: Any) -> torch.Tensor: ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads]
        write_kv: bool = True,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        # Only backends whose kernels take these get them (`unsupported_reason` refuses the
        # models that need them elsewhere).
        extra: dict[str, Any] = {}
        if sliding_window is not None:
            extra["sliding_window"] = sliding_window
        if self.softcap is not None:
            extra["softcap"] = self.softcap
        if sinks is not None:
            extra["sinks"] = sinks
        # A cache in another dtype (bfloat16 in a float32 model): the step's rows are rounded
        # to it, the kernels run in it, and the output is widened back (decode.cpp does the
        # same in the native step).
        model_dtype = query.dtype
        if key_cache.dtype != model_dtype:
            query, key, value = (self.cast_rows(t, key_cache.dtype) for t in (query, key, value))
        if write_kv:
            if key.stride() != value.stride():  # the kernels take one row stride for both
                key, value = key.contiguous(), value.contiguous()
            self.write_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        # query may be a row-strided view (of a fused QKV projection); out is contiguous.
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        n_pre = metadata.num_prefill_tokens
        if metadata.num_prefills:
            self.prefill_attention(
                query[:n_pre],
                key_cache,
                value_cache,
                metadata.prefill_block_tables,
                metadata.prefill_query_start_loc,
                metadata.prefill_seq_lens,
                self.scale,
                out=out[:n_pre],
                max_query_len=metadata.max_prefill_query_len,
                **extra,
                **({"bf16_dots": True} if self.bf16_prompt_dots else {}),
            )
        if metadata.num_decodes:
            self.decode(query[n_pre:], key_cache, value_cache, out[n_pre:], metadata, extra)
        return out if out.dtype == model_dtype else self.cast_rows(out, model_dtype)

    def decode(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        out: torch.Tensor,  # [num_decodes, num_heads, head_dim]
        metadata: AttentionMetadata,
        extra: dict[str, Any] | None = None,  # sliding_window / softcap / sinks, for kernels
    ) -> None:
        """The decode tokens' attention, written into `out` (one layer)."""
        self.decode_attention(
            query,
            key_cache,
            value_cache,
            metadata.decode_block_tables,
            metadata.decode_seq_lens,
            self.scale,
            out=out,
            max_seq_len=metadata.max_decode_seq_len,
            **(extra or {}),
        )


_REGISTRY: dict[str, type[AttentionBackend]] = {}
# Optional backends live in modules imported on first use (they may need CUDA, Triton or a
# C++ compiler).
_LAZY_MODULES: dict[str, str] = {
    "cpu": "worker_service.attention.cpu_backend",
    "triton": "worker_service.attention.triton_backend",
}
# What `auto` tries, in order, per device type; `torch` runs everywhere.
_AUTO_ORDER: dict[str, tuple[str, ...]] = {"cuda": ("triton",), "cpu": ("cpu",)}


class AttentionBackendError(RuntimeError):
    """The requested attention backend cannot run here."""


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: make a backend selectable by its `name`."""
    _REGISTRY[cls.name] = cls
    return cls


def get_backend_class(
    name: str, spec: AttentionSpec | Sequence[AttentionSpec]
) -> type[AttentionBackend]:
    """Resolve `auto|cpu|triton|torch` to a backend class that can run `spec` (or every one
    of several: a model whose layers attend in different shapes).

    `auto` picks `triton` on CUDA and the native `cpu` kernels on CPU when they can run the
    model here, else `torch`.
    """
    specs = [spec] if isinstance(spec, AttentionSpec) else list(spec)
    if name == "auto":
        for candidate in _AUTO_ORDER.get(specs[0].device.type, ()):
            try:
                return get_backend_class(candidate, specs)
            except AttentionBackendError:
                pass
        return get_backend_class("torch", specs)
    if name not in _REGISTRY and name in _LAZY_MODULES:
        import importlib

        try:
            importlib.import_module(_LAZY_MODULES[name])
        except ImportError as exc:
            raise AttentionBackendError(
                f"attention backend {name!r} is not installed: {exc}"
            ) from exc
    if name not in _REGISTRY:
        known = sorted({*_REGISTRY, *_LAZY_MODULES})
        raise AttentionBackendError(f"unknown attention backend {name!r}; known: {known}")
    cls = _REGISTRY[name]
    for one in specs:
        reason = cls.unsupported_reason(one)
        if reason is not None:
            raise AttentionBackendError(f"attention backend {name!r} cannot run here: {reason}")
    return cls
