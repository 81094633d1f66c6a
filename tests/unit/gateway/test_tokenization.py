"""Prompt encoding and chat templates with SmolLM2's tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.tokenization import Tokenization, load_tokenizer
from llmserve.errors import FieldError
from llmserve.model_spec import resolve_model

SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n"
)


@pytest.fixture
def tok(smollm2_tokenizer: Any) -> Tokenization:
    return Tokenization(smollm2_tokenizer)


def test_tokenizer_is_loaded_once(smollm2_tokenizer: Any) -> None:
    assert load_tokenizer(resolve_model("smollm2")) is smollm2_tokenizer
    assert Tokenization.for_model(resolve_model("smollm2")).tokenizer is smollm2_tokenizer


def test_encode_and_count(tok: Tokenization) -> None:
    assert tok.encode("hi") == [6004]
    assert tok.count_tokens("Hello 世界") == len(tok.encode("Hello 世界"))
    assert tok.eos_token_id == 2
    assert tok.vocab_size == 49152


def test_chat_template_renders_and_encodes(tok: Tokenization) -> None:
    messages = [{"role": "user", "content": "hi"}]
    text = tok.render_chat(messages)
    assert text == SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.render_chat(messages, add_generation_prompt=False) == (
        SYSTEM + "<|im_start|>user\nhi<|im_end|>\n"
    )
    ids = tok.encode_chat(messages)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_explicit_system_message_replaces_the_default(tok: Tokenization) -> None:
    text = tok.render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "x"}, {"role": "user", "content": 3}], "messages[1].content"),
    ],
)
def test_bad_messages_name_the_field(tok: Tokenization, messages: list, field: str) -> None:
    with pytest.raises(FieldError) as info:
        tok.render_chat(messages)
    assert info.value.field == field


def test_model_without_chat_template(sentencepiece_tokenizer: Any) -> None:
    with pytest.raises(FieldError, match="no chat template") as info:
        Tokenization(sentencepiece_tokenizer).encode_chat([{"role": "user", "content": "x"}])
    assert info.value.field == "messages"


def test_a_given_chat_template_serves_a_model_without_one(sentencepiece_tokenizer: Any) -> None:
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}A:"
    tok = Tokenization(sentencepiece_tokenizer, chat_template=template)
    messages = [{"role": "user", "content": "hello"}]
    assert tok.render_chat(messages) == "[user] hello\nA:"
    assert tok.encode_chat(messages) == tok.encode("[user] hello\nA:", add_special_tokens=False)
    with pytest.raises(FieldError, match="--chat-template FILE"):
        Tokenization(sentencepiece_tokenizer).render_chat(messages)
