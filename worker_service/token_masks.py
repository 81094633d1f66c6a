"""The scheduler's token masks (structured output) as one boolean matrix over the logits.

Built with numpy for every masked row of a step at once: a row's ids become one index array,
so a deny list of a few hundred ids (free text inside a JSON string) costs one vectorized
assignment rather than a Python list turned into a tensor index. On SmolLM2's vocabulary
this is quicker than the rows one at a time in torch (bench/RESULTS.md, "Figures moved out of
code comments"; the whole masked sampling step: "Structured output through the stack").
"""

from __future__ import annotations

import numpy as np

from llmserve.steps import MaskKind, TokenMask


def refused_matrix(masks: list[TokenMask], vocab: int) -> np.ndarray:  # [len(masks), vocab]
    """True where row i's mask refuses a token of the model's `vocab` logits (tokens at or
    above a mask's own `vocab_size`, a padded vocabulary's tail, are refused). A mask that
    allows nothing is a scheduler bug: refused with ValueError rather than turned into NaNs."""
    refused = np.ones((len(masks), vocab), dtype=np.bool_)
    for i, mask in enumerate(masks):
        limit = min(mask.vocab_size, vocab)
        row = refused[i]
        if mask.kind == MaskKind.ALLOW:
            ids = np.asarray(mask.token_ids, dtype=np.int64)
            row[ids[ids < limit]] = False
        elif mask.kind == MaskKind.DENY:
            row[:limit] = False
            ids = np.asarray(mask.token_ids, dtype=np.int64)
            row[ids[ids < limit]] = True
        else:
            bits = np.unpackbits(np.frombuffer(mask.bitmap, dtype=np.uint8), bitorder="little")
            n = min(limit, bits.shape[0])
            row[:n] = bits[:n] == 0
    empty = np.flatnonzero(refused.all(axis=1))
    if empty.size:
        raise ValueError(f"the token mask of seq {masks[int(empty[0])].seq_id} allows no token")
    return refused
