"""Conversions between the shared dataclasses (steps.py, sampling_params.py) and llmserve.v1.

The step conversions run once per scheduler iteration for up to a few hundred sequences, so
they build messages with `add(...)`/`extend` and read repeated scalars with `list(...)`, and do
nothing else. Logprobs travel as float32 (the sampler's precision); everything else is exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

from llmserve.errors import FieldError
from llmserve.grammar.spec import GrammarKind, GrammarSpec
from llmserve.proto_masks import add_masks, token_mask_from_proto
from llmserve.sampling_params import SamplingParams
from llmserve.steps import (
    CachedSequence,
    Fork,
    NewSequence,
    PromptLogprob,
    SequenceOutput,
    StepInput,
    StepResult,
    TokenLogprob,
)
from llmserve.v1 import common_pb2, worker_pb2

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


def _add_prompt_logprobs(field: Any, items: Iterable[PromptLogprob]) -> None:
    for p in items:
        entry = field.add(position=p.position)
        entry.token.token_id = p.token.token_id
        entry.token.logprob = p.token.logprob
        entry.token.rank = p.token.rank
        add_token_logprobs(entry.top, p.top)


def prompt_logprob_from_proto(msg: common_pb2.PromptLogprob) -> PromptLogprob:
    return PromptLogprob(msg.position, token_logprob_from_proto(msg.token), token_logprobs(msg.top))


# --- ragged columns -------------------------------------------------------------------------


def _split(lengths: list[int], flat: list[Any]) -> list[list[Any]]:
    """Inverse of concatenation: the i-th list holds the next lengths[i] items of flat."""
    if len(flat) != sum(lengths):
        raise ValueError(f"ragged column has {len(flat)} items, its lengths sum to {sum(lengths)}")
    if lengths.count(1) == len(lengths):  # the decode case: one item each
        return [[x] for x in flat]
    out, start = [], 0
    for n in lengths:
        out.append(flat[start : start + n])
        start += n
    return out


def _check_columns(what: str, columns: dict[str, int]) -> int:
    sizes = set(columns.values())
    if len(sizes) > 1:
        raise ValueError(f"{what}: per-sequence columns differ in length: {columns}")
    return sizes.pop() if sizes else 0


# --- step input -----------------------------------------------------------------------------


def _set_mapping(msg: worker_pb2.BlockMapping, pairs: Sequence[tuple[int, int]]) -> None:
    if pairs:
        msg.src.extend([src for src, _ in pairs])
        msg.dst.extend([dst for _, dst in pairs])


def _mapping(msg: worker_pb2.BlockMapping) -> list[tuple[int, int]]:
    if len(msg.src) != len(msg.dst):
        raise ValueError(f"block mapping has {len(msg.src)} sources but {len(msg.dst)} targets")
    return list(zip(msg.src, msg.dst, strict=True))


def _set_cached(msg: worker_pb2.CachedSequences, seqs: list[CachedSequence]) -> None:
    if not seqs:
        return
    msg.seq_ids.extend([c.seq_id for c in seqs])
    msg.num_new_tokens.extend([len(c.new_token_ids) for c in seqs])
    msg.new_token_ids.extend([t for c in seqs for t in c.new_token_ids])
    msg.block_offsets.extend([c.block_offset for c in seqs])
    msg.num_block_ids.extend([len(c.block_ids) for c in seqs])
    msg.block_ids.extend([b for c in seqs for b in c.block_ids])
    msg.num_scheduled_tokens.extend([c.num_scheduled_tokens for c in seqs])


def _cached(msg: worker_pb2.CachedSequences) -> list[CachedSequence]:
    n = _check_columns(
        "cached_seqs",
        {
            "seq_ids": len(msg.seq_ids),
            "num_new_tokens": len(msg.num_new_tokens),
            "block_offsets": len(msg.block_offsets),
            "num_block_ids": len(msg.num_block_ids),
            "num_scheduled_tokens": len(msg.num_scheduled_tokens),
        },
    )
    if n == 0:
        return []
    new_tokens = _split(list(msg.num_new_tokens), list(msg.new_token_ids))
    if msg.block_ids:
        block_ids = _split(list(msg.num_block_ids), list(msg.block_ids))
    else:
        block_ids = [[] for _ in range(n)]
    return list(
        map(
            CachedSequence,
            msg.seq_ids,
            new_tokens,
            msg.block_offsets,
            block_ids,
            msg.num_scheduled_tokens,
        )
    )


def step_input_to_proto(step: StepInput) -> worker_pb2.ExecuteRequest:
    msg = worker_pb2.ExecuteRequest(step_id=step.step_id, freed_seq_ids=step.freed_seq_ids)
    for s in step.new_seqs:
        msg.new_seqs.add(
            seq_id=s.seq_id,
            request_id=s.request_id,
            seq_index=s.seq_index,
            token_ids=s.token_ids,
            num_prompt_tokens=s.num_prompt_tokens,
            num_computed_tokens=s.num_computed_tokens,
            block_ids=s.block_ids,
            num_scheduled_tokens=s.num_scheduled_tokens,
            sampling_params=sampling_params_to_proto(s.sampling_params),
        )
    _set_cached(msg.cached_seqs, step.cached_seqs)
    for f in step.forks:
        msg.forks.add(
            parent_seq_id=f.parent_seq_id,
            child_seq_id=f.child_seq_id,
            child_seq_index=f.child_seq_index,
        )
    _set_mapping(msg.blocks_to_swap_out, step.blocks_to_swap_out)
    _set_mapping(msg.blocks_to_swap_in, step.blocks_to_swap_in)
    _set_mapping(msg.blocks_to_copy, step.blocks_to_copy)
    add_masks(msg.token_masks, step.token_masks)
    if step.deferred_mask_seq_ids:
        msg.deferred_mask_seq_ids.extend(step.deferred_mask_seq_ids)
    return msg


def step_input_from_proto(msg: worker_pb2.ExecuteRequest) -> StepInput:
    """Raises ValueError when the columns are inconsistent (a malformed request)."""
    return StepInput(
        step_id=msg.step_id,
        new_seqs=[
            NewSequence(
                seq_id=s.seq_id,
                request_id=s.request_id,
                seq_index=s.seq_index,
                token_ids=list(s.token_ids),
                num_prompt_tokens=s.num_prompt_tokens,
                num_computed_tokens=s.num_computed_tokens,
                block_ids=list(s.block_ids),
                num_scheduled_tokens=s.num_scheduled_tokens,
                sampling_params=sampling_params_from_proto(s.sampling_params),
            )
            for s in msg.new_seqs
        ],
        cached_seqs=_cached(msg.cached_seqs),
        forks=[Fork(f.parent_seq_id, f.child_seq_id, f.child_seq_index) for f in msg.forks],
        freed_seq_ids=list(msg.freed_seq_ids),
        blocks_to_swap_out=_mapping(msg.blocks_to_swap_out),
        blocks_to_swap_in=_mapping(msg.blocks_to_swap_in),
        blocks_to_copy=_mapping(msg.blocks_to_copy),
        token_masks=[token_mask_from_proto(m) for m in msg.token_masks],
        deferred_mask_seq_ids=list(msg.deferred_mask_seq_ids),
    )


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


# --- step result ----------------------------------------------------------------------------


def _set_outputs(msg: worker_pb2.SequenceOutputs, outputs: list[SequenceOutput]) -> None:
    if not outputs:
        return
    msg.seq_ids.extend([o.seq_id for o in outputs])
    msg.num_samples.extend([len(o.samples) for o in outputs])
    samples = [t for o in outputs for t in o.samples]
    msg.sample_token_ids.extend([t.token_id for t in samples])
    msg.sample_logprobs.extend([t.logprob for t in samples])
    msg.sample_ranks.extend([t.rank for t in samples])
    top = [t for o in outputs for t in o.top_logprobs]
    if top:
        msg.num_top_logprobs.extend([len(o.top_logprobs) for o in outputs])
        msg.top_token_ids.extend([t.token_id for t in top])
        msg.top_logprobs.extend([t.logprob for t in top])
        msg.top_ranks.extend([t.rank for t in top])


def _token_logprob_column(ids: Any, logprobs: Any, ranks: Any) -> list[TokenLogprob]:
    if not len(ids) == len(logprobs) == len(ranks):
        raise ValueError("token id, logprob and rank columns differ in length")
    return list(map(TokenLogprob, ids, logprobs, ranks))


def _outputs(msg: worker_pb2.SequenceOutputs) -> list[SequenceOutput]:
    n = _check_columns(
        "outputs", {"seq_ids": len(msg.seq_ids), "num_samples": len(msg.num_samples)}
    )
    if n == 0:
        return []
    samples = _split(
        list(msg.num_samples),
        _token_logprob_column(msg.sample_token_ids, msg.sample_logprobs, msg.sample_ranks),
    )
    if msg.num_top_logprobs:
        _check_columns("outputs", {"seq_ids": n, "num_top_logprobs": len(msg.num_top_logprobs)})
        top = _split(
            list(msg.num_top_logprobs),
            _token_logprob_column(msg.top_token_ids, msg.top_logprobs, msg.top_ranks),
        )
    else:
        top = [[] for _ in range(n)]
    return [SequenceOutput(i, s, t) for i, s, t in zip(msg.seq_ids, samples, top, strict=True)]


def step_result_to_proto(result: StepResult) -> worker_pb2.ExecuteResult:
    msg = worker_pb2.ExecuteResult(
        step_id=result.step_id,
        forward_ns=result.forward_ns,
        sample_ns=result.sample_ns,
        mask_wait_ns=result.mask_wait_ns,
    )
    _set_outputs(msg.outputs, result.outputs)
    for o in result.outputs:
        if o.prompt_logprobs:
            entry = msg.prompt_logprobs.add(seq_id=o.seq_id)
            _add_prompt_logprobs(entry.prompt_logprobs, o.prompt_logprobs)
    return msg


def step_result_from_proto(msg: worker_pb2.ExecuteResult) -> StepResult:
    """Raises ValueError when the columns are inconsistent (a malformed result)."""
    outputs = _outputs(msg.outputs)
    if msg.prompt_logprobs:
        by_seq = {o.seq_id: o for o in outputs}
        for entry in msg.prompt_logprobs:
            if entry.seq_id not in by_seq:
                raise ValueError(f"prompt logprobs for seq {entry.seq_id}, which has no output")
            by_seq[entry.seq_id].prompt_logprobs = [
                prompt_logprob_from_proto(p) for p in entry.prompt_logprobs
            ]
    return StepResult(
        step_id=msg.step_id,
        outputs=outputs,
        forward_ns=msg.forward_ns,
        sample_ns=msg.sample_ns,
        mask_wait_ns=msg.mask_wait_ns,
    )


# --- finish reasons -----------------------------------------------------------------------

# common.proto's FinishReason is the one list. Its names, lower-cased without the prefix, are
# the names the scheduler (scheduler_service.sequence.FinishReason), logs and metrics use.
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
