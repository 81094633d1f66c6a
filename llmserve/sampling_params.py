"""Token-level sampling parameters, shared by the scheduler, the workers and the gateway.

Text-level options are not here: the gateway shapes the text, the scheduler matches stop
strings (they travel beside these parameters, in AddRequest), and workers see token ids only.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Literal

from llmserve.errors import FieldError

# Sampling with temperature below this is treated as greedy (argmax), as vLLM does.
GREEDY_EPSILON = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request. Validates itself on construction.

    `n` sequences are returned out of `best_of` sampled ones (by cumulative logprob). With
    `use_beam_search`, `best_of` is the beam width and sampling is deterministic.
    `top_k == 0` and `top_p == 1.0` and `min_p == 0.0` disable those filters.
    `logprobs` / `prompt_logprobs`: how many top alternatives to return per position
    (0 = only the chosen token's logprob; None = none).
    """

    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.best_of is None:
            object.__setattr__(self, "best_of", self.n)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    @property
    def num_sampled(self) -> int:
        """Sequences sampled per request: best_of (the beam width for beam search)."""
        assert self.best_of is not None
        return self.best_of

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def streams_choices(self) -> bool:
        """Whether choices can be sent as they grow: every sampled sequence is returned (no
        best_of > n, no beam search). Otherwise the returned choices are known only at the end."""
        return not self.use_beam_search and self.num_sampled == self.n

    def _validate(self) -> None:
        def fail(name: str, detail: str) -> None:
            raise FieldError(name, detail)

        assert self.best_of is not None
        _check_wire_ranges(self)
        if self.n < 1:
            fail("n", f"must be at least 1, got {self.n}")
        if self.best_of < self.n:
            fail("best_of", f"must be at least n ({self.n}), got {self.best_of}")
        if not 0.0 <= self.temperature <= 100.0:
            fail("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            fail("top_k", f"must be 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            fail("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if self.max_tokens < 1:
            fail("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            fail(
                "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if any(t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "token ids must be non-negative")
        # No upper bound here: how many alternatives a request may ask for is the gateway's
        # --max-logprobs (llmserve.limits), and nothing past it lowers that.
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                fail(name, f"must be 0 or more, got {value}")
        if self.length_penalty != 1.0 and not self.use_beam_search:
            fail("length_penalty", "only applies with use_beam_search")
        if self.early_stopping not in (True, False, "never"):
            fail("early_stopping", f"must be true, false or 'never', got {self.early_stopping!r}")
        if self.use_beam_search:
            if self.best_of < 2:
                fail("best_of", "beam search needs a beam width (best_of) of at least 2")
            if self.temperature > GREEDY_EPSILON:
                fail("temperature", "must be 0 with use_beam_search")
            if self.top_p < 1.0 or self.top_k != 0 or self.min_p > 0.0:
                fail("top_p", "top_p / top_k / min_p cannot be used with use_beam_search")
        elif self.is_greedy and self.best_of > 1:
            fail("best_of", "must be 1 for greedy sampling (temperature 0)")


_UINT32_MAX = 2**32 - 1
_UINT32_FIELDS = (
    "n",
    "best_of",
    "top_k",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
)


def _check_wire_ranges(params: SamplingParams) -> None:
    """Integers must fit their proto fields (uint32, int64 for the seed): a value that does not
    would fail only when the request is sent on, after a client was told 200."""
    for name in _UINT32_FIELDS:
        value = getattr(params, name)
        if value is not None and value > _UINT32_MAX:
            raise FieldError(name, f"must be at most {_UINT32_MAX}, got {value}")
    if params.seed is not None and not -(2**63) <= params.seed < 2**63:
        raise FieldError("seed", f"must fit in 64 bits (signed), got {params.seed}")
    bad = next((t for t in params.stop_token_ids if t > _UINT32_MAX), None)
    if bad is not None:
        raise FieldError("stop_token_ids", f"token id {bad} is not a token id")


def with_admission_seed(params: SamplingParams, rng: random.Random) -> SamplingParams:
    """`params` with a random 63-bit seed when the request samples at random and brought none.

    A seeded request's output depends only on its seed and its tokens so far (the workers'
    streams are counter-based), so a request seeded at admission continues with the same tokens
    when it is re-submitted after a scheduler restart or moved to another worker. Greedy and
    beam search requests are deterministic already and come back unchanged (the same object).
    The gateway and the scheduler both call this; the seed stays internal (never echoed).
    """
    if params.seed is not None or params.is_greedy or params.use_beam_search:
        return params
    return dataclasses.replace(params, seed=rng.getrandbits(63))
