"""Draft proposers for speculative decoding (issue #28): what a sequence's next tokens will
probably be, guessed from tokens the scheduler already holds.

`NgramProposer` is prompt lookup: find the longest suffix of the sequence (between `min_n`
and `max_n` tokens) that occurred earlier in its prompt or output, and draft the tokens that
followed that earlier occurrence (the most recent one): up to `k`, and no more than
`max_drafts_for_match(n)` for a match of n tokens, since a longer match is better evidence
that the copy goes on (replayed on bench/spec_decode.py's outputs by bench/spec_replay.py,
the cap with matches of 2 to 6 tokens and K = 8 drafts decodes code edits and summaries
faster than K = 5 and matches of 2 to 4 uncapped; replayed and served figures:
bench/RESULTS.md, "Speculative decoding, second round").
Input-grounded work (code edits, summaries, answers that quote their sources) repeats its
input, so such drafts are often right; where nothing matches, the proposal is empty and the
sequence decodes as usual.

Each sequence keeps an `NgramIndex`: per n, the n-grams of its tokens mapped to where their
most recent occurrence ends. It is updated as tokens are committed (amortized O(max_n - min_n
+ 1) per token), so a proposal costs a few dictionary lookups, not a scan of the context. The
index is derived from the tokens alone: rebuilt from them after a migration or a restart,
never state to move. Beside it, the shortest match the sequence drafts from grows while its
drafts fail (`NgramIndex.shortest`, after how each step with drafts fared); a rebuilt index
starts over at min_n.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from llmserve.steps import SAMPLED_TOKEN


def max_drafts_for_match(n: int) -> int:
    """The most drafts a suffix match of `n` tokens proposes: 2 (n - 1), and 1 for n = 1."""
    return max(1, 2 * (n - 1))


def _check_range(min_n: int, max_n: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")


class DraftState(ABC):
    """What a proposer keeps per sequence, derived from its committed tokens (and from how
    its drafts fared, which a rebuilt state starts over without)."""

    @abstractmethod
    def extend(self, new_tokens: Sequence[int]) -> None:
        """Commit tokens (accepted ones only: rejected drafts never enter the state)."""

    @abstractmethod
    def record(self, num_drafts: int, num_kept: int) -> None:
        """A step verified `num_drafts` drafts of this sequence and kept the first `num_kept`
        (a state whose proposer does not adapt ignores it)."""

    @property
    @abstractmethod
    def num_tokens(self) -> int:
        """How many tokens the state has seen."""


class DraftProposer(ABC):
    """Proposes draft tokens for a sequence (a draft model or a suffix index may implement
    it later)."""

    @abstractmethod
    def new_state(self, tokens: Sequence[int]) -> DraftState:
        """The state of a sequence whose tokens (prompt and output) so far are `tokens`."""

    @abstractmethod
    def propose(self, state: DraftState, max_drafts: int, assumed: Sequence[int] = ()) -> list[int]:
        """At most `max_drafts` (and the proposer's own limit) drafts to follow the tokens
        `state` has seen and then `assumed` (not committed: the drafts of a step in flight,
        whose result is not back); [] when it has no guess."""


class _Seen(DraftState):
    """A state that only counts tokens (a proposer that does not read them)."""

    __slots__ = ("_num_tokens",)

    def __init__(self, num_tokens: int) -> None:
        self._num_tokens = num_tokens

    def extend(self, new_tokens: Sequence[int]) -> None:
        self._num_tokens += len(new_tokens)

    def record(self, num_drafts: int, num_kept: int) -> None:
        pass

    @property
    def num_tokens(self) -> int:
        return self._num_tokens


class OwnSamples(DraftProposer):
    """Multi-step decoding as drafts: `k` placeholders that the worker fills with its own
    samples, a forward pass each (`llmserve.steps`), so every one is kept."""

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        self.k = k

    def new_state(self, tokens: Sequence[int]) -> DraftState:
        return _Seen(len(tokens))

    def propose(self, state: DraftState, max_drafts: int, assumed: Sequence[int] = ()) -> list[int]:
        return [SAMPLED_TOKEN] * min(self.k, max_drafts)


class NgramIndex(DraftState):
    """The n-grams (min_n <= n <= max_n) of one token sequence, each mapped to the end of its
    most recent occurrence that is not the sequence's current suffix."""

    __slots__ = ("min_n", "max_n", "tokens", "shortest", "_ends")

    def __init__(self, min_n: int, max_n: int, tokens: Sequence[int] = ()) -> None:
        _check_range(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # The shortest match NgramProposer drafts from now: one token longer after each step
        # that kept none of its drafts (up to max_n), back to min_n after one that kept some.
        # Text that does not repeat its context still matches 2 or 3 tokens now and then, and
        # each such draft costs a step's rows and its round trip; longer matches there are
        # rare, and on text that copies they are kept.
        self.shortest = min_n
        # _ends[n - min_n][gram] = e: tokens[e - n:e] == gram, e the largest such end below
        # len(tokens) (the suffix ending at len(tokens) is registered when a token follows).
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self.extend(tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: Sequence[int]) -> None:
        tokens = self.tokens
        for token in new_tokens:
            end = len(tokens)  # the grams ending here stop being the suffix now
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[n - self.min_n][tuple(tokens[end - n : end])] = end
            tokens.append(token)

    def record(self, num_drafts: int, num_kept: int) -> None:
        if num_drafts:
            self.shortest = self.min_n if num_kept else min(self.shortest + 1, self.max_n)

    def longest_match(self, assumed: Sequence[int] = ()) -> tuple[int, int] | None:
        """(n, end): the longest suffix of the tokens followed by `assumed` found, n tokens
        long, and the end of its most recent earlier occurrence among the tokens; None when no
        suffix of min_n or more tokens occurred before."""
        tokens = self.tokens
        tail = [*tokens[-self.max_n :], *assumed][-self.max_n :] if assumed else tokens
        length = len(tail)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self._ends[n - self.min_n].get(tuple(tail[length - n :]))
            if end is not None:
                return n, end
        return None


class NgramProposer(DraftProposer):
    """Prompt lookup with suffixes of `min_n` to `max_n` tokens, up to `k` drafts (and
    `max_drafts_for_match` of the suffix found)."""

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        _check_range(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        self.k = k

    def new_state(self, tokens: Sequence[int]) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n, tokens)

    def propose(self, state: DraftState, max_drafts: int, assumed: Sequence[int] = ()) -> list[int]:
        assert isinstance(state, NgramIndex)
        match = state.longest_match(assumed) if max_drafts > 0 else None
        if match is None or match[0] < state.shortest:
            return []
        n, end = match
        stop = end + min(self.k, max_drafts, max_drafts_for_match(n))
        tokens = state.tokens
        if stop <= len(tokens) or not assumed:
            return tokens[end:stop]
        return [*tokens[end:], *assumed][: stop - end]
