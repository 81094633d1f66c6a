"""Conversions between the shared dataclasses (sampling_params.py, steps.py's logprobs, grammar
specs, finish reasons, worker roles, batch limits) and llmserve.v1; the step contract's own: step_proto.py. Logprobs
travel as float32 (the sampler's precision); everything else is exact.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from llmserve.batch_limits import GivenBatchLimits
from llmserve.errors import FieldError
from llmserve.grammar.reasoning import ReasoningSpec
from llmserve.grammar.spec import GrammarKind, GrammarSpec
from llmserve.sampling_params import SamplingParams
from llmserve.steps import (
    PromptLogprob,
    TokenLogprob,
)
from llmserve.v1 import common_pb2, worker_pb2

# Worker roles by the names `llmserve worker --role` takes: worker.proto's WorkerRole values,
# lower case, without the prefix (UNSPECIFIED, a worker that reports none, reads as mixed).
WORKER_ROLES: dict[str, worker_pb2.WorkerRole] = {
    name.removeprefix("WORKER_ROLE_").lower(): worker_pb2.WorkerRole.Value(name)
    for name, _ in worker_pb2.WorkerRole.items()
    if name != "WORKER_ROLE_UNSPECIFIED"
}
ROLE_NAMES: dict[int, str] = {
    worker_pb2.WORKER_ROLE_UNSPECIFIED: "mixed",
    **{value: name for name, value in WORKER_ROLES.items()},
}

EarlyStopping = bool | Literal["never"]
_EARLY_STOPPING_TO_PROTO: dict[EarlyStopping, common_pb2.EarlyStopping] = {
    False: common_pb2.EARLY_STOPPING_UNSPECIFIED,
    True: common_pb2.EARLY_STOPPING_TRUE,
    "never": common_pb2.EARLY_STOPPING_NEVER,
}
_EARLY_STOPPING_FROM_PROTO: dict[int, EarlyStopping] = {
    v: k for k, v in _EARLY_STOPPING_TO_PROTO.items()
}

# SamplingParams' defaults, applied to `optional` proto fields that are absent.
_DEFAULTS = SamplingParams()


# --- sampling params ------------------------------------------------------------------------


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Every field is set explicitly, so the receiver needs no knowledge of our defaults."""
    msg = common_pb2.SamplingParams(
        n=params.n,
        best_of=params.best_of,
        use_beam_search=params.use_beam_search,
        length_penalty=params.length_penalty,
        early_stopping=_EARLY_STOPPING_TO_PROTO[params.early_stopping],
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    return msg


def sampling_params_from_proto(
    msg: common_pb2.SamplingParams,
    *,
    default_max_tokens: int | None = None,
    field_name: str = "sampling_params",
) -> SamplingParams:
    """Absent optional fields take SamplingParams' defaults (max_tokens: `default_max_tokens`
    when given, e.g. the context left). Raises FieldError naming the invalid field under
    `field_name`, the message's field in its request ("sampling_params.top_p")."""
    try:
        return _sampling_params_from_proto(msg, default_max_tokens)
    except FieldError as exc:
        raise FieldError(f"{field_name}.{exc.field}", exc.detail) from exc


def _sampling_params_from_proto(
    msg: common_pb2.SamplingParams, default_max_tokens: int | None
) -> SamplingParams:
    def opt(name: str, default: Any) -> Any:
        return getattr(msg, name) if msg.HasField(name) else default

    if msg.early_stopping not in _EARLY_STOPPING_FROM_PROTO:
        raise FieldError("early_stopping", f"unknown value {msg.early_stopping}")
    max_tokens_default = _DEFAULTS.max_tokens if default_max_tokens is None else default_max_tokens
    return SamplingParams(
        n=opt("n", _DEFAULTS.n),
        best_of=opt("best_of", None),
        use_beam_search=msg.use_beam_search,
        length_penalty=opt("length_penalty", _DEFAULTS.length_penalty),
        early_stopping=_EARLY_STOPPING_FROM_PROTO[msg.early_stopping],
        temperature=opt("temperature", _DEFAULTS.temperature),
        top_p=opt("top_p", _DEFAULTS.top_p),
        top_k=msg.top_k,
        min_p=msg.min_p,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=opt("repetition_penalty", _DEFAULTS.repetition_penalty),
        seed=opt("seed", None),
        max_tokens=opt("max_tokens", max_tokens_default),
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=opt("logprobs", None),
        prompt_logprobs=opt("prompt_logprobs", None),
    )


# --- logprobs -------------------------------------------------------------------------------


def add_token_logprobs(field: Any, items: Iterable[TokenLogprob]) -> None:
    for t in items:
        field.add(token_id=t.token_id, logprob=t.logprob, rank=t.rank)


def token_logprobs(field: Iterable[common_pb2.TokenLogprob]) -> list[TokenLogprob]:
    return [TokenLogprob(t.token_id, t.logprob, t.rank) for t in field]


def token_logprob_to_proto(t: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob, rank=t.rank)


def token_logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, msg.rank)


def add_prompt_logprobs(field: Any, items: Iterable[PromptLogprob]) -> None:
    for p in items:
        entry = field.add(position=p.position)
        entry.token.token_id = p.token.token_id
        entry.token.logprob = p.token.logprob
        entry.token.rank = p.token.rank
        add_token_logprobs(entry.top, p.top)


def prompt_logprob_from_proto(msg: common_pb2.PromptLogprob) -> PromptLogprob:
    return PromptLogprob(msg.position, token_logprob_from_proto(msg.token), token_logprobs(msg.top))


# --- grammars ------------------------------------------------------------------------------


def grammar_to_proto(spec: GrammarSpec) -> common_pb2.Grammar:
    kind = common_pb2.GrammarKind.Value(f"GRAMMAR_KIND_{spec.kind.name}")
    return common_pb2.Grammar(kind=kind, source=spec.source, field=spec.field)


def grammar_from_proto(msg: common_pb2.Grammar, field: str = "grammar") -> GrammarSpec:
    """Raises FieldError (naming `msg.field`, else `field`) for an unknown kind."""
    name = msg.field or field
    try:
        kind = GrammarKind(msg.kind)
    except ValueError:
        raise FieldError(f"{name}.kind", f"unknown grammar kind {msg.kind}") from None
    if kind != GrammarKind.JSON_OBJECT and not msg.source:
        raise FieldError(f"{name}.source", "must not be empty")
    return GrammarSpec(kind, msg.source, name)


def reasoning_to_proto(spec: ReasoningSpec) -> common_pb2.Reasoning:
    msg = common_pb2.Reasoning(
        open_token_ids=spec.open_ids,
        end_token_ids=spec.end_ids,
        close_token_ids=spec.close_ids,
        opened=spec.opened,
    )
    if spec.budget is not None:
        msg.budget = spec.budget
    return msg


def reasoning_from_proto(msg: common_pb2.Reasoning) -> ReasoningSpec:
    """Raises FieldError naming the part that is inconsistent."""
    return ReasoningSpec(
        tuple(msg.open_token_ids),
        tuple(msg.end_token_ids),
        tuple(msg.close_token_ids),
        msg.opened,
        msg.budget if msg.HasField("budget") else None,
    )


# --- finish reasons -----------------------------------------------------------------------

# common.proto's FinishReason is the one list. Its names, lower-cased without the prefix, are
# the names the scheduler (scheduler_service.engine.sequence.FinishReason), logs and metrics use.
_FINISH_PREFIX = "FINISH_REASON_"


def finish_reason_to_proto(name: str) -> common_pb2.FinishReason:
    """`"stop"` -> FINISH_REASON_STOP. Raises ValueError for a name the proto lacks."""
    return common_pb2.FinishReason.Value(_FINISH_PREFIX + name.upper())


def finish_reason_name(value: int) -> str | None:
    """FINISH_REASON_STOP -> `"stop"`; None for UNSPECIFIED (not finished). Raises ValueError
    for a number the proto lacks."""
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return common_pb2.FinishReason.Name(value).removeprefix(_FINISH_PREFIX).lower()


# --- batch limits -------------------------------------------------------------------------


def batch_limits_from_proto(msg: worker_pb2.InitializeCacheRequest) -> GivenBatchLimits:
    """The batch limits an InitializeCache sends; None for each one it leaves out."""
    return GivenBatchLimits(
        max_num_seqs=msg.max_num_seqs if msg.HasField("max_num_seqs") else None,
        max_num_batched_tokens=(
            msg.max_num_batched_tokens if msg.HasField("max_num_batched_tokens") else None
        ),
    )
