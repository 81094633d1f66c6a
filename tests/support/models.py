"""Tiny random models for tests, saved with `save_pretrained` (no network)."""

from __future__ import annotations

from pathlib import Path

from llmserve.model_spec import resolve_model


def build_tiny_llama(directory: Path, seed: int = 0, num_layers: int = 2) -> Path:
    """A 2-layer random Llama with SmolLM2's real tokenizer and chat template, so text tests
    exercise the real byte-level BPE while the model stays fast."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(source.path, **source.pretrained_kwargs())
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
