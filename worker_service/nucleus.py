"""Top-k and top-p (nucleus) filtering for the sampler, by partial top-k over the vocabulary
rather than a sort of it."""

from __future__ import annotations

import torch

# Tokens ranked for a top-p row before wider tries: the nucleus of a trained model's
# next-token distribution is nearly always within the first, often within the second. Each
# row that one leaves short is ranked again at the next (and at last over the whole
# vocabulary), alone, so neither its result nor the other rows' depends on these guesses.
_NUCLEUS_GUESSES = (256, 4096)


def top_k_top_p(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    top_k: list[int],
    top_p: list[float],
) -> torch.Tensor:  # [num_rows, vocab] float32, filtered tokens at -inf
    """Keep each row's top_k best tokens (0 = all), then the fewest best of those whose
    probability (renormalized over them) reaches top_p. Rows are ranked by partial top-k,
    `_NUCLEUS_GUESSES` wide and then over the whole vocabulary, each until its top_k, or its
    nucleus, ends inside the ranked tokens; rows with neither keep every token."""
    vocab = logits.shape[-1]
    k = [t if 0 < t < vocab else vocab for t in top_k]
    out = logits.clone()
    todo = [i for i in range(len(k)) if k[i] < vocab or top_p[i] < 1.0]
    for guess in (*_NUCLEUS_GUESSES, vocab):
        if not todo:
            break
        width = min(guess, vocab)
        filtered, exact = _filter_prefix(
            logits[todo], [k[i] for i in todo], [top_p[i] for i in todo], width
        )
        done = [i for i, ok in zip(todo, exact, strict=True) if ok]
        if done:
            rows = torch.tensor(done, device=logits.device)
            out[rows] = filtered[torch.tensor(exact, device=logits.device)]
        todo = [i for i, ok in zip(todo, exact, strict=True) if not ok]
    return out


def _filter_prefix(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    top_k: list[int],  # each in [1, vocab]
    top_p: list[float],
    width: int,
) -> tuple[torch.Tensor, list[bool]]:  # [num_rows, vocab]; whether each row is exact
    """The rows filtered from their best `width` tokens, and which of them that decided:
    those whose top_k is at most `width`, or, without a top_k, whose nucleus is inside."""
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
    exact = (k <= width) | ((k == vocab) & (cumulative[:, -1:] >= p))
    # Drop a token when the tokens before it already reach top_p (the first one always stays).
    best = best.masked_fill((cumulative - probs) >= p, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(1, order, best)
    return filtered, exact[:, 0].tolist()
