"""The think_tags reasoning parser: whole outputs, and the same outputs fed in two and in
single-character pieces at every split point, must come apart the same way."""

from __future__ import annotations

import pytest

from gateway.reasoning import ReasoningDelta, ThinkTagsFormat, detect_format, reasoning_format
from tests.support.reasoning_parsers import parse as parse_with
from tests.support.reasoning_parsers import parser_tests

FORMAT = ThinkTagsFormat()

# (output, the prompt opened the block, expected reasoning, expected answer)
CASES = [
    (
        "<think>\nLet me add 2 and 2.\n</think>\n\nIt is 4.",
        False,
        "Let me add 2 and 2.",
        "It is 4.",
    ),
    (
        "<think>a < b and </thin is not a tag</think>yes",
        False,
        "a < b and </thin is not a tag",
        "yes",
    ),
    ("The answer is 4.", False, "", "The answer is 4."),
    ("  <thinking> is not the tag", False, "", "<thinking> is not the tag"),
    ("I say <think>x</think> later", False, "", "I say <think>x</think> later"),
    ("the prompt opened it\n</think>\n\nDone.", True, "the prompt opened it", "Done."),
    ("cut short while thinking", True, "cut short while thinking", ""),
    ("<think>\nstill thinking at the end", False, "still thinking at the end", ""),
    ("<think></think>\n\nNo thoughts.", False, "", "No thoughts."),
    ("<think>x</think>", False, "x", ""),
    ("<thi", False, "", "<thi"),
    ("", False, "", ""),
    ("\n\n", True, "", ""),
    (
        "<think>two  spaces inside  \n\n</think>answer  with tail  ",
        False,
        "two  spaces inside",
        "answer  with tail  ",
    ),
]


test_whole, test_every_split_point, test_one_character_at_a_time = parser_tests(FORMAT, CASES)


def parse(pieces: list[str], opened: bool) -> tuple[str, str]:
    return parse_with(FORMAT, pieces, opened)


def test_a_partial_close_tag_is_held_back_until_decided() -> None:
    parser = FORMAT.parser(opened=True)
    assert parser.feed("thinking </thi") == ReasoningDelta(reasoning="thinking")
    assert parser.in_reasoning
    assert parser.feed("nk>42") == ReasoningDelta(answer="42")
    assert not parser.in_reasoning


def test_whether_the_prompt_left_the_block_open() -> None:
    assert FORMAT.opened_in("<|im_start|>assistant\n<think>\n")
    assert not FORMAT.opened_in("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not FORMAT.opened_in("<|im_start|>assistant\n")
    # An earlier turn's closed block does not open this one.
    assert FORMAT.opened_in("<think>a</think>b<|im_start|>assistant\n<think>")


def test_the_format_is_read_off_the_template() -> None:
    assert detect_format("{{ '<think>\\n' }}...{{ '</think>' }}") == "think_tags"
    assert detect_format("{{ messages }}") == "none"
    assert detect_format(None) == "none"
    assert reasoning_format("auto", "plain") is None
    assert reasoning_format("none", "<think></think>") is None
    assert reasoning_format("think_tags", None).name == "think_tags"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="--reasoning-parser"):
        reasoning_format("deepseek_r1", None)
