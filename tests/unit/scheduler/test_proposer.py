"""Prompt-lookup drafts (speculative decoding's proposer) against a brute-force scan of the
tokens: the longest suffix of min_n..max_n tokens seen before, the tokens that followed its
most recent earlier occurrence, no more than the match's length allows."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.engine.proposer import NgramIndex, NgramProposer

# The most drafts a match of n tokens may propose (proposer.max_drafts_for_match), written out.
MATCH_CAPS = {1: 1, 2: 2, 3: 4, 4: 6, 5: 8, 6: 10}


def scan(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """What a proposal should be, by checking every earlier position."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):  # most recent first, not the suffix itself
            if tokens[end - n : end] == suffix:
                return tokens[end : end + min(k, MATCH_CAPS[n])]
    return []


def test_drafts_follow_the_most_recent_earlier_occurrence_of_the_longest_suffix():
    proposer = NgramProposer(min_n=1, max_n=4, k=8)
    #         0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 4, 0, 6, 7]
    state = proposer.new_state(tokens)
    # "6 7" (the 3-gram "0 6 7" never occurred): last seen ending at 8, followed by 2 3 4 0.
    # A 2-token match drafts two of them.
    assert proposer.propose(state, 10) == [2, 3]
    assert proposer.propose(state, 1) == [2]  # the caller's room bounds it too
    assert proposer.propose(state, 0) == []


def test_a_longer_match_drafts_more():
    proposer = NgramProposer(min_n=1, max_n=6, k=8)
    run = list(range(20, 40))
    for n in (1, 2, 3, 4, 5, 6):
        # The run, then a different token, then its first n tokens again: a match of n.
        state = proposer.new_state([*run, 99, *run[:n]])
        assert proposer.propose(state, 20) == run[n : n + min(8, MATCH_CAPS[n])]


def test_a_longer_match_wins_over_a_more_recent_shorter_one():
    proposer = NgramProposer(min_n=1, max_n=3, k=2)
    state = proposer.new_state([1, 2, 3, 40, 41, 9, 3, 50, 1, 2, 3])
    assert proposer.propose(state, 8) == [40, 41]  # "1 2 3", not the later "3"


def test_drafts_that_fail_raise_the_match_length_they_need_until_some_are_kept():
    proposer = NgramProposer(min_n=2, max_n=4, k=8)
    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 4, 9, 2, 3, 8, 1, 2, 3]
    state = proposer.new_state(tokens)
    # "1 2 3" matches 3 tokens (ending at 3, followed by 4 9 2 3); "2 3" alone would be 2.
    assert proposer.propose(state, 10) == [4, 9, 2, 3]
    state.record(4, 0)  # none kept: 3-token matches are still enough
    assert proposer.propose(state, 10) == [4, 9, 2, 3]
    state.record(4, 0)  # none kept again: 4 tokens needed now
    assert proposer.propose(state, 10) == []
    state.record(0, 0)  # a step without drafts changes nothing
    assert proposer.propose(state, 10) == []
    state.record(4, 0)  # never beyond max_n: a 4-token match would still draft
    assert state.shortest == 4
    state.extend([4])  # "1 2 3 4" occurred: a 4-token match
    assert proposer.propose(state, 10) == [9, 2, 3, 8, 1, 2]
    state.record(6, 1)  # one kept: back to 2-token matches
    state.extend([9, 2, 3, 5, 2, 3])
    assert proposer.propose(state, 10) == [5, 2]  # "2 3" last seen followed by 5 2


def test_nothing_matches_nothing_is_drafted():
    proposer = NgramProposer(min_n=2, max_n=4, k=3)
    state = proposer.new_state([1, 2, 3, 4, 5, 6])
    assert proposer.propose(state, 8) == []
    state.extend([1])  # "6 1" never occurred, and 1-grams are below min_n
    assert proposer.propose(state, 8) == []
    state.extend([2])  # "1 2" occurred at the start, followed by 3 4 5: two drafts
    assert proposer.propose(state, 8) == [3, 4]


def test_bad_settings_are_refused():
    for min_n, max_n in ((0, 2), (3, 2)):
        with pytest.raises(ValueError, match="min_n"):
            NgramProposer(min_n, max_n, 4)
        with pytest.raises(ValueError, match="min_n"):
            NgramIndex(min_n, max_n)
    with pytest.raises(ValueError, match="k must be"):
        NgramProposer(1, 3, 0)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=60),
    split=st.integers(0, 60),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(1, 12),
)
def test_an_index_built_token_by_token_proposes_what_a_scan_finds(tokens, split, min_n, extra, k):
    """A small alphabet makes repeats (and so matches of every length) common."""
    max_n = min_n + extra
    proposer = NgramProposer(min_n, max_n, k)
    state = proposer.new_state(tokens[:split])
    assert proposer.propose(state, k) == scan(tokens[:split], min_n, max_n, k)
    for i in range(min(split, len(tokens)), len(tokens)):
        state.extend([tokens[i]])
        assert proposer.propose(state, k) == scan(tokens[: i + 1], min_n, max_n, k)
    assert state.num_tokens == len(tokens)
