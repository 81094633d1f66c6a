"""A matcher's bitmask as the smallest `TokenMask` encoding a step can carry."""

from __future__ import annotations

import numpy as np

from llmserve.steps import MaskKind, TokenMask

# Bytes per token id on the wire in a packed repeated uint32 (a varint of a 50k-160k vocab
# id is 3 bytes).
_ID_BYTES = 3


def encode_mask(seq_id: int, bitmask: bytes, vocab_size: int) -> TokenMask:
    """ALLOW when few tokens are allowed (a JSON key, a digit), DENY when few are refused
    (free text inside a string), BITMAP otherwise."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:vocab_size]
    num_allowed = int(bits.sum())
    bitmap_bytes = (vocab_size + 7) // 8
    if num_allowed * _ID_BYTES <= bitmap_bytes and num_allowed <= vocab_size - num_allowed:
        return TokenMask(seq_id, MaskKind.ALLOW, vocab_size, np.flatnonzero(bits).tolist())
    num_denied = vocab_size - num_allowed
    if num_denied * _ID_BYTES <= bitmap_bytes:
        return TokenMask(seq_id, MaskKind.DENY, vocab_size, np.flatnonzero(bits == 0).tolist())
    return TokenMask(seq_id, MaskKind.BITMAP, vocab_size, bitmap=bytes(bitmask[:bitmap_bytes]))
