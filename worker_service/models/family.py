"""What a family module declares: the architecture classes it serves, how it reads their
config into a `ModelArchConfig`, and how it reads one decoder layer's weights."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from worker_service.models.arch import ModelArchConfig
from worker_service.models.per_layer_inputs import PerLayerInputWeights
from worker_service.models.weights import LayerWeights, read_layer


def causal_lm_parts(hf_model: Any) -> tuple[Any, Any]:
    """(the decoder with embed_tokens, layers and norm; the lm_head module) of a
    `*ForCausalLM` model."""
    return hf_model.model, hf_model.lm_head


def same_config(config: Any) -> Any:
    return config


def no_per_layer_inputs(inner: Any, arch: ModelArchConfig) -> PerLayerInputWeights | None:
    return None


def llama_layer(layer: Any, arch: ModelArchConfig, index: int) -> LayerWeights:
    return read_layer(layer)


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    read_config: Callable[[Any, str], ModelArchConfig]  # (text config, class) -> arch
    read_layer: Callable[[Any, ModelArchConfig, int], LayerWeights] = llama_layer
    # The text model's config (a multimodal checkpoint nests it) and modules.
    text_config: Callable[[Any], Any] = same_config
    text_parts: Callable[[Any], tuple[Any, Any]] = causal_lm_parts
    # The model-level weights of per-layer inputs (Gemma 4), from the text model's module.
    read_per_layer_inputs: Callable[[Any, ModelArchConfig], PerLayerInputWeights | None] = (
        no_per_layer_inputs
    )
