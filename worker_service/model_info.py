"""What a worker tells the scheduler and gateway about the model it serves (the Info RPC)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.kv_layout import KvLayout, single_group


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the scheduler and gateway need to know about the loaded model."""

    model: str
    architecture: str
    dtype: str
    device: str
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    attention_backend: str
    linear_impl: str = "torch"
    # Intra-op threads on the loading thread (CPU); see `Worker`.
    num_threads: int = 1
    # How the weights are held, and their bytes (`DecoderModel.weight_format/weight_bytes`).
    weight_format: str = ""
    weight_bytes: int = 0
    # The K/V cache's dtype (`WorkerConfig.kv_cache_dtype`); "" where not given: the model's.
    kv_cache_dtype: str = ""
    # How the layers keep K/V (`llmserve.kv_layout`).
    kv_layout: KvLayout = field(default_factory=lambda: single_group(1))

    @property
    def cache_dtype(self) -> str:
        """The K/V cache's dtype name, as torch spells it ("float32", "bfloat16")."""
        return self.kv_cache_dtype or self.dtype
