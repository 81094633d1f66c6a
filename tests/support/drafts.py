"""Test proposers' per-sequence state for speculative decoding: the tokens seen, nothing more
(`scheduler_service.proposer.DraftState`)."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_service.proposer import DraftState


class TokenList(DraftState):
    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)

    def extend(self, new_tokens: Sequence[int]) -> None:
        self.tokens.extend(new_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)
