"""The one factory of tiny random models for tests, saved with `save_pretrained` (no network).

`save_tiny_model(kind, ...)` builds every architecture the worker supports from one shared
config; `build_tiny_llama` is the Llama the service tests run, with SmolLM2's real tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmserve.model_spec import resolve_model

VOCAB = 128
KINDS = ("llama", "llama3", "qwen2", "mistral")

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    eos_token_id=1,
    bos_token_id=0,
)


def tiny_config(kind: str, **overrides: Any) -> Any:
    """The HF config of a tiny `kind` model; `overrides` replace the shared values."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = {**_COMMON, **overrides}
    if kind == "llama":
        return LlamaConfig(**{"tie_word_embeddings": False, **common})
    if kind == "llama3":
        return LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if kind == "qwen2":
        return Qwen2Config(**{"tie_word_embeddings": True, **common})
    if kind == "mistral":
        return MistralConfig(**{**common, "num_key_value_heads": 1}, sliding_window=None)
    raise ValueError(kind)


def save_tiny_model(
    kind: str, path: Path, seed: int = 0, sharpen: bool = True, **overrides: Any
) -> Path:
    """A randomly initialised `kind` model saved at `path` (like a checkpoint). `sharpen`
    widens the logits: random init keeps them near-uniform, where greedy ties could flip."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32)
    if sharpen:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(path)
    return path


def load_hf(path: Path) -> Any:
    """The saved model in transformers, generating exactly max_new_tokens (no EOS stop)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def build_tiny_llama(directory: Path, seed: int = 0, num_layers: int = 2) -> Path:
    """A random Llama with SmolLM2's real tokenizer and chat template, so text tests exercise
    the real byte-level BPE while the model stays fast."""
    from transformers import AutoTokenizer

    source = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(source.path, **source.pretrained_kwargs())
    save_tiny_model(
        "llama",
        directory,
        seed=seed,
        sharpen=False,
        vocab_size=len(tokenizer),
        intermediate_size=128,
        num_hidden_layers=num_layers,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    tokenizer.save_pretrained(directory)
    return directory
