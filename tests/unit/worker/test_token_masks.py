"""worker_service.token_masks: every mask encoding as rows of one refused-token matrix."""

from __future__ import annotations

import numpy as np
import pytest

from llmserve.steps import MaskKind, TokenMask
from worker_service.token_masks import refused_matrix


def _bitmap(allowed: set[int], vocab: int) -> bytes:
    data = bytearray((vocab + 7) // 8)
    for t in allowed:
        data[t // 8] |= 1 << (t % 8)
    return bytes(data)


def test_each_encoding_refuses_exactly_what_it_does_not_allow() -> None:
    vocab = 20
    masks = [
        TokenMask(1, MaskKind.ALLOW, vocab, token_ids=[3, 17]),
        TokenMask(2, MaskKind.DENY, vocab, token_ids=[0, 5, 19]),
        TokenMask(3, MaskKind.BITMAP, vocab, bitmap=_bitmap({2, 9, 10}, vocab)),
    ]
    refused = refused_matrix(masks, vocab)
    assert refused.shape == (3, vocab) and refused.dtype == np.bool_
    assert set(np.flatnonzero(~refused[0])) == {3, 17}
    assert set(np.flatnonzero(refused[1])) == {0, 5, 19}
    assert set(np.flatnonzero(~refused[2])) == {2, 9, 10}


def test_tokens_past_the_masks_vocabulary_are_refused() -> None:
    # The model pads its vocabulary to 24 logits; the tokenizer's masks cover 20 tokens.
    masks = [
        TokenMask(1, MaskKind.DENY, 20, token_ids=[4]),
        TokenMask(2, MaskKind.ALLOW, 20, token_ids=[1, 22]),  # 22: beyond the mask's vocab
        TokenMask(3, MaskKind.BITMAP, 20, bitmap=_bitmap({0, 19}, 24)),
    ]
    refused = refused_matrix(masks, 24)
    assert set(np.flatnonzero(~refused[0])) == set(range(20)) - {4}
    assert set(np.flatnonzero(~refused[1])) == {1}
    assert set(np.flatnonzero(~refused[2])) == {0, 19}


def test_a_mask_that_allows_nothing_is_refused_by_seq_id() -> None:
    masks = [
        TokenMask(7, MaskKind.ALLOW, 10, token_ids=[2]),
        TokenMask(8, MaskKind.ALLOW, 10, token_ids=[12]),  # only a token past the vocab
    ]
    with pytest.raises(ValueError, match="seq 8 allows no token"):
        refused_matrix(masks, 10)
