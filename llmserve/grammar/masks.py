"""A matcher's bitmask as the smallest `TokenMask` encoding a step can carry."""

from __future__ import annotations

import numpy as np

from llmserve.steps import MaskKind, TokenMask

# Bytes per token id on the wire in a packed repeated uint32 (a varint of a 50k-160k vocab
# id is 3 bytes).
_ID_BYTES = 3
# Set bits per byte value, where numpy has no bitwise_count (before 2.0; it is faster:
# bench/RESULTS.md, "Figures moved out of code comments").
_POPCOUNT8 = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).sum(axis=1)


def _popcount(words: np.ndarray) -> int:  # words: [num_words] uint32
    if hasattr(np, "bitwise_count"):
        return int(np.bitwise_count(words).sum())
    return int(_POPCOUNT8[words.view(np.uint8)].sum())


def encode_mask(seq_id: int, bitmask: bytes, vocab_size: int) -> TokenMask:
    """ALLOW when few tokens are allowed (a JSON key, a digit), DENY when few are refused
    (free text inside a string), BITMAP otherwise. Works on 32-bit words and unpacks only the
    words that hold listed ids: this runs per constrained row per step."""
    num_words = (vocab_size + 31) // 32
    words = np.frombuffer(bitmask, dtype=np.uint32, count=num_words).copy()  # [num_words]
    tail = vocab_size % 32
    if tail:
        words[-1] &= np.uint32((1 << tail) - 1)  # no token at or above vocab_size
    num_allowed = _popcount(words)
    bitmap_bytes = (vocab_size + 7) // 8
    if num_allowed * _ID_BYTES <= bitmap_bytes and num_allowed <= vocab_size - num_allowed:
        return TokenMask(seq_id, MaskKind.ALLOW, vocab_size, _set_bits(words))
    num_denied = vocab_size - num_allowed
    if num_denied * _ID_BYTES <= bitmap_bytes:
        denied = ~words
        if tail:
            denied[-1] &= np.uint32((1 << tail) - 1)
        return TokenMask(seq_id, MaskKind.DENY, vocab_size, _set_bits(denied))
    return TokenMask(seq_id, MaskKind.BITMAP, vocab_size, bitmap=words.tobytes()[:bitmap_bytes])


def _set_bits(words: np.ndarray) -> list[int]:  # words: [num_words] uint32
    """Indices of the set bits, ascending."""
    nonzero = np.flatnonzero(words)
    bits = np.flatnonzero(np.unpackbits(words[nonzero].view(np.uint8), bitorder="little"))
    return (nonzero[bits >> 5] * 32 + (bits & 31)).tolist()
