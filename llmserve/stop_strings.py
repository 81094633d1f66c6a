"""Stop strings over streamed text (the scheduler stops sequences with it, the gateway shapes
their text with it).

Text that could be the beginning of a stop string is held back until the next delta decides
it, so a client never sees the start of a stop string that is then cut off. A match is found
however the text was split into deltas (across token boundaries). The result does not depend
on the split: the stop string that completes first in the text wins (at the same end position,
the one that starts earlier, i.e. the longer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopCheck:
    """What to emit for one delta: `text` is safe to send; `stop` is the stop string that
    matched (the sequence is finished and nothing more must be sent), else None."""

    text: str
    stop: str | None = None


class StopStringMatcher:
    """Stop-string state of one sequence. Feed it the detokenizer's deltas in order."""

    def __init__(self, stop: Sequence[str], *, include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(dict.fromkeys(stop))  # dedupe, keep order
        self._include = include_stop_str_in_output
        self._pending = ""  # held back: a suffix that is a prefix of some stop string
        self.matched: str | None = None

    def copy(self) -> StopStringMatcher:
        """An independent copy (a forked beam continues from its parent's state)."""
        twin = StopStringMatcher.__new__(StopStringMatcher)
        twin._stops, twin._include = self._stops, self._include
        twin._pending, twin.matched = self._pending, self.matched
        return twin

    @property
    def held_back(self) -> str:
        return self._pending

    def feed(self, delta: str) -> StopCheck:
        if self.matched is not None:
            return StopCheck("", self.matched)
        if not self._stops:
            return StopCheck(delta)
        buffer = self._pending + delta
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            self.matched = stop
            self._pending = ""
            end = start + len(stop) if self._include else start
            return StopCheck(buffer[:end], stop)
        keep = self._partial_suffix_len(buffer)
        self._pending = buffer[len(buffer) - keep :] if keep else ""
        return StopCheck(buffer[: len(buffer) - keep])

    def flush(self) -> str:
        """The sequence ended for another reason: release the held-back text."""
        if self.matched is not None:
            return ""
        text, self._pending = self._pending, ""
        return text

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _partial_suffix_len(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:k]):
                    longest = k
                    break
        return longest
