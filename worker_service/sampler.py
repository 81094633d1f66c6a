"""Turns logits into tokens, vectorized over the batch.

Per row (one sequence that samples this step) the pipeline is: raw log-softmax (what logprobs
report) -> the grammar's token mask (structured output: disallowed tokens get -inf) ->
min-tokens EOS suppression -> repetition / frequency / presence penalties ->
greedy argmax | beam candidates (top 2 x width) | temperature, top-k, top-p, min-p, then a
draw from `probs`: for unseeded rows one uniform per sample placed on the cumulative
distribution (inverse CDF), for seeded rows an exponential race (see `_sample_random`). Top-k /
top-p rank only the best few hundred tokens (a partial top-k) unless a row's nucleus is wider;
at batch 1 a draw costs a fraction of a millisecond.

Seeded rows draw from a stream derived from (seed, seq_index, number of tokens so far), so a
seeded sequence samples the same token whatever else is in the batch and whichever step it
runs in. At a request's first sample with best_of > 1, sample j uses seq_index j: the same
stream sequence j would have used.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmserve.sampling_params import SamplingParams
from llmserve.steps import TokenLogprob, TokenMask
from llmserve_kernels import cpu as cpu_kernels
from llmserve_kernels.cpu.decode import ArgmaxLogprobs
from worker_service.nucleus import top_k_top_p
from worker_service.token_masks import refused_matrix

_MASK64 = (1 << 64) - 1
# Logits up to which the CPU sampler runs on one thread (`Sampler.sample`): beyond, torch's
# threads pay for themselves.
_ONE_THREAD_ELEMENTS = 1 << 18


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_seed(seed: int, seq_index: int, num_tokens: int) -> int:
    """Seed of the random stream for one draw of one sequence (63 bits, for torch)."""
    return _splitmix64(_splitmix64(_splitmix64(seed) ^ seq_index) ^ num_tokens) >> 1


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence that samples."""

    params: SamplingParams
    seq_index: int
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    # The tokens it may sample (structured output); None: any.
    token_mask: TokenMask | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def suppresses_stops(self) -> bool:
        """Below min_tokens: its stop tokens (and EOS) cannot be sampled."""
        return self.num_output_tokens < self.params.min_tokens

    @property
    def penalized(self) -> bool:
        p = self.params
        return (
            p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        )

    @property
    def masked_greedy(self) -> bool:
        """Takes the best token its mask (if any) allows and reports that token's logprob
        alone: nothing else adjusts its logits."""
        p = self.params
        return (
            p.is_greedy
            and not p.use_beam_search
            and not p.logprobs
            and not self.suppresses_stops
            and not self.penalized
        )

    @property
    def plain_greedy(self) -> bool:
        """Takes the argmax of its raw logits and reports that token's logprob alone."""
        return self.masked_greedy and self.token_mask is None

    @property
    def num_samples(self) -> int:
        if self.params.use_beam_search:
            return 2 * self.params.num_sampled
        return self.params.num_sampled if self.num_output_tokens == 0 else 1


@dataclass(slots=True)
class SampleResult:
    samples: list[TokenLogprob]
    top_logprobs: list[TokenLogprob]


class Sampler:
    """Vectorized sampler; `seed` drives the stream of requests that bring no seed."""

    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        seed: int = 0,
        native_reductions: bool = False,
    ) -> None:
        """`native_reductions`: argmax and log-sum-exp by llmserve_kernels.cpu (CPU logits only)."""
        self.vocab_size = vocab_size
        self.native_reductions = native_reductions
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator().manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,  # [num_rows, vocab] in the model dtype
        rows: list[SamplingRow],
        argmax: ArgmaxLogprobs | None = None,  # of these logits, when the forward found them
    ) -> list[SampleResult]:
        """Arithmetic is float32. With native reductions bfloat16 logits are read as they are
        (a greedy batch never copies them to float32); other paths convert what they use.
        On a CPU, for up to `_ONE_THREAD_ELEMENTS` logits, torch's operations here run on the
        calling thread: over a few rows of the vocabulary, waking torch's other threads costs
        more than they save (bench/RESULTS.md, "Sampling on the CPU")."""
        if logits.device.type != "cpu" or logits.numel() > _ONE_THREAD_ELEMENTS:
            return self._sample(logits, rows, argmax)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._sample(logits, rows, argmax)
        finally:
            torch.set_num_threads(threads)

    def _sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        argmax: ArgmaxLogprobs | None,
    ) -> list[SampleResult]:
        # The usual decode step: each row's token is its argmax, of rank 1 and logprob
        # max - log-sum-exp, so nothing more reads the logits (at batch 1 quicker than the
        # general path's indexing, and quicker again when the forward found them:
        # bench/RESULTS.md, "Figures moved out of code comments").
        plain_greedy = all(r.plain_greedy for r in rows)
        if plain_greedy and argmax is not None:
            return _argmax_results(argmax)
        # Raw logprobs are logits - logsumexp: only the entries reported are ever formed.
        if self.native_reductions:
            if not plain_greedy and all(r.masked_greedy for r in rows):
                return self._masked_greedy(logits.contiguous(), rows)
            best_token, lse, top = cpu_kernels.argmax_logsumexp(logits)  # [num_rows] each
            if plain_greedy:
                return _argmax_results(ArgmaxLogprobs(best_token.tolist(), (top - lse).tolist()))
        else:
            logits = logits.float()
            best_token, lse = logits.argmax(dim=-1), torch.logsumexp(logits, dim=-1)
        adjusted = self._adjust_logits(logits, rows)
        tokens: list[list[int]] = [[] for _ in rows]
        greedy = [
            i for i, r in enumerate(rows) if r.params.is_greedy and not r.params.use_beam_search
        ]
        beam = [i for i, r in enumerate(rows) if r.params.use_beam_search]
        random = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if greedy:
            if adjusted is logits:  # nothing changed the logits: reuse their argmax
                greedy_tokens = best_token[greedy] if len(greedy) < len(rows) else best_token
            else:
                chosen = adjusted if len(greedy) == len(rows) else adjusted[greedy]
                # Native reductions: faster than torch's argmax on a CPU (bench/RESULTS.md,
                # "Figures moved out of code comments").
                if self.native_reductions:
                    greedy_tokens = cpu_kernels.argmax_logsumexp(chosen)[0]
                else:
                    greedy_tokens = chosen.argmax(dim=-1)
            for i, t in zip(greedy, greedy_tokens.tolist(), strict=True):
                tokens[i] = [t]
        if beam:
            width2 = max(rows[i].num_samples for i in beam)
            beam_logits = adjusted[beam].float()
            beam_top = torch.log_softmax(beam_logits, dim=-1).topk(width2, dim=-1)
            ranked, scores = beam_top.indices.tolist(), beam_top.values.tolist()
            for i, cands, vals in zip(beam, ranked, scores, strict=True):
                cands = cands[: rows[i].num_samples]
                if rows[i].token_mask is not None:
                    # Fewer allowed tokens than candidates: the rest would be masked ones.
                    cands = [t for t, v in zip(cands, vals, strict=False) if v != float("-inf")]
                tokens[i] = cands
        if random:
            for i, drawn in zip(
                random,
                self._sample_random(adjusted[random].float(), [rows[i] for i in random]),
                strict=True,
            ):
                tokens[i] = drawn
        return self._with_logprobs(logits, lse, best_token, rows, tokens)

    def _masked_greedy(
        self,
        logits: torch.Tensor,  # [num_rows, vocab] CPU, in the model dtype
        rows: list[SamplingRow],
    ) -> list[SampleResult]:
        """Greedy rows, some under token masks (structured output), with nothing else to
        apply: each row's best allowed token with its raw logprob and rank, by native passes
        over the logits, quicker than copying and filling the logits for the general path
        (bench/RESULTS.md, "Figures moved out of code comments")."""
        vocab = logits.shape[-1]
        masked = [i for i, r in enumerate(rows) if r.token_mask is not None]
        refused = np.zeros((len(rows), vocab), dtype=np.bool_)
        refused[masked] = refused_matrix([rows[i].token_mask for i in masked], vocab)  # type: ignore[misc]
        chosen, ranks = cpu_kernels.masked_argmax(logits, torch.from_numpy(refused))
        _, lse, _ = cpu_kernels.argmax_logsumexp(logits)
        logprobs = (logits.gather(1, chosen[:, None])[:, 0].float() - lse).tolist()
        return [
            SampleResult([TokenLogprob(t, lp, rank)], [])
            for t, lp, rank in zip(chosen.tolist(), logprobs, ranks.tolist(), strict=True)
        ]

    def _adjust_logits(
        self,
        logits: torch.Tensor,  # [num_rows, vocab]
        rows: list[SamplingRow],
    ) -> torch.Tensor:  # [num_rows, vocab]: `logits` itself, or a float32 copy
        """Token masks, min-tokens EOS suppression and repetition/frequency/presence
        penalties."""
        vocab = self.vocab_size
        masked = [(i, r.token_mask) for i, r in enumerate(rows) if r.token_mask is not None]
        suppress = [(i, r) for i, r in enumerate(rows) if r.suppresses_stops]
        penalized = [i for i, r in enumerate(rows) if r.penalized]
        if not suppress and not penalized and not masked:
            return logits
        logits = logits.to(torch.float32, copy=True)
        if masked:
            refused = torch.from_numpy(refused_matrix([m for _, m in masked], logits.shape[-1]))
            refused = refused.to(logits.device)  # [num_masked, vocab]
            if len(masked) == len(rows):
                logits.masked_fill_(refused, float("-inf"))
            else:
                index = torch.tensor([i for i, _ in masked], device=logits.device)
                logits[index] = logits[index].masked_fill_(refused, float("-inf"))
        for i, r in suppress:
            stops = list(r.params.stop_token_ids) + (
                [] if r.params.ignore_eos else list(self.eos_token_ids)
            )
            logits[i, [t for t in stops if t < vocab]] = float("-inf")
        if not penalized:
            return logits
        sub = logits[penalized]  # [num_penalized, vocab]
        prs = [rows[i] for i in penalized]
        output_counts = _token_counts(
            [r.token_ids[r.num_prompt_tokens :] for r in prs], vocab, sub.device
        )
        prompt_seen = (
            _token_counts([r.token_ids[: r.num_prompt_tokens] for r in prs], vocab, sub.device) > 0
        )
        rep = torch.tensor([r.params.repetition_penalty for r in prs], device=sub.device)[:, None]
        seen = prompt_seen | (output_counts > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        freq = torch.tensor([r.params.frequency_penalty for r in prs], device=sub.device)[:, None]
        pres = torch.tensor([r.params.presence_penalty for r in prs], device=sub.device)[:, None]
        sub = sub - freq * output_counts - pres * (output_counts > 0).float()
        logits[penalized] = sub
        return logits

    def _sample_random(
        self,
        logits: torch.Tensor,  # [num_random, vocab] float32, penalized
        rows: list[SamplingRow],
    ) -> list[list[int]]:
        device = logits.device
        temps = torch.tensor([r.params.temperature for r in rows], device=device)[:, None]
        scaled = logits / temps
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            scaled = top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1)  # [num_random, vocab]
        min_p = torch.tensor([r.params.min_p for r in rows], device=device)[:, None]
        if bool((min_p > 0).any()):
            probs = torch.where(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0, probs)
        # Rows without a seed: one uniform per sample from the shared stream, placed on the
        # cumulative distribution (the first token whose cumulative probability exceeds it; a
        # token of probability 0 is never picked). Cheap: one cumsum for the batch.
        # Rows with a seed: an exponential race, argmax(p / E) with one E per token from the
        # row's own stream. Both draw from `probs`, but the race's winner survives the last-bit
        # differences between a decode step and the recompute that continues a migrated or
        # restarted request elsewhere, where a CDF boundary does not: in a near-uniform row
        # its margin is one token's probability, and such rows flipped there.
        sample_rows: list[int] = []
        drawn: list[int] = []  # per sample; unseeded ones filled in below
        unseeded: list[int] = []
        for i, r in enumerate(rows):
            for j in range(r.num_samples):
                position = len(sample_rows)
                sample_rows.append(i)
                if r.params.seed is None:
                    unseeded.append(position)
                    drawn.append(0)
                    continue
                index = r.seq_index if r.num_samples == 1 else j
                gen = torch.Generator().manual_seed(
                    stream_seed(r.params.seed, index, len(r.token_ids))
                )
                race = torch.empty(probs.shape[1]).exponential_(generator=gen).to(device)
                drawn.append(int((probs[i] / race).argmax()))
        if unseeded:
            cdf = probs.cumsum(dim=-1)[[sample_rows[k] for k in unseeded]]  # [n, vocab]
            uniforms = torch.rand(len(unseeded), generator=self.generator).to(device)
            targets = uniforms[:, None] * cdf[:, -1:]
            picked = torch.searchsorted(cdf, targets, right=True)[:, 0]
            picked = picked.clamp_(max=cdf.shape[1] - 1)
            for position, token in zip(unseeded, picked.tolist(), strict=True):
                drawn[position] = token
        out: list[list[int]] = [[] for _ in rows]
        for i, t in zip(sample_rows, drawn, strict=True):
            out[i].append(t)
        return out

    def _with_logprobs(
        self,
        logits: torch.Tensor,  # [num_rows, vocab] raw, in the model dtype
        lse: torch.Tensor,  # [num_rows] float32, log-sum-exp of each row
        best_token: torch.Tensor,  # [num_rows] int64, each row's argmax
        rows: list[SamplingRow],
        tokens: list[list[int]],
    ) -> list[SampleResult]:
        flat_rows = [i for i, ts in enumerate(tokens) for _ in ts]
        flat_tokens = [t for ts in tokens for t in ts]
        device = logits.device
        row_index = torch.tensor(flat_rows, device=device)
        token_index = torch.tensor(flat_tokens, device=device)
        chosen_logit = logits[row_index, token_index].float()  # [num_samples]
        chosen = chosen_logit - lse[row_index]
        # Rank 1 needs no scan over the vocabulary; only other tokens count what beats them
        # (logprobs order as the logits do).
        ranks = [1] * len(flat_tokens)
        others = (token_index != best_token[row_index]).nonzero()[:, 0]
        if others.numel():
            beaten = (logits[row_index[others]].float() > chosen_logit[others, None]).sum(-1) + 1
            for i, r in zip(others.tolist(), beaten.tolist(), strict=True):
                ranks[i] = r
        chosen_list = chosen.tolist()
        want_top = [i for i, r in enumerate(rows) if r.params.logprobs]
        tops: dict[int, list[TokenLogprob]] = {}
        if want_top:
            # More alternatives than the vocabulary holds come back as all of it.
            k = min(max(rows[i].params.logprobs or 0 for i in want_top), logits.shape[-1])
            values, indices = logits[want_top].topk(k, dim=-1)
            values = values.float() - lse[want_top, None]
            for i, vs, ids in zip(want_top, values.tolist(), indices.tolist(), strict=True):
                n = rows[i].params.logprobs or 0
                tops[i] = [
                    TokenLogprob(t, v, rank + 1)
                    for rank, (t, v) in enumerate(zip(ids[:n], vs[:n], strict=True))
                ]
        results = [SampleResult([], tops.get(i, [])) for i in range(len(rows))]
        for i, t, lp, rank in zip(flat_rows, flat_tokens, chosen_list, ranks, strict=True):
            results[i].samples.append(TokenLogprob(t, lp, rank))
        return results


def _argmax_results(argmax: ArgmaxLogprobs) -> list[SampleResult]:
    return [
        SampleResult([TokenLogprob(t, logprob, 1)], [])
        for t, logprob in zip(argmax.tokens, argmax.logprobs, strict=True)
    ]


def _token_counts(
    token_lists: list[list[int]], vocab: int, device: torch.device
) -> torch.Tensor:  # [num_lists, vocab] float32
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), max(width, 1)), vocab, dtype=torch.int64)
    for i, ts in enumerate(token_lists):
        padded[i, : len(ts)] = torch.tensor(ts, dtype=torch.int64)
    counts = torch.zeros(len(token_lists), vocab + 1)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab].to(device)
