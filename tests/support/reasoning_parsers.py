"""What every reasoning format's parser must do (gateway/reasoning/): cut an output into the
same reasoning and answer whole, in two pieces at every split point, and one character at a
time, as streams arrive in any pieces."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gateway.reasoning import ReasoningDelta, ReasoningFormat

# (output, the prompt opened the block, expected reasoning, expected answer)
Case = tuple[str, bool, str, str]


def parse(fmt: ReasoningFormat, pieces: list[str], opened: bool) -> tuple[str, str]:
    """The reasoning and the answer `fmt`'s parser gives for an output fed as `pieces`."""
    parser = fmt.parser(opened)
    total = ReasoningDelta()
    for piece in pieces:
        d = parser.feed(piece)
        total.reasoning += d.reasoning
        total.answer += d.answer
    d = parser.finish()
    return total.reasoning + d.reasoning, total.answer + d.answer


def parser_tests(fmt: ReasoningFormat, cases: list[Case]) -> tuple[Callable[..., Any], ...]:
    """The three checks over `cases`, for a test module to bind to its own test names."""
    over_cases = pytest.mark.parametrize(("text", "opened", "reasoning", "answer"), cases)

    @over_cases
    def test_whole(text: str, opened: bool, reasoning: str, answer: str) -> None:
        assert parse(fmt, [text], opened) == (reasoning, answer)

    @over_cases
    def test_every_split_point(text: str, opened: bool, reasoning: str, answer: str) -> None:
        for cut in range(len(text) + 1):
            assert parse(fmt, [text[:cut], text[cut:]], opened) == (reasoning, answer), cut

    @over_cases
    def test_one_character_at_a_time(text: str, opened: bool, reasoning: str, answer: str) -> None:
        assert parse(fmt, list(text), opened) == (reasoning, answer)

    return test_whole, test_every_split_point, test_one_character_at_a_time
