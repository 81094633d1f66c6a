"""The engine's configuration (its step budgets, its KV cache): frozen, validated once, passed down
explicitly."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from llmserve.batch_limits import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from llmserve.config_flags import flag
from llmserve.errors import FieldError


class ConfigError(FieldError):
    """A configuration value is invalid: the one FieldError shape (`field`, `detail`)."""


class PreemptionMode(Enum):
    # Free the blocks and prefill the sequence again later (cheap for one sequence).
    RECOMPUTE = "recompute"
    # Copy the blocks to host memory and back (keeps forked sequences' shared blocks).
    SWAP = "swap"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Budgets of one replica's iteration loop.

    `enable_chunked_prefill`: prompts are split across iterations and mixed with decodes
    (decodes first). When off, an iteration runs either whole prompts or decodes, prompts
    first (the prefill-first policy), and the step's token budget must fit `max_model_len`:
    unset, it does (`token_budget`); set, it must.
    `preemption_mode`: None picks RECOMPUTE for groups with one live sequence and SWAP for
    the others; a SWAP that the host swap space cannot take recomputes instead.
    `max_model_len`: the longest prompt + output. The worker's model and cache decide it: a
    replica takes its worker's (`with_worker_max_model_len`), and a value set here may only
    lower it. An engine needs it decided (in-process engines set it themselves).
    """

    # Sent to every worker at InitializeCache (llmserve.batch_limits).
    max_num_seqs: int = flag(
        DEFAULT_MAX_NUM_SEQS, "sequences one step may run; sent to every worker"
    )
    max_num_batched_tokens: int | None = flag(
        None,
        f"tokens one step may compute; sent to every worker (unset: "
        f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}, or without chunked prefill the larger of that "
        "and max_model_len)",
    )
    max_model_len: int | None = flag(
        None,
        "lower every worker's max_model_len to this (unset: the worker's, which its model and "
        "cache decide); a worker whose own is smaller is refused",
    )
    enable_chunked_prefill: bool = flag(True, "split long prompts across steps, mixed with decodes")
    preemption_mode: PreemptionMode | None = None
    # Structured output: where the grammar allows exactly one continuation, append its
    # tokens as inputs of the next step instead of sampling them one step at a time.
    enable_forced_tokens: bool = flag(
        True,
        "structured output: append the tokens a grammar forces as inputs of the next step "
        "instead of sampling them one at a time",
        name="forced_tokens",
    )
    # Asynchronous scheduling of constrained sequences while forced tokens are on. A forced
    # run that comes after a continuation was built costs its row one step
    # (scheduler_service.engine.pipelined_steps), so where grammars force often (JSON keys, tool
    # calls) the pipelined run took more steps and more time than the synchronous one
    # (bench/RESULTS.md, "Structured output: what the worker waits for"), while in long
    # strings nothing is forced and holding steps back only loses the pipeline. So a step is
    # not continued while one of its constrained sequences got forced tokens within its last
    # `forced_hold_tokens` tokens (the start of its output counts as forced); 0 continues
    # every step. Its masks overlap its forward pass either way. Without forced tokens
    # constrained steps are always continued.
    forced_hold_tokens: int = flag(
        8,
        "with forced tokens on, asynchronous scheduling does not continue a step while one of "
        "its constrained sequences got forced tokens within its last this many tokens "
        "(0: always continue)",
    )
    # Milliseconds a grammar may take to compile on the scheduler, from the request's
    # arrival: past it the request ends with RESOURCE_EXHAUSTED naming the field and
    # --max-grammar-compile-ms (scheduler_service.engine.grammar_requests). The gateway's
    # admission check (--max-grammar-check-ms) refuses most slow grammars before this.
    max_grammar_compile_ms: int = flag(
        10_000,
        "structured output: a grammar still compiling this long after its request arrived "
        "ends the request with 429 (the replica waits for it at most this long)",
    )
    # Speculative decoding (scheduler_service.engine.speculation): up to this many n-gram drafts
    # per sequence and step, verified by the worker in the same pass; 0 turns it off.
    num_speculative_tokens: int = flag(
        0,
        "speculative decoding: up to this many n-gram drafts per sequence and step, verified "
        "by the worker in the same pass (0: off)",
    )
    # Prompt lookup matches the sequence's last ngram_max down to ngram_min tokens; a match
    # of n tokens drafts at most 2 (n - 1) (scheduler_service.engine.proposer).
    ngram_min: int = flag(2, "shortest suffix prompt lookup matches")
    ngram_max: int = flag(
        6,
        "longest suffix prompt lookup matches (a match of n tokens drafts at most 2 (n - 1) "
        "tokens)",
    )
    # Drafts are given while a step's sequences and drafts together stay within this many
    # rows: past a few rows a CPU step is compute-bound, and a draft row costs what a
    # sequence's row costs.
    speculative_max_batch: int = flag(
        16,
        "drafts are given while a step's sequences and drafts stay within this many rows",
    )
    # Drafts are given only to steps of at most this many sequences. Past one or two, a CPU
    # step is compute-bound and a draft row costs what a sequence's row costs: on the 2-core
    # CPU at 16 streams with 8 drafts, drafting as streams finished lowered the tokens/s, and
    # this limit did not (bench/RESULTS.md, "Speculative decoding, second round"). A GPU worker,
    # bound by its weight reads far longer, can take many more.
    speculative_max_seqs: int = flag(
        2,
        "drafts are given only to steps of at most this many sequences (on a CPU a step of "
        "more is compute-bound: raise it for a GPU worker)",
    )
    # Asynchronous scheduling continues a step with drafts by assuming they are all kept
    # (scheduler_service.engine.pipelined_steps). Off by default: on the 2-core CPU benchmark the
    # round trip it saves is CPU time the forward pass then loses, and the drafts of such a
    # step stand on a guessed token (code edits decoded slower with it: bench/RESULTS.md,
    # "Speculative decoding, second round"); it is meant for a worker whose forward pass runs
    # on a GPU.
    continue_after_drafts: bool = flag(
        False,
        "with asynchronous scheduling, build the step after one with drafts before its "
        "result, assuming every draft is kept (off: measured slower on a 2-core CPU)",
    )

    # Multi-step decoding (scheduler_service.engine.speculation): a decoding sequence computes
    # up to this many tokens in one step, the worker feeding each sample back in as the next
    # pass's token, so one round trip through the scheduler and the gateway serves several
    # tokens; where the worker shares its cores with them, their per-token work is time the
    # forward pass waits for (bench/RESULTS.md, "Multi-step decoding"). Only steps of at most
    # `decode_steps_max_seqs` sequences, and not where n-gram drafts are on (they take its
    # place). 1 turns it off.
    decode_steps: int = flag(
        8,
        "multi-step decoding: tokens a decoding sequence computes in one step, a forward pass "
        "each on the worker (1: off; n-gram speculation replaces it)",
    )
    decode_steps_max_seqs: int = flag(
        2,
        "multi-step decoding only for steps of at most this many sequences (past them the "
        "round trip is shared by the batch)",
    )

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", f"must be at least 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("max_model_len", f"must be at least 1, got {self.max_model_len}")
        if self.max_grammar_compile_ms < 1:
            raise ConfigError(
                "max_grammar_compile_ms", f"must be at least 1, got {self.max_grammar_compile_ms}"
            )
        if self.num_speculative_tokens < 0:
            raise ConfigError(
                "num_speculative_tokens",
                f"must be at least 0, got {self.num_speculative_tokens}",
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(
                "ngram_min",
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}",
            )
        if self.decode_steps < 1:
            raise ConfigError("decode_steps", f"must be at least 1, got {self.decode_steps}")
        if self.decode_steps_max_seqs < 1:
            raise ConfigError(
                "decode_steps_max_seqs", f"must be at least 1, got {self.decode_steps_max_seqs}"
            )
        if self.speculative_max_seqs < 1:
            raise ConfigError(
                "speculative_max_seqs", f"must be at least 1, got {self.speculative_max_seqs}"
            )
        if self.speculative_max_batch < 1:
            raise ConfigError(
                "speculative_max_batch",
                f"must be at least 1, got {self.speculative_max_batch}",
            )
        if self.forced_hold_tokens < 0:
            raise ConfigError(
                "forced_hold_tokens", f"must be at least 0, got {self.forced_hold_tokens}"
            )
        if self.token_budget < self.max_num_seqs:
            raise ConfigError(
                "max_num_batched_tokens",
                f"must be at least max_num_seqs ({self.max_num_seqs}), got {self.token_budget}",
            )
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.token_budget < self.max_model_len
        ):
            raise ConfigError(
                "max_num_batched_tokens",
                f"must be at least max_model_len ({self.max_model_len}) without chunked "
                f"prefill, got {self.token_budget}",
            )

    @property
    def token_budget(self) -> int:
        """Tokens one step may compute: `max_num_batched_tokens` where set; else the default,
        or without chunked prefill enough for a whole context once `max_model_len` is
        decided (as vLLM does)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill or self.max_model_len is None:
            return DEFAULT_MAX_NUM_BATCHED_TOKENS
        return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_model_len)

    @property
    def model_len(self) -> int:
        """`max_model_len`, decided (an engine refuses a config without it)."""
        if self.max_model_len is None:
            raise ConfigError("max_model_len", "not decided: a replica takes its worker's")
        return self.max_model_len

    def with_worker_max_model_len(self, worker_max_model_len: int) -> SchedulerConfig:
        """This config with `max_model_len` decided from the worker's (InfoResponse): the
        worker's, or ours when set and not larger. Raises ConfigError when ours is larger."""
        cap = self.max_model_len
        if cap is not None and cap > worker_max_model_len:
            raise ConfigError(
                "max_model_len",
                f"--max-model-len {cap} is more than the worker's model and cache allow "
                f"({worker_max_model_len}); it may only lower it",
            )
        return replace(self, max_model_len=worker_max_model_len if cap is None else cap)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """KV cache geometry as the scheduler sees it: block counts, not bytes."""

    block_size: int = 16
    num_gpu_blocks: int = 1024
    num_cpu_blocks: int = 512
    # Fraction of device blocks kept free when admitting prompts, so running sequences can
    # grow without preempting right away.
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    # The sliding window of each KV group (None: full attention), as the worker lays out its
    # layers (`llmserve.kv_layout`); one full group by default.
    kv_windows: tuple[int | None, ...] = (None,)
    # State slots of the recurrent layers (`scheduler_service.engine.state_slots`), as the
    # worker allocated them; 0 for a model without recurrent layers.
    num_state_slots: int = 0

    def __post_init__(self) -> None:
        if not self.kv_windows:
            raise ConfigError("kv_windows", "needs at least one KV group")
        if self.block_size < 1:
            raise ConfigError("block_size", f"must be at least 1, got {self.block_size}")
        if self.num_gpu_blocks < 1:
            raise ConfigError("num_gpu_blocks", f"must be at least 1, got {self.num_gpu_blocks}")
        if self.num_cpu_blocks < 0:
            raise ConfigError("num_cpu_blocks", f"must be >= 0, got {self.num_cpu_blocks}")
        if self.num_state_slots < 0:
            raise ConfigError("num_state_slots", f"must be >= 0, got {self.num_state_slots}")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError("watermark", f"must be in [0, 1), got {self.watermark}")
