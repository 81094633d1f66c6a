"""What the gateway's request path (generation.py) takes and gives: a request's input as both
APIs build it, and its updates as they come back, text and logprobs decoded."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.reasoning import ReasoningRequest
from gateway.tools import ToolRequest
from llmserve.grammar.spec import GrammarSpec
from llmserve.priority import check_priority
from llmserve.sampling_params import SamplingParams
from llmserve.v1 import common_pb2, scheduler_pb2


@dataclass(frozen=True, slots=True)
class TextOptions:
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None = None


@dataclass(slots=True)
class GenerationInput:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    text: TextOptions = field(default_factory=TextOptions)
    # For spans and logs.
    operation: str = "text_completion"
    # Seconds the request may take in all (the client's deadline, or the gateway's
    # --request-timeout-s); None: no limit. Passed on to the scheduler, which aborts it then.
    timeout_s: float | None = None
    # Scheduling priority: lower is served first (vLLM's convention).
    priority: int = 0
    # What the output must match (structured output); checked at admission.
    grammar: GrammarSpec | None = None
    # Chat tools (the tool format's grammar is `grammar`); None: no tool calls.
    tools: ToolRequest | None = None
    # How the chat's reasoning is told from its answer, and its thinking budget; None: the
    # output is all answer.
    reasoning: ReasoningRequest | None = None

    def __post_init__(self) -> None:
        check_priority(self.priority)


@dataclass(slots=True)
class TokenInfo:
    token_id: int
    text: str
    logprob: float
    rank: int


@dataclass(slots=True)
class LogprobEntry:
    token: TokenInfo
    top: list[TokenInfo]


@dataclass(slots=True)
class ChoiceUpdate:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobEntry] | None = None
    # Set on the choice's last update; FINISH_REASON_UNSPECIFIED (0) before.
    finish_reason: common_pb2.FinishReason = common_pb2.FINISH_REASON_UNSPECIFIED
    # The stop string or stop token id that ended the choice (None for EOS / length).
    stop_reason: str | int | None = None


@dataclass(slots=True)
class Usage:
    """Tokens of a request, as the scheduler counted them (common.proto's Usage)."""

    prompt_tokens: int
    completion_tokens: int
    # Speculative decoding: draft tokens verified, and kept.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @classmethod
    def from_proto(cls, msg: common_pb2.Usage) -> Usage:
        return cls(
            msg.prompt_tokens,
            msg.completion_tokens,
            msg.spec_draft_tokens,
            msg.spec_accepted_tokens,
        )

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.spec_draft_tokens + other.spec_draft_tokens,
            self.spec_accepted_tokens + other.spec_accepted_tokens,
        )

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class GenerationUpdate:
    choices: list[ChoiceUpdate]
    # Per prompt position (None for the first); in the first update when requested.
    prompt_logprobs: list[LogprobEntry | None] | None = None
    finished: bool = False
    # On the last update: the scheduler's count and timings (scheduler.proto RequestMetrics).
    usage: Usage | None = None
    metrics: scheduler_pb2.RequestMetrics | None = None
