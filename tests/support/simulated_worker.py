"""A simulated GPU worker for fleet tests and benchmarks (issue 30).

What is real: the Worker gRPC service (`worker_service.server.WorkerServicer`, Execute stream,
step chain, deferred masks), the step contract and the per-sequence bookkeeping
(`worker_service.sequence_state.SequenceStates`: frees, forks, new and cached sequences, the
sampled-token placeholder of asynchronous scheduling, block tables), and the fleet
membership (`tests.support.simulated_fleet` runs `worker_service.membership.LeaseKeeper`).
What is simulated: the forward pass is a wait from a step-time model (`StepTimeModel`), and
each sampled token is a function of the sequence's last token and length (`next_token`), so
the tokens of a request are known in advance (`expected_tokens`). Swaps and copies are
checked against the cache's block counts and counted; no K/V is stored. No torch is imported.

Never a serving mode: this lives under tests/, outside the installed packages, and no flag of
`llmserve` reaches it. The model it reports (`SIMULATED_MODEL`) is a path that does not exist,
so a scheduler's tokenizer warm-up fails at once without a hub lookup, and requests with stop
strings or grammars are refused by the scheduler; stop token ids, EOS and max_tokens are the
scheduler's business, as with a real worker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmserve.batch_limits import BatchLimits, GivenBatchLimits, adopt_batch_limits
from llmserve.steps import (
    PromptLogprob,
    SequenceOutput,
    StepInput,
    StepResult,
    TokenLogprob,
    TokenMask,
)
from worker_service.exports import Exports
from worker_service.model_info import ModelInfo
from worker_service.sequence_state import Scheduled, SequenceState, SequenceStates, StateError

SIMULATED_MODEL = "./simulated-llama-8b"
VOCAB_SIZE = 128256  # Llama 3's


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """A forward pass of `tokens` tokens takes `fixed_ms + per_token_ms * tokens`.

    Defaults: a Llama-3-8B-class model in bfloat16 on one H100. A step reads the 16 GB of
    weights once (~5 ms at 3.35 TB/s) plus launches and sampling: ~8 ms for a small decode
    batch, as published vLLM H100 decode latencies at batch 1 show (~125 tokens/s). Each
    token costs ~16 GFLOP (2 x 8e9 parameters): 0.02 ms at ~800 TFLOPS, the optimistic end
    of the H100's 989 TFLOPS dense bf16. Attention over long contexts is left out. A fast
    simulated GPU is the conservative choice here: the faster the workers, the larger the
    scheduler's share of each step."""

    fixed_ms: float = 8.0
    per_token_ms: float = 0.02

    def step_s(self, num_tokens: int) -> float:
        return (self.fixed_ms + self.per_token_ms * num_tokens) / 1000 if num_tokens else 0.0

    def ideal_decode_tokens_per_s(self, num_seqs: int) -> float:
        """Output tokens/s of one worker decoding `num_seqs` sequences back to back."""
        return num_seqs / self.step_s(num_seqs)


@dataclass(frozen=True, slots=True)
class SimulatedConfig:
    """What one simulated worker offers. 8192 blocks of 16 tokens hold 256 sequences of 512
    tokens (a real H100 with an 8B model holds ~30k)."""

    step_time: StepTimeModel = field(default_factory=StepTimeModel)
    num_gpu_blocks: int = 8192
    num_cpu_blocks: int = 1024
    block_size: int = 16
    max_model_len: int = 4096
    vocab_size: int = VOCAB_SIZE
    model: str = SIMULATED_MODEL
    mask_wait_timeout_s: float = 30.0


def next_token(last_token: int, length: int, seq_index: int, vocab_size: int = VOCAB_SIZE) -> int:
    """The token sampled after a sequence of `length` tokens whose last one is `last_token`
    (`seq_index` tells the sequences of one request apart)."""
    return (last_token * 7919 + length * 104729 + seq_index * 15485863 + 1) % vocab_size


def expected_tokens(prompt: list[int], num_tokens: int, seq_index: int = 0) -> list[int]:
    """The first `num_tokens` tokens a simulated worker generates after `prompt`."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens[-1], len(tokens), seq_index))
    return tokens[len(prompt) :]


def _logprob(token: int) -> float:
    return -(1 + token % 16) / 16


@dataclass
class SimulatedStats:
    """What a simulated worker did since the last reset."""

    steps: int = 0
    forward_s: float = 0.0  # simulated busy time
    # Of it, time past the step-time model's (the process's own scheduling of its threads).
    overshoot_s: float = 0.0
    tokens_computed: int = 0
    tokens_sampled: int = 0
    swapped_blocks: int = 0
    copied_blocks: int = 0
    # Forward end -> next forward start, ns, between consecutive steps that computed tokens:
    # what the scheduler (and this worker's own service) added to the step.
    gaps_ns: list[int] = field(default_factory=list)


class SimulatedWorker:
    """The part of `worker_service.worker.Worker` that `WorkerServicer` uses, without a model.
    `execute` runs on the servicer's model thread, like the real one."""

    def __init__(self, config: SimulatedConfig) -> None:
        self.config = config
        self.model_info = ModelInfo(
            model=config.model,
            architecture="SimulatedForCausalLM",
            dtype="bfloat16",
            device="simulated",
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            vocab_size=config.vocab_size,
            eos_token_id=None,
            eos_token_ids=(),
            attention_backend="simulated",
            linear_impl="simulated",
            weight_format="simulated",
        )
        self.runner = SequenceStates(config.block_size)
        # Exports are registered, but there is no K/V data: ReadBlocks answers NOT_FOUND for
        # them (a real peer's import fails). Imports report done at once, checked against the
        # cache: the simulated model's tokens do not depend on K/V, so a moved request
        # continues the same either way.
        self.exports = Exports()
        self.cache_engine = None
        self.batch_limits = BatchLimits()
        self.num_gpu_blocks = 0
        self.num_cpu_blocks = 0
        self.last_forward_ns: tuple[int, int] | None = None
        self.last_prepare_ns = 0  # no inputs to build
        self.stats = SimulatedStats()
        self._lock = threading.Lock()

    def group_blocks_used(self) -> list[int]:
        """Blocks in use by KV group: one group, counted from the sequences held."""
        return [len({b for state in self.runner.states.values() for b in state.block_ids})]

    @property
    def num_sequences(self) -> int:
        return len(self.runner.states)

    @property
    def num_state_slots(self) -> int:
        """No recurrent layers: no state slots."""
        return 0

    def batch_limits_for(self, sent: GivenBatchLimits) -> BatchLimits:
        """What a scheduler sends (no flags of its own pin them)."""
        return adopt_batch_limits(GivenBatchLimits(), sent)

    def use_batch_limits(self, limits: BatchLimits) -> tuple[int, int]:
        """Nothing is sized by them here: the blocks offered stay the config's."""
        self.batch_limits = limits
        self.initialize_cache(0, 0)
        return self.config.num_gpu_blocks, self.config.num_cpu_blocks

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        self.runner.states.clear()

    def take_stats(self) -> SimulatedStats:
        """The stats so far; counting starts again from zero."""
        with self._lock:
            stats, self.stats = self.stats, SimulatedStats()
        return stats

    def execute(
        self,
        step: StepInput,
        take_masks: Callable[[], tuple[list[TokenMask], int]] | None = None,
        passes_end: Callable[[], bool] | None = None,
    ) -> StepResult:
        """Bookkeeping and sampling happen inside the simulated forward pass's time; the step
        returns when that time is up. Multi-step runs take a pass more per placeholder draft
        (`llmserve.steps`), each timed on its own, and `passes_end()` is asked between them."""
        start = time.perf_counter_ns()
        runner = self.runner
        self.exports.apply(step)
        imported = self._check_imports(step)
        scheduled = runner.apply_updates(step)
        moved = self._check_moves(step)
        num_tokens = sum(s.count for s in scheduled)
        for s in scheduled:
            self._check_blocks(s)
            s.state.num_computed += s.count
        step_time = self.config.step_time
        end = start + int(step_time.step_s(num_tokens) * 1e9)
        result = StepResult(step.step_id, imported_transfer_ids=imported)
        if runner.masks_deferred:
            if take_masks is None:
                raise StateError(f"step {step.step_id} defers masks, and nothing delivers them")
            self._sleep_until(end)  # masks are awaited after the forward pass
            masks, result.mask_wait_ns = take_masks()
            runner.token_masks.update(((m.seq_id, m.row), m) for m in masks)
        result.outputs = [out for s in scheduled if (out := self._outputs(s)) is not None]
        pending = [s for s in scheduled if s.own_steps]
        last = result.outputs
        while pending:
            self._sleep_until(end)  # the pass before is done
            if passes_end is not None and passes_end():
                runner.end_passes(pending)
                break
            passing = runner.next_pass(pending, last)
            end += int(step_time.step_s(len(passing)) * 1e9)
            num_tokens += len(passing)
            last = []
            for one in passing:
                one.state.num_computed += 1
                out = self._outputs(one)
                assert out is not None, "a pass of multi-step decoding samples"
                last.append(out)
            result.outputs += last
            pending = [s for s in passing if s.own_steps]
        runner.remember_samples(scheduled, result)
        self._sleep_until(end)
        # The sleep's overshoot counts as forward time, so that the gaps are the service's.
        woke = time.perf_counter_ns()
        result.forward_ns = woke - start
        self._record(start, end, woke, num_tokens, result, moved)
        return result

    def _record(
        self,
        start: int,
        end: int,
        woke: int,
        num_tokens: int,
        result: StepResult,
        moved: tuple[int, int],
    ) -> None:
        with self._lock:
            stats = self.stats
            stats.steps += 1
            stats.swapped_blocks += moved[0]
            stats.copied_blocks += moved[1]
            if num_tokens:
                if self.last_forward_ns is not None:
                    stats.gaps_ns.append(start - self.last_forward_ns[1])
                stats.forward_s += (woke - start) / 1e9
                stats.overshoot_s += max(woke - end, 0) / 1e9
                stats.tokens_computed += num_tokens
                stats.tokens_sampled += sum(len(out.samples) for out in result.outputs)
        self.last_forward_ns = (start, woke) if num_tokens else None

    @staticmethod
    def _sleep_until(deadline_ns: int) -> None:
        left = deadline_ns - time.perf_counter_ns()
        if left > 0:
            time.sleep(left / 1e9)

    def _check_imports(self, step: StepInput) -> list[int]:
        for item in step.imports:
            if not all(0 <= b < self.num_gpu_blocks for b in item.block_ids):
                raise StateError(
                    f"step {step.step_id}: import {item.transfer_id} is outside the cache"
                )
        return [item.transfer_id for item in step.imports]

    def _check_moves(self, step: StepInput) -> tuple[int, int]:
        """Swap and copy maps must name blocks of this cache: (blocks swapped, copied)."""
        gpu, cpu = self.num_gpu_blocks, self.num_cpu_blocks
        for name, pairs, src_n, dst_n in (
            ("blocks_to_swap_out", step.blocks_to_swap_out, gpu, cpu),
            ("blocks_to_swap_in", step.blocks_to_swap_in, cpu, gpu),
            ("blocks_to_copy", step.blocks_to_copy, gpu, gpu),
        ):
            for src, dst in pairs:
                if not (0 <= src < src_n and 0 <= dst < dst_n):
                    raise StateError(
                        f"step {step.step_id}: {name} pair {src} -> {dst} is outside the cache"
                    )
        swapped = len(step.blocks_to_swap_out) + len(step.blocks_to_swap_in)
        return swapped, len(step.blocks_to_copy)

    def _check_blocks(self, s: Scheduled) -> None:
        """The blocks this step writes K/V into exist (as the real runner checks)."""
        bs, table = self.config.block_size, s.state.block_ids
        for block in table[s.start // bs : (s.start + s.count - 1) // bs + 1]:
            if not 0 <= block < self.num_gpu_blocks:
                raise StateError(
                    f"seq {s.state.seq_id}: block id {block} is outside the cache "
                    f"({self.num_gpu_blocks} blocks)"
                )

    def _outputs(self, s: Scheduled) -> SequenceOutput | None:
        state = s.state
        self._prompt_logprobs(s)
        if not s.samples:
            return None
        params, tokens = state.params, state.token_ids
        last, length, vocab = tokens[-1], len(tokens), self.config.vocab_size
        mask = self.runner.token_masks.get((state.seq_id, 0))  # it samples row 0 only
        allowed = None if mask is None else mask.allowed_ids()
        if params.use_beam_search:
            base = next_token(last, length, 0, vocab)
            cands = [(base + 3 * j) % vocab for j in range(2 * params.num_sampled)]
            if allowed is not None:
                cands = allowed[: 2 * params.num_sampled]
            samples = [TokenLogprob(t, -(j + 1) / 8, j + 1) for j, t in enumerate(cands)]
        elif length == state.num_prompt_tokens and params.num_sampled > 1:
            samples = [self._sample(last, length, i, allowed) for i in range(params.num_sampled)]
        else:
            samples = [self._sample(last, length, state.seq_index, allowed)]
        top: list[TokenLogprob] = []
        if params.logprobs:
            first = samples[0].token_id
            top = [
                TokenLogprob((first + j) % vocab, _logprob(first) - j, j + 1)
                for j in range(params.logprobs)
            ]
        out = SequenceOutput(state.seq_id, samples, top, state.pending_prompt_logprobs)
        state.pending_prompt_logprobs = []
        return out

    def _sample(
        self, last: int, length: int, index: int, allowed: list[int] | None
    ) -> TokenLogprob:
        token = next_token(last, length, index, self.config.vocab_size)
        if allowed is not None:
            token = allowed[token % len(allowed)]
        return TokenLogprob(token, _logprob(token), 1)

    def _prompt_logprobs(self, s: Scheduled) -> None:
        """Prompt positions computed in this step, from the first prefill only (as the real
        runner does: position p is scored by the logits of p - 1)."""
        state: SequenceState = s.state
        k = state.params.prompt_logprobs
        if k is None or len(state.token_ids) != state.num_prompt_tokens:
            return
        last = min(s.start + s.count, state.num_prompt_tokens - 1)
        for pos in range(s.start + 1, last + 1):
            token = state.token_ids[pos]
            top = [
                TokenLogprob((token + j) % self.config.vocab_size, _logprob(token) - j, j + 1)
                for j in range(k)
            ]
            state.pending_prompt_logprobs.append(
                PromptLogprob(pos, TokenLogprob(token, _logprob(token), 1), top)
            )
