"""Incremental detokenization: token ids in, new text out, one sequence at a time.

Decoding the whole sequence at every token is quadratic; decoding one token at a time is
wrong (a byte-level BPE token may hold half a UTF-8 character, and SentencePiece drops a
token's leading space at the start of a decode). So, as TGI and vLLM do, each step decodes a
small window twice: `ids[prefix:read]` (text already emitted, decoded with a few tokens of
context) and `ids[prefix:]`; the difference is the new text. While the window's text ends in
U+FFFD the character is incomplete: nothing is emitted and the window grows until it completes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as context before the first output token (enough for SentencePiece's
# leading-space handling and for a character split across the prompt/output boundary).
PROMPT_CONTEXT_TOKENS = 5

Decode = Callable[[list[int], bool], str]


def ids_decoder(tokenizer: Any) -> Decode:
    """`decode(ids, skip_special_tokens)` for `tokenizer`, without tokenization-space clean-up.

    A transformers tokenizer backed by the `tokenizers` library decodes in its Rust
    `Tokenizer`, which is what its own `decode` ends in after converting arguments: called
    directly it costs a fifth of the wrapper on a short window. A tokenizer whose class
    decodes its own way (a slow tokenizer, or one that overrides `decode` or `_decode`)
    goes through its `decode`."""
    backend = _plain_backend(tokenizer)
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)  # type: ignore[no-any-return]
    return lambda ids, skip: tokenizer.decode(  # type: ignore[no-any-return]
        ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
    )


def _plain_backend(tokenizer: Any) -> Any:
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast as TokenizersBackend
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and isinstance(backend, Tokenizer)
        and cls.decode is TokenizersBackend.decode
        and cls._decode is TokenizersBackend._decode
    ):
        return backend
    return None


class IncrementalDetokenizer:
    """Detokenizes one sequence's output. `add(ids)` returns the text those ids completed.

    `skip_ids`, when given, replaces `skip_special_tokens`: exactly those ids are left out,
    and every other token is decoded, special or not (a reasoning parser that reads some
    special tokens gets them, and no others)."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        skip_ids: frozenset[int] | None = None,
    ) -> None:
        self._decode = ids_decoder(tokenizer)
        self._skip_special_tokens = skip_special_tokens and skip_ids is None
        self._skip_ids = skip_ids
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._num_context = len(context)
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text_parts: list[str] = []

    def copy(self) -> IncrementalDetokenizer:
        """An independent copy (a forked beam continues from its parent's text)."""
        twin = IncrementalDetokenizer.__new__(IncrementalDetokenizer)
        twin.__dict__.update(self.__dict__)
        twin._ids = list(self._ids)
        twin._text_parts = list(self._text_parts)
        return twin

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text_parts)

    def _decode_ids(self, ids: list[int]) -> str:
        if self._skip_ids:
            ids = [t for t in ids if t not in self._skip_ids]
        return self._decode(ids, self._skip_special_tokens)

    def _prefix_text(self) -> str:
        text = self._decode_ids(self._ids[self._prefix_offset : self._read_offset])
        if self._read_offset == self._num_context:
            # Only prompt context so far. A prompt that ends mid-character (token-id prompts
            # can) decodes with a trailing U+FFFD that the output completes: the completed
            # character belongs to the output.
            return text.rstrip(REPLACEMENT_CHAR)
        return text

    def add(self, token_ids: Iterable[int]) -> str:
        """Append output tokens; return the new text (empty while a character is incomplete)."""
        self._ids.extend(token_ids)
        prefix_text = self._prefix_text()
        new_text = self._decode_ids(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text_parts.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back (an incomplete character
        decodes to U+FFFD, as a full decode would show it)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._prefix_text()
        new_text = self._decode_ids(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if delta:
            self._text_parts.append(delta)
        return delta
