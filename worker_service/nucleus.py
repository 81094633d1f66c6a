"""Top-k and top-p (nucleus) filtering for the sampler, by a partial top-k over the
vocabulary rather than a sort of it."""

from __future__ import annotations

import torch

# Tokens looked at first for top-p alone: the nucleus of a trained model's next-token
# distribution is nearly always far smaller. A row whose nucleus is wider falls back to
# sorting the whole vocabulary, so the result does not depend on this guess.
_NUCLEUS_GUESS = 256


def top_k_top_p(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    top_k: list[int],
    top_p: list[float],
) -> torch.Tensor:  # [num_rows, vocab] float32, filtered tokens at -inf
    """Keep each row's top_k best tokens (0 = all), then the fewest best of those whose
    probability (renormalized over them) reaches top_p. Only the best `width` tokens are
    ranked (a partial top-k, not a sort of the vocabulary): every row's top_k when all rows
    have one, else a guess at the nucleus, checked, with a full sort when it falls short."""
    vocab = logits.shape[-1]
    k = [t if 0 < t < vocab else vocab for t in top_k]
    width = max(k)
    if width == vocab and any(p < 1.0 for p in top_p):
        width = min(vocab, _NUCLEUS_GUESS)
    filtered = _filter_prefix(logits, k, top_p, width)
    if filtered is None:
        filtered = _filter_prefix(logits, k, top_p, vocab)
        assert filtered is not None
    return filtered


def _filter_prefix(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    top_k: list[int],  # each in [1, vocab]
    top_p: list[float],
    width: int,
) -> torch.Tensor | None:  # [num_rows, vocab], or None when `width` is too narrow
    vocab = logits.shape[-1]
    device = logits.device
    best, order = logits.topk(width, dim=-1)  # [num_rows, width], best first
    k = torch.tensor(top_k, device=device)[:, None]
    ranks = torch.arange(width, device=device)[None, :]
    best = best.masked_fill(ranks >= k, float("-inf"))
    # Probabilities over each row's top_k tokens: rows without a top_k (k == vocab) are
    # normalized over the whole vocabulary, so the prefix holds only part of their mass.
    norm = torch.where(
        k[:, 0] <= width, best.logsumexp(dim=-1), logits.logsumexp(dim=-1)
    )  # [num_rows]
    probs = (best - norm[:, None]).exp()
    cumulative = probs.cumsum(dim=-1)
    p = torch.tensor(top_p, device=device)[:, None]
    if width < vocab:
        # Exact only where top_k ends inside the prefix, or, without a top_k, the nucleus.
        inside = (k <= width) | ((k == vocab) & (cumulative[:, -1:] >= p))
        if not bool(inside.all()):
            return None
    # Drop a token when the tokens before it already reach top_p (the first one always stays).
    best = best.masked_fill((cumulative - probs) >= p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, best)
