"""Incremental detokenization equals a full decode, and never emits half a character."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from llmserve.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

TEXTS = [
    "Hello world",
    " leading space and  double  spaces",
    "emoji 😀👍🏽 and a family 👨‍👩‍👧 in a row",
    "中文字符和日本語のテキスト、한국어",
    "accents: naïve café résumé Ærøskøbing",
    "lines\nand\n\n  indented\tcode()\n",
    "😀",
]
TOKENIZERS = ["smollm2_tokenizer", "sentencepiece_tokenizer"]


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [detok.flush()]


@pytest.mark.parametrize("fixture", TOKENIZERS)
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_the_full_decode(
    fixture: str, text: str, chunk: int, request: pytest.FixtureRequest
) -> None:
    tokenizer = request.getfixturevalue(fixture)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = _stream(detok, ids, chunk)
    assert "".join(deltas) == _decode(tokenizer, ids)
    assert detok.text == _decode(tokenizer, ids)
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert detok.output_token_ids == ids


@pytest.mark.parametrize("fixture", TOKENIZERS)
@pytest.mark.parametrize("text", TEXTS)
def test_prompt_context_keeps_the_first_tokens_leading_space(
    fixture: str, text: str, request: pytest.FixtureRequest
) -> None:
    tokenizer = request.getfixturevalue(fixture)
    prompt = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    output = tokenizer.encode(" " + text, add_special_tokens=False)
    if fixture == "sentencepiece_tokenizer":  # '▁' already stands for the space
        output = tokenizer.encode(text, add_special_tokens=False)
    full = _decode(tokenizer, prompt + output)
    prompt_text = _decode(tokenizer, prompt)
    assert full.startswith(prompt_text)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(_stream(detok, output)) == full[len(prompt_text) :]
    assert full[len(prompt_text)] == " " or text[0] == " "


def test_sentencepiece_space_without_context_matches_decode(sentencepiece_tokenizer: Any) -> None:
    ids = sentencepiece_tokenizer.encode("Hello world", add_special_tokens=False)
    assert sentencepiece_tokenizer.convert_ids_to_tokens(ids) == ["▁Hello", "▁world"]
    detok = IncrementalDetokenizer(sentencepiece_tokenizer)
    assert [detok.add([i]) for i in ids] == ["Hello", " world"]


def test_split_character_waits_until_complete(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode("a😀b", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    deltas = [detok.add([i]) for i in ids]
    assert "".join(deltas) == "a😀b"
    emoji_at = deltas.index(next(d for d in deltas if "😀" in d))
    assert deltas[1:emoji_at] == [""] * (emoji_at - 1)
    assert emoji_at > 1  # the emoji spans several tokens


def test_incomplete_character_at_the_end_is_flushed_as_decode_shows_it(
    smollm2_tokenizer: Any,
) -> None:
    ids = smollm2_tokenizer.encode("ok😀", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    streamed = "".join(detok.add([i]) for i in ids)
    assert REPLACEMENT_CHAR not in streamed
    assert streamed + detok.flush() == _decode(smollm2_tokenizer, ids)
    assert detok.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(smollm2_tokenizer: Any, skip: bool) -> None:
    ids = smollm2_tokenizer.encode("Hi there<|im_end|>\n<|im_start|>user", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2_tokenizer, skip_special_tokens=skip)
    text = "".join(_stream(detok, ids))
    expected = "Hi there\nuser" if skip else "Hi there<|im_end|>\n<|im_start|>user"
    assert text == expected


def test_skip_ids_leave_out_those_tokens_only(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode("Hi there<|im_end|>\n<|im_start|>user", add_special_tokens=False)
    (im_end,) = smollm2_tokenizer.encode("<|im_end|>", add_special_tokens=False)
    for chunk in (1, 2):
        detok = IncrementalDetokenizer(smollm2_tokenizer, skip_ids=frozenset({im_end}))
        assert "".join(_stream(detok, ids, chunk)) == "Hi there\n<|im_start|>user"


def test_prompt_ending_mid_character_gives_the_character_to_the_output(
    smollm2_tokenizer: Any,
) -> None:
    ids = smollm2_tokenizer.encode("x😀y", add_special_tokens=False)
    full = _decode(smollm2_tokenizer, ids)
    assert full == "x😀y"
    texts = []
    for cut in range(1, len(ids)):
        detok = IncrementalDetokenizer(smollm2_tokenizer, ids[:cut])
        texts.append("".join(_stream(detok, ids[cut:])))
    # Cutting inside the emoji's bytes still yields the whole emoji in the output.
    assert texts == ["😀y"] * (len(ids) - 2) + ["y"]


def test_a_tokenizer_class_that_decodes_its_own_way_is_honoured(smollm2_tokenizer: Any) -> None:
    """Decoding goes straight to the Rust tokenizer only when the class adds nothing to
    transformers' decode: an override still decides the text."""

    class Shouting(type(smollm2_tokenizer)):  # type: ignore[misc]
        def _decode(self, token_ids: Any, *args: Any, **kwargs: Any) -> str:
            return super()._decode(token_ids, *args, **kwargs).upper()

    shouting = copy.copy(smollm2_tokenizer)
    shouting.__class__ = Shouting
    ids = smollm2_tokenizer.encode("quiet words", add_special_tokens=False)
    assert "".join(_stream(IncrementalDetokenizer(shouting), ids)) == "QUIET WORDS"
    assert "".join(_stream(IncrementalDetokenizer(smollm2_tokenizer), ids)) == "quiet words"
