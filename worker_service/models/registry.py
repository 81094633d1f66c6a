"""The architecture registry: a checkpoint's `architectures` class -> its family module.

`read_arch` turns a transformers config into a `ModelArchConfig` (refusing an unknown class
by name, listing the supported ones); `model_from_hf` takes a loaded transformers model's
weights into a `DecoderModel`."""

from __future__ import annotations

from typing import Any

from worker_service.models import (
    gemma,
    gemma4,
    gpt_oss,
    granite,
    llama,
    mixture,
    olmo2,
    olmo3,
    phi3,
    qwen3,
    qwen3_5,
    qwen3_next,
    smollm3,
)
from worker_service.models.arch import ModelArchConfig
from worker_service.models.decoder import DecoderModel
from worker_service.models.family import Family
from worker_service.models.rope import UnsupportedModelError

_FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    qwen3.FAMILY,
    gemma.GEMMA2,
    gemma.GEMMA3,
    gemma.GEMMA3_MULTIMODAL,
    gemma4.FAMILY,
    gemma4.MULTIMODAL,
    phi3.FAMILY,
    olmo2.FAMILY,
    olmo3.FAMILY,
    granite.FAMILY,
    smollm3.FAMILY,
    mixture.QWEN3_MOE,
    mixture.MIXTRAL,
    gpt_oss.FAMILY,
    qwen3_5.QWEN3_5,
    qwen3_5.QWEN3_5_MULTIMODAL,
    qwen3_5.QWEN3_5_MOE,
    qwen3_5.QWEN3_5_MOE_MULTIMODAL,
    qwen3_next.FAMILY,
)
ARCHITECTURES: dict[str, Family] = {a: f for f in _FAMILIES for a in f.architectures}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)


def family_of(config: Any, class_name: str | None = None) -> tuple[str, Family]:
    """The supported class this config names (or, for configs without `architectures`, such
    as a GGUF's, the loaded model's `class_name`) and its family."""
    names = list(getattr(config, "architectures", None) or [class_name or ""])
    for name in names:
        if name in ARCHITECTURES:
            return name, ARCHITECTURES[name]
    raise UnsupportedModelError(
        f"architecture {names or config.model_type!r} is not supported; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def read_arch(config: Any, class_name: str | None = None) -> ModelArchConfig:
    name, family = family_of(config, class_name)
    return family.read_config(family.text_config(config), name)


def model_from_hf(hf_model: Any, max_positions: int, **options: Any) -> DecoderModel:
    """Take (fuse, not copy where possible) the weights of a loaded transformers model;
    `options` are DecoderModel's (fused_ops, packed_linear, ...)."""
    name, family = family_of(hf_model.config, type(hf_model).__name__)
    arch = family.read_config(family.text_config(hf_model.config), name)
    inner, lm_head = family.text_parts(hf_model)
    layers = [family.read_layer(layer, arch, i) for i, layer in enumerate(inner.layers)]
    return DecoderModel(
        arch,
        embed=inner.embed_tokens.weight.detach(),
        layers=layers,
        final_norm=inner.norm.weight.detach(),
        lm_head=lm_head.weight.detach(),
        max_positions=max_positions,
        per_layer_input_weights=family.read_per_layer_inputs(inner, arch),
        **options,
    )
