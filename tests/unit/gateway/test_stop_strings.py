"""Stop strings over streamed deltas: held-back partial matches, matches across deltas."""

from __future__ import annotations

from typing import Any

import pytest

from llmserve.detokenizer import IncrementalDetokenizer
from llmserve.stop_strings import StopCheck, StopStringMatcher


def _run(matcher: StopStringMatcher, deltas: list[str]) -> list[StopCheck]:
    return [matcher.feed(d) for d in deltas]


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert _run(matcher, ["a", "b"]) == [StopCheck("a"), StopCheck("b")]


def test_partial_match_is_held_back_then_released() -> None:
    matcher = StopStringMatcher(["###"])
    assert _run(matcher, ["ab#", "#", "c"]) == [StopCheck("ab"), StopCheck(""), StopCheck("##c")]
    assert matcher.held_back == ""


def test_match_across_deltas_truncates_before_the_stop() -> None:
    matcher = StopStringMatcher(["</answer>"])
    checks = _run(matcher, ["Paris</an", "swer> and more"])
    assert checks == [StopCheck("Paris"), StopCheck("", "</answer>")]
    assert matcher.matched == "</answer>"
    assert matcher.feed("ignored") == StopCheck("", "</answer>")
    assert matcher.flush() == ""


def test_include_stop_str_in_output() -> None:
    matcher = StopStringMatcher(["</answer>"], include_stop_str_in_output=True)
    assert _run(matcher, ["Paris</an", "swer> and more"]) == [
        StopCheck("Paris"),
        StopCheck("</answer>", "</answer>"),
    ]


def test_match_inside_one_delta() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go STOP now") == StopCheck("go ", "STOP")


def test_the_stop_that_completes_first_wins() -> None:
    matcher = StopStringMatcher(["world", "lo w"])
    assert matcher.feed("hello world") == StopCheck("hel", "lo w")
    # Same end position: the longer (earlier-starting) one.
    matcher = StopStringMatcher(["b", "ab"])
    assert matcher.feed("xab") == StopCheck("x", "ab")


@pytest.mark.parametrize("split", range(1, 12))
def test_result_does_not_depend_on_how_text_is_split(split: int) -> None:
    text = "one\n\nUser: two\n\nUser: three"
    deltas = [text[i : i + split] for i in range(0, len(text), split)]
    matcher = StopStringMatcher(["\n\nUser:", "three"])
    checks = _run(matcher, deltas)
    assert "".join(c.text for c in checks) == "one"
    assert matcher.matched == "\n\nUser:"


def test_held_back_text_is_the_longest_possible_stop_prefix() -> None:
    matcher = StopStringMatcher(["abcd", "cx"])
    assert matcher.feed("zzabc") == StopCheck("zz")
    assert matcher.held_back == "abc"
    assert matcher.feed("y") == StopCheck("abcy")


def test_flush_releases_held_back_text() -> None:
    matcher = StopStringMatcher(["\nUser"])
    assert matcher.feed("done\nUs") == StopCheck("done")
    assert matcher.flush() == "\nUs"


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        StopStringMatcher(["ok", ""])


def test_stop_across_token_boundaries_with_the_detokenizer(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode("The answer is 42.\nQuestion: next", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    matcher = StopStringMatcher(["\nQuest", "😀"])
    emitted = []
    for token_id in ids:
        check = matcher.feed(detok.add([token_id]))
        emitted.append(check.text)
        if check.stop is not None:
            break
    assert "".join(emitted) == "The answer is 42."
    assert matcher.matched == "\nQuest"
