"""Test proposers for speculative decoding: the per-sequence state (the tokens seen, and what
became of its drafts: `scheduler_service.engine.proposer.DraftState`) and a proposer that drafts known outputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from scheduler_service.engine.proposer import DraftProposer, DraftState


class TokenList(DraftState):
    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self.records: list[tuple[int, int]] = []  # (drafts, kept) per verifying step

    def extend(self, new_tokens: Sequence[int]) -> None:
        self.tokens.extend(new_tokens)

    def record(self, num_drafts: int, num_kept: int) -> None:
        self.records.append((num_drafts, num_kept))

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class ScriptProposer(DraftProposer):
    """Drafts each prompt's known output (its run without drafts) from where the sequence
    stands, up to `k` tokens; a draft at output position p is one token off (mod
    `vocab_size`) where `off(p)` says so, so it is not kept."""

    def __init__(
        self,
        outputs: dict[tuple[int, ...], list[int]],
        k: int,
        vocab_size: int,
        off: Callable[[int], bool] = lambda position: False,
    ) -> None:
        self.outputs = outputs
        self.k = k
        self.vocab_size = vocab_size
        self.off = off

    def new_state(self, tokens: Sequence[int]) -> TokenList:
        return TokenList(tokens)

    def propose(self, state: DraftState, max_tokens: int, assumed: Sequence[int] = ()) -> list[int]:
        assert isinstance(state, TokenList)
        tokens = [*state.tokens, *assumed]
        for prompt, output in self.outputs.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                drafts = output[done : done + min(self.k, max_tokens)]
                return [
                    (t + 1) % self.vocab_size if self.off(done + i) else t
                    for i, t in enumerate(drafts)
                ]
        raise AssertionError("a sequence of an unknown prompt")
