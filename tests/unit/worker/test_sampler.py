"""Sampler: greedy, filters, penalties, seeded reproducibility, logprobs, beam candidates."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.sampling_params import SamplingParams
from llmserve.steps import MaskKind, TokenMask
from worker_service.nucleus import top_k_top_p
from worker_service.prompt_logprobs import prompt_logprobs
from worker_service.sampler import Sampler, SamplingRow

V = 10
EOS = 9


def logits_row(*values: float) -> list[float]:
    return list(values) + [0.0] * (V - len(values))


def row(
    params: SamplingParams, tokens: list[int] | None = None, prompt: int = 3, seq_index: int = 0
) -> SamplingRow:
    return SamplingRow(params, seq_index, tokens if tokens is not None else [1, 2, 3], prompt)


def sampler() -> Sampler:
    return Sampler(V, (EOS,), seed=0)


def test_greedy_picks_argmax_and_reports_raw_logprob_and_rank() -> None:
    logits = torch.tensor([logits_row(1.0, 3.0, 2.0)])
    (res,) = sampler().sample(logits, [row(SamplingParams(temperature=0.0, logprobs=2))])
    expected = torch.log_softmax(logits[0], -1)
    assert res.samples[0].token_id == 1
    assert res.samples[0].rank == 1
    assert math.isclose(res.samples[0].logprob, expected[1].item(), abs_tol=1e-6)
    assert [(t.token_id, t.rank) for t in res.top_logprobs] == [(1, 1), (2, 2)]
    assert math.isclose(res.top_logprobs[1].logprob, expected[2].item(), abs_tol=1e-6)


def test_top_k_top_p_min_p_reduce_to_argmax() -> None:
    logits = torch.tensor([logits_row(1.0, 3.0, 2.9)] * 3)
    rows = [
        row(SamplingParams(temperature=2.0, top_k=1, seed=1)),
        row(SamplingParams(temperature=2.0, top_p=0.01, seed=2)),
        row(SamplingParams(temperature=2.0, min_p=1.0, seed=3)),
    ]
    for _ in range(5):
        assert [r.samples[0].token_id for r in sampler().sample(logits, rows)] == [1, 1, 1]


def test_top_k_two_only_draws_the_two_best() -> None:
    logits = torch.tensor([logits_row(1.0, 3.0, 2.9)])
    s = sampler()
    drawn = {
        s.sample(logits, [row(SamplingParams(temperature=1.0, top_k=2))])[0].samples[0].token_id
        for _ in range(40)
    }
    assert drawn == {1, 2}


def test_seeded_sample_is_independent_of_batch_composition() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    params = SamplingParams(temperature=1.0, seed=1234)
    target = row(params, tokens=[4, 5, 6, 7], seq_index=2)
    alone = sampler().sample(logits[2:3], [target])[0].samples[0].token_id
    others = [row(SamplingParams(temperature=1.0)), row(SamplingParams(temperature=0.7, seed=9))]
    batched = sampler().sample(logits[[0, 2, 3]], [others[0], target, others[1]])
    assert batched[1].samples[0].token_id == alone
    # Over many draws the stream does depend on (seq_index, number of tokens).
    draws = {
        sampler()
        .sample(logits[2:3], [row(params, tokens=[4] * n, seq_index=i)])[0]
        .samples[0]
        .token_id
        for n in range(4, 12)
        for i in range(3)
    }
    assert len(draws) > 1


def test_best_of_first_sample_draws_what_each_child_would() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, V)
    params = SamplingParams(n=3, best_of=4, temperature=1.0, seed=77)
    (first,) = sampler().sample(logits, [row(params, tokens=[1, 2, 3], prompt=3)])
    assert len(first.samples) == 4
    # Sample j is the draw sequence j makes from the same seed and length.
    single = SamplingParams(temperature=1.0, seed=77)
    alone = [
        sampler()
        .sample(logits, [row(single, tokens=[1, 2, 3], prompt=3, seq_index=j)])[0]
        .samples[0]
        .token_id
        for j in range(4)
    ]
    assert [t.token_id for t in first.samples] == alone


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    logits = torch.tensor([logits_row(0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0)])
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4, stop_token_ids=(1,))
    (res,) = sampler().sample(logits, [row(params, tokens=[1, 2, 3, 4], prompt=3)])
    assert res.samples[0].token_id not in (EOS, 1)
    (res,) = sampler().sample(logits, [row(params, tokens=[1, 2, 3, 4, 5], prompt=3)])
    assert res.samples[0].token_id == EOS


def test_penalties_follow_their_definitions() -> None:
    s = sampler()
    logits = torch.tensor([logits_row(2.0, -2.0, 1.0, 1.0, 0.5)])
    # prompt [0], outputs [1, 2, 2]: repetition applies to 0, 1, 2; frequency/presence to 1, 2.
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    adjusted = s._adjust_logits(logits, [row(params, tokens=[0, 1, 2, 2], prompt=1)])
    expected = logits_row(1.0, -4.0 - 0.5 - 0.25, 0.5 - 1.0 - 0.25, 1.0, 0.5)
    torch.testing.assert_close(adjusted[0], torch.tensor(expected))


def test_beam_candidates_are_top_two_width_best_first() -> None:
    logits = torch.tensor([logits_row(0.1, 0.5, 0.3, 0.9, 0.2, 0.8)])
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0)
    (res,) = sampler().sample(logits, [row(params)])
    assert [t.token_id for t in res.samples] == [3, 5, 1, 2, 4, 0]
    assert [t.rank for t in res.samples] == [1, 2, 3, 4, 5, 6]


def test_prompt_logprobs_positions_targets_and_top() -> None:
    logits = torch.tensor([logits_row(1.0, 2.0), logits_row(3.0, 0.0, 1.0)])
    entries = prompt_logprobs(logits, positions=[1, 2], targets=[0, 2], num_top=1)
    lp = torch.log_softmax(logits, -1)
    assert [(e.position, e.token.token_id, e.token.rank) for e in entries] == [(1, 0, 2), (2, 2, 2)]
    assert math.isclose(entries[1].token.logprob, lp[1, 2].item(), abs_tol=1e-6)
    assert [(t.token_id, t.rank) for t in entries[0].top] == [(1, 1)]


def test_more_alternatives_than_the_vocabulary_returns_all_of_it() -> None:
    """The gateway's --max-logprobs may exceed a small model's vocabulary: the step must not
    fail for the other rows."""
    logits = torch.tensor([logits_row(1.0, 3.0, 2.0)] * 2)
    greedy = SamplingParams(temperature=0.0)
    wide, plain = sampler().sample(
        logits, [row(SamplingParams(temperature=0.0, logprobs=V + 5)), row(greedy)]
    )
    assert sorted(t.token_id for t in wide.top_logprobs) == list(range(V))
    assert [t.rank for t in wide.top_logprobs] == list(range(1, V + 1))
    assert plain.samples[0].token_id == 1 and plain.top_logprobs == []
    (entry,) = prompt_logprobs(logits[:1], positions=[1], targets=[0], num_top=V + 5)
    assert len(entry.top) == V


def test_bfloat16_logits_sample_as_their_float32_values() -> None:
    """bfloat16 logits (the model dtype) go to the sampler as they are; every path must give
    what the same values in float32 give (the conversion is exact)."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, V, generator=gen) * 3).bfloat16()
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=3)),
        row(SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=1), [1, 2, 3, 4]),
        row(SamplingParams(temperature=0.8, seed=7, logprobs=2)),
        row(SamplingParams(temperature=1.0, top_k=3, top_p=0.9, seed=8)),
        row(SamplingParams(temperature=0.0, min_tokens=5)),
        row(SamplingParams(temperature=0.0, use_beam_search=True, best_of=2, n=2)),
    ]
    for native in (True, False):
        got = Sampler(V, (EOS,), native_reductions=native).sample(logits, rows)
        want = Sampler(V, (EOS,), native_reductions=native).sample(logits.float(), rows)
        assert got == want, native


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_batch_of_plain_greedy_rows_samples_what_the_general_path_does(
    dtype: torch.dtype,
) -> None:
    """With native reductions a batch whose rows all take their argmax skips the general path
    (token, logprob and rank from the row reductions alone): its rows must get what they get
    beside a row that forces the general path, and what torch's path gives."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, V, generator=gen) * 3).to(dtype)
    logits[1, 2] = logits[1, 6] = 50.0  # a tie: the first index wins
    plain = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.0, logprobs=0)),
        row(SamplingParams(temperature=0.0, min_tokens=1), [1, 2, 3, 4]),  # min_tokens reached
    ]
    assert all(r.plain_greedy for r in plain)
    forcing = row(SamplingParams(temperature=0.0, logprobs=1))
    assert not forcing.plain_greedy
    native = Sampler(V, (EOS,), native_reductions=True)
    fast = native.sample(logits[:3], plain)
    general = native.sample(logits, [*plain, forcing])[:3]
    reference = Sampler(V, (EOS,)).sample(logits[:3], plain)
    assert fast == general
    assert [r.samples[0].token_id for r in fast] == logits[:3].float().argmax(-1).tolist()
    assert fast[1].samples[0].token_id == 2
    for got, want in zip(fast, reference, strict=True):
        assert (got.samples[0].token_id, got.samples[0].rank) == (
            want.samples[0].token_id,
            want.samples[0].rank,
        )
        assert math.isclose(got.samples[0].logprob, want.samples[0].logprob, abs_tol=1e-5)
        assert got.top_logprobs == want.top_logprobs == []


@pytest.mark.parametrize("seeded", [False, True])  # inverse CDF / exponential race
def test_draws_follow_the_distribution(seeded: bool) -> None:
    # p = softmax(log [0.5, 0.3, 0.15, 0.05]): counts of 4000 draws within 5 sigma of each.
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = torch.tensor([[math.log(p) for p in probs] + [-math.inf] * (V - 4)])
    s = sampler()
    counts = [0] * V
    for i in range(4000):
        params = SamplingParams(temperature=1.0, seed=i if seeded else None)
        counts[s.sample(logits, [row(params)])[0].samples[0].token_id] += 1
    assert sum(counts[4:]) == 0
    for token, p in enumerate(probs):
        sigma = math.sqrt(4000 * p * (1 - p))
        assert abs(counts[token] - 4000 * p) <= 5 * sigma, (token, counts)


def _sorted_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The tokens top-k then top-p keep, by their definition: sort the whole row."""
    order = logits.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    probs = torch.softmax(logits[kept], dim=-1).tolist()
    nucleus, mass = [], 0.0
    for token, p in zip(kept, probs, strict=True):
        if mass >= top_p:
            break
        nucleus.append(token)
        mass += p
    return set(nucleus)


def test_top_k_top_p_keep_the_same_tokens_whether_the_nucleus_is_narrow_or_wide() -> None:
    # 1000 tokens: a peaked row (nucleus inside the first ranked tokens), a flat one (the
    # nucleus is most of the vocabulary: the full-sort fallback), and top_k rows beside them.
    vocab = 1000
    gen = torch.Generator().manual_seed(3)
    peaked = torch.randn(vocab, generator=gen) * 6
    flat = torch.randn(vocab, generator=gen) * 0.1
    cases = [(peaked, 0, 0.9), (flat, 0, 0.9), (peaked, 50, 0.95), (flat, 600, 0.5)]
    s = Sampler(vocab, (EOS,), seed=0)
    for logits, top_k, top_p in cases:
        params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
        allowed = _sorted_top_k_top_p(logits, top_k, top_p)
        drawn = {s.sample(logits[None], [row(params)])[0].samples[0].token_id for _ in range(200)}
        assert drawn <= allowed, (top_k, top_p)
    # All four rows in one batch filter exactly as each does alone.
    batch = torch.stack([c[0] for c in cases])
    filtered = top_k_top_p(batch, [c[1] for c in cases], [c[2] for c in cases])
    for i, (logits, top_k, top_p) in enumerate(cases):
        kept = set(torch.isfinite(filtered[i]).nonzero()[:, 0].tolist())
        assert kept == _sorted_top_k_top_p(logits, top_k, top_p), i


def test_each_row_is_ranked_until_its_nucleus_fits_and_unfiltered_rows_keep_every_token() -> None:
    # 8192 tokens: nuclei inside the first guess, between the two guesses and beyond both,
    # a row with neither top_k nor top_p, and a top_k wider than the first guess.
    vocab = 8192
    gen = torch.Generator().manual_seed(5)
    scales = [8.0, 1.5, 0.05, 1.0, 1.0]
    rows = torch.stack([torch.randn(vocab, generator=gen) * s for s in scales])
    top_k, top_p = [0, 0, 0, 0, 1000], [0.9, 0.9, 0.9, 1.0, 0.8]
    widths = []
    for i in range(3):
        nucleus = _sorted_top_k_top_p(rows[i], 0, 0.9)
        widths.append(len(nucleus))
    assert widths[0] <= 256 < widths[1] <= 4096 < widths[2], widths
    filtered = top_k_top_p(rows, top_k, top_p)
    for i in (0, 1, 2, 4):
        kept = set(torch.isfinite(filtered[i]).nonzero()[:, 0].tolist())
        assert kept == _sorted_top_k_top_p(rows[i], top_k[i], top_p[i]), i
        finite = torch.isfinite(filtered[i])
        assert torch.equal(filtered[i][finite], rows[i][finite]), i
    assert torch.equal(filtered[3], rows[3])


# -- token masks (structured output) ---------------------------------------------------------


def masked(params: SamplingParams, mask: TokenMask) -> SamplingRow:
    return SamplingRow(params, 0, [1, 2, 3], 3, mask)


def bitmap_of(ids: list[int]) -> bytes:
    b = bytearray(4)
    for t in ids:
        b[t >> 3] |= 1 << (t & 7)
    return bytes(b)


@pytest.mark.parametrize(
    "mask",
    [
        TokenMask(0, MaskKind.ALLOW, V, [2, 5]),
        TokenMask(0, MaskKind.DENY, V, [0, 1, 3, 4, 6, 7, 8, 9]),
        TokenMask(0, MaskKind.BITMAP, V, bitmap=bitmap_of([2, 5])),
    ],
)
def test_every_mask_encoding_limits_greedy_and_random_draws(mask: TokenMask) -> None:
    logits = torch.tensor([logits_row(1.0, 9.0, 2.0, 8.0, 0.0, 1.5)])  # argmax 1, masked out
    (greedy,) = sampler().sample(logits, [masked(SamplingParams(temperature=0.0), mask)])
    assert greedy.samples[0].token_id == 2
    s = sampler()
    drawn = {
        s.sample(logits, [masked(SamplingParams(temperature=5.0), mask)])[0].samples[0].token_id
        for _ in range(60)
    }
    assert drawn == {2, 5}
    # Logprobs stay those of the raw distribution (as for every other adjustment).
    assert math.isclose(
        greedy.samples[0].logprob, torch.log_softmax(logits[0], -1)[2].item(), abs_tol=1e-6
    )


def test_mask_applies_before_penalties_and_top_k() -> None:
    # Token 1 is the best but masked; top_k=1 must then keep token 3 (the best allowed), not
    # drop every allowed token because the unmasked best was outside the mask.
    logits = torch.tensor([logits_row(1.0, 9.0, 2.0, 8.0)])
    mask = TokenMask(0, MaskKind.ALLOW, V, [2, 3])
    params = SamplingParams(temperature=1.0, top_k=1, repetition_penalty=1.5, seed=3)
    for _ in range(5):
        (res,) = sampler().sample(logits, [masked(params, mask)])
        assert res.samples[0].token_id == 3


def test_tokens_beyond_the_grammar_vocabulary_are_refused() -> None:
    # A model's padded vocabulary: the grammar knows 4 tokens, the logits have 10.
    logits = torch.tensor([logits_row(0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 9.0)])
    mask = TokenMask(0, MaskKind.DENY, 4, [])
    (res,) = sampler().sample(logits, [masked(SamplingParams(temperature=0.0), mask)])
    assert res.samples[0].token_id == 3


def test_a_mask_that_allows_nothing_is_refused() -> None:
    logits = torch.tensor([logits_row(1.0)])
    with pytest.raises(ValueError, match="allows no token"):
        sampler().sample(
            logits, [masked(SamplingParams(temperature=0.0), TokenMask(0, MaskKind.ALLOW, V, []))]
        )


@pytest.mark.parametrize("native_reductions", [False, True])
def test_masked_and_unmasked_rows_share_a_batch(native_reductions: bool) -> None:
    # The same logits in all three rows; only the middle one is masked (token 1, the best,
    # refused), and the raw logprob of what it draws is still reported.
    row = logits_row(1.0, 9.0, 2.0, 8.0)
    logits = torch.tensor([row, row, row])
    greedy = SamplingParams(temperature=0.0)
    rows = [
        SamplingRow(greedy, 0, [1, 2, 3], 3),
        masked(greedy, TokenMask(0, MaskKind.DENY, V, [1])),
        SamplingRow(greedy, 0, [1, 2, 3], 3),
    ]
    s = Sampler(V, (EOS,), seed=0, native_reductions=native_reductions)
    results = s.sample(logits, rows)
    assert [r.samples[0].token_id for r in results] == [1, 3, 1]
    raw = torch.log_softmax(logits[1], dim=-1)
    assert results[1].samples[0].logprob == pytest.approx(raw[3].item(), abs=1e-5)
    assert results[1].samples[0].rank == 2  # token 1 beats it in the raw logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_masked_greedy_rows_take_the_native_path_and_agree_with_the_general_one(
    dtype: torch.dtype,
) -> None:
    vocab = 300
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, vocab, generator=gen) * 4).to(dtype)
    allowed = [[7, 250], list(range(0, vocab, 3)), [299]]
    bits = bytearray((vocab + 7) // 8)
    for t in range(100, 200):
        bits[t >> 3] |= 1 << (t & 7)
    masks = [
        TokenMask(0, MaskKind.ALLOW, vocab, allowed[0]),
        TokenMask(1, MaskKind.DENY, vocab, [t for t in range(vocab) if t not in allowed[1]]),
        TokenMask(2, MaskKind.ALLOW, vocab, allowed[2]),
        TokenMask(3, MaskKind.BITMAP, vocab, bitmap=bytes(bits)),
        None,
        TokenMask(5, MaskKind.DENY, vocab, []),
    ]
    greedy = SamplingParams(temperature=0.0)
    rows = [SamplingRow(greedy, 0, [1, 2, 3], 3, m) for m in masks]
    native = Sampler(vocab, (EOS,), native_reductions=True)
    calls: list[int] = []
    masked_greedy = native._masked_greedy
    native._masked_greedy = lambda lg, rs: calls.append(len(rs)) or masked_greedy(lg, rs)  # type: ignore[method-assign]
    fast = native.sample(logits, rows)
    general = Sampler(vocab, (EOS,), native_reductions=False).sample(logits, rows)
    assert calls == [6]
    assert [r.samples[0].token_id for r in fast] == [r.samples[0].token_id for r in general]
    assert [r.samples[0].rank for r in fast] == [r.samples[0].rank for r in general]
    for f, g in zip(fast, general, strict=True):
        assert f.samples[0].logprob == pytest.approx(g.samples[0].logprob, abs=1e-4)
    assert fast[2].samples[0].token_id == 299 and fast[4].samples[0].rank == 1
    assert fast[0].samples[0].token_id in allowed[0]


def test_beam_candidates_under_a_mask_are_only_allowed_tokens() -> None:
    logits = torch.tensor([logits_row(1.0, 9.0, 2.0, 8.0)])
    params = SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0.0)
    row = SamplingRow(params, 0, [1, 2, 3], 3, TokenMask(0, MaskKind.ALLOW, V, [0, 2, 5]))
    (res,) = sampler().sample(logits, [row])
    # Four candidates wanted (2 x width), three tokens allowed, best first.
    assert [s.token_id for s in res.samples] == [2, 0, 5]
