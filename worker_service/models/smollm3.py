"""SmolLM3: the Llama layer with NoPE layers (no rotary where `no_rope_layers[i]` is 0) and
sliding windows on `sliding_attention` layers when `use_sliding_window`."""

from __future__ import annotations

from typing import Any

from worker_service.models.arch import ModelArchConfig, read_common, read_layer_kinds
from worker_service.models.family import Family
from worker_service.models.rope import UnsupportedModelError


def read_config(config: Any, architecture: str) -> ModelArchConfig:
    n = config.num_hidden_layers
    use_rope = [bool(flag) for flag in config.no_rope_layers]
    if len(use_rope) != n:
        raise UnsupportedModelError(f"no_rope_layers has {len(use_rope)} entries for {n} layers")
    layers = read_layer_kinds(
        config, n, use_rope=use_rope, windows=bool(getattr(config, "use_sliding_window", False))
    )
    return read_common(config, architecture, layers=layers)


FAMILY = Family("smollm3", ("SmolLM3ForCausalLM",), read_config)
