"""bench/spec_workloads.py's text set (bench/spec_decode.py's text workload): paragraphs of
prose from docstrings, with typos to correct. The paragraphs below are written here, each to
pass or fail one of `prose`'s rules."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from spec_workloads import prose, prose_paragraphs, with_typos  # noqa: E402

SENTENCE = "The reader keeps a buffer of the bytes it has seen so far. "
PROSE = (
    SENTENCE
    + "Each call returns the next complete record, or None when the stream has ended. "
    + "A partial record at the end is kept until more input arrives. "
    + "Errors in a record are reported with its offset, so that a caller can skip it. "
    + "Nothing is read ahead of what a call needs, and closing the reader closes its file. "
    + "Records may span lines; their length comes first, in decimal digits."
)


def test_a_paragraph_of_prose_is_taken_joined_into_one_line() -> None:
    doc = "Summary line.\n\n" + PROSE.replace(". ", ".\n")
    assert 400 <= len(PROSE) <= 900
    assert prose(doc) == PROSE


def test_code_lists_short_and_repetitive_paragraphs_are_left_out() -> None:
    indented = PROSE + "\n    reader = Reader(path)"
    listed = PROSE + "\n- a listed item"
    short = SENTENCE * 2
    # The same four words twice: an enumeration a small model tends to loop on.
    enumeration = (
        PROSE + " If strict is true, the reader fails. If lenient is true, the reader fails."
    )
    for doc in (indented, listed, short, enumeration):
        assert prose(doc) is None, doc


def test_typos_swap_two_inner_letters_of_some_words_and_repeat_with_the_seed() -> None:
    text = PROSE * 2
    typed = with_typos(text, 3)
    assert typed == with_typos(text, 3) and typed != with_typos(text, 4)
    words, typed_words = re.findall(r"[A-Za-z]+", text), re.findall(r"[A-Za-z]+", typed)
    changed = [(a, b) for a, b in zip(words, typed_words, strict=True) if a != b]
    assert 0 < len(changed) < len(words) / 3
    for word, typo in changed:
        assert len(word) > 4 and sorted(word) == sorted(typo)
        assert word[0] == typo[0] and word[-1] == typo[-1]
        differ = [i for i, (a, b) in enumerate(zip(word, typo, strict=True)) if a != b]
        assert len(differ) == 2 and differ[1] == differ[0] + 1


def test_the_set_takes_one_paragraph_per_module_and_fills_its_count() -> None:
    paragraphs = prose_paragraphs(12)
    assert len(paragraphs) == 12 and len(set(paragraphs)) == 12
    assert all(prose(p) == p for p in paragraphs)
