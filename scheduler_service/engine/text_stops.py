"""Stop strings, matched in the scheduler so that a stopped choice stops at once.

Where the matching lives. The gateway owns text, but a stop string that only the gateway sees
cannot stop a sequence in time: with n > 1 a stopped choice would keep decoding (and holding KV
blocks) until its siblings finish, best_of and beam search would rank candidates on text past
the stop, and usage would count it. So, as vLLM's engine does in its output processor, the
scheduler detokenizes the output of each sequence of a request that has stop strings
(`AddRequest.stop`), with the tokenizer of the model its workers serve (loaded once per model,
when the first request that needs it arrives: the scheduler's loop waits for that one load) and the gateway's own `IncrementalDetokenizer` and
`StopStringMatcher` (llmserve/). The token that completes a stop string finishes its sequence
(STOPPED, no stop token id): its blocks are freed in the same step, and it is the last token
returned, counted and ranked (cumulative logprob over the returned tokens). The gateway matches
the same text again to cut it at the stop string (`include_stop_str_in_output`), and sees no
token past it. Requests without stop strings cost no tokenizer work at all.

Stop strings are matched on all output text, whatever `min_tokens` says (as the gateway always
did); stop token ids and EOS honour `min_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llmserve.detokenizer import IncrementalDetokenizer
from llmserve.model_spec import load_tokenizer, resolve_model
from llmserve.stop_strings import StopStringMatcher

TokenizerLoader = Callable[[], Any]


@dataclass(frozen=True, slots=True)
class StopStrings:
    """A request's stop strings and how its text is decoded (as the gateway decodes it)."""

    strings: tuple[str, ...]
    skip_special_tokens: bool = True


class TextStop:
    """The decoded text of one sequence and its stop-string state."""

    __slots__ = ("_detokenizer", "_matcher")

    def __init__(self, detokenizer: IncrementalDetokenizer, matcher: StopStringMatcher) -> None:
        self._detokenizer = detokenizer
        self._matcher = matcher

    @classmethod
    def start(cls, tokenizer: Any, stops: StopStrings, prompt_token_ids: Sequence[int]) -> TextStop:
        return cls(
            IncrementalDetokenizer(
                tokenizer, prompt_token_ids, skip_special_tokens=stops.skip_special_tokens
            ),
            StopStringMatcher(stops.strings),
        )

    def add(self, token_ids: Sequence[int]) -> str | None:
        """Decode the new tokens; the stop string their text completed, if any."""
        text = self._detokenizer.add(token_ids)
        if not text:
            return None
        return self._matcher.feed(text).stop

    def fork(self) -> TextStop:
        return TextStop(self._detokenizer.copy(), self._matcher.copy())


def tokenizer_loader(model: str) -> TokenizerLoader:
    """Loads the tokenizer of `model` (a worker's `InfoResponse.model`) when first called; the
    load is shared by every replica of the model (`load_tokenizer` caches it)."""
    return lambda: load_tokenizer(resolve_model(model))
