"""Prompt logprobs: how the model scored each prompt token it was given (the `prompt_logprobs`
sampling parameter), from a prefill's logits rows. Nothing is sampled."""

from __future__ import annotations

import torch

from llmserve.steps import PromptLogprob, TokenLogprob


def prompt_logprobs(
    logits: torch.Tensor,  # [num_positions, vocab] float32, row p predicts target p
    positions: list[int],
    targets: list[int],
    num_top: int,
) -> list[PromptLogprob]:
    """Logprob (and rank, and top `num_top`) of each target prompt token."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, device=logits.device)[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top_values: list[list[float]] = [[] for _ in targets]
    top_ids: list[list[int]] = [[] for _ in targets]
    if num_top:
        values, indices = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
        top_values, top_ids = values.tolist(), indices.tolist()
    return [
        PromptLogprob(
            position=pos,
            token=TokenLogprob(t, lp, rank),
            top=[TokenLogprob(i, v, r + 1) for r, (i, v) in enumerate(zip(ids, vs, strict=True))],
        )
        for pos, t, lp, rank, ids, vs in zip(
            positions, targets, chosen[:, 0].tolist(), ranks, top_ids, top_values, strict=True
        )
    ]
