"""Round trips between the step dataclasses and their proto form, and the per-step size."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.errors import FieldError
from llmserve.proto_convert import sampling_params_from_proto, sampling_params_to_proto
from llmserve.sampling_params import SamplingParams
from llmserve.step_proto import (
    step_input_from_proto,
    step_input_to_proto,
    step_result_from_proto,
    step_result_to_proto,
)
from llmserve.steps import (
    BlockExport,
    BlockImport,
    CachedSequence,
    Fork,
    MaskKind,
    NewSequence,
    PromptLogprob,
    SequenceOutput,
    StepInput,
    StepResult,
    TokenLogprob,
    TokenMask,
    TransferFailure,
)
from llmserve.v1 import common_pb2, worker_pb2

u32 = st.integers(0, 2**32 - 1)
small = st.integers(0, 5000)
ids = st.lists(small, max_size=6)
pairs = st.lists(st.tuples(small, small), max_size=4)
# Logprobs travel as float32; these values are exactly representable.
logprob32 = st.floats(-1e4, 0, width=32, allow_nan=False)
token_logprob = st.builds(TokenLogprob, small, logprob32, st.integers(1, 50_000))

sampling_params = st.one_of(
    st.builds(
        SamplingParams,
        n=st.integers(1, 3),
        temperature=st.floats(0.1, 2.0),
        top_p=st.floats(0.01, 1.0),
        top_k=st.integers(0, 100),
        min_p=st.floats(0, 1),
        presence_penalty=st.floats(-2, 2),
        frequency_penalty=st.floats(-2, 2),
        repetition_penalty=st.floats(0.01, 2),
        seed=st.none() | st.integers(-(2**63), 2**63 - 1),
        max_tokens=st.integers(4, 4096),
        min_tokens=st.integers(0, 4),
        stop_token_ids=st.lists(small, max_size=3).map(tuple),
        ignore_eos=st.booleans(),
        logprobs=st.none() | st.integers(0, 20),
        prompt_logprobs=st.none() | st.integers(0, 20),
    ),
    st.builds(
        SamplingParams,
        n=st.integers(1, 2),
        best_of=st.integers(2, 4),
        use_beam_search=st.just(True),
        temperature=st.just(0.0),
        length_penalty=st.floats(0.5, 2.0),
        early_stopping=st.sampled_from([False, True, "never"]),
    ),
)

new_seq = st.builds(
    NewSequence,
    seq_id=st.integers(0, 2**63),
    request_id=st.text(max_size=8),
    seq_index=small,
    token_ids=ids,
    num_prompt_tokens=small,
    num_computed_tokens=small,
    block_ids=ids,
    num_scheduled_tokens=small,
    sampling_params=sampling_params,
)
cached_seq = st.builds(
    CachedSequence,
    st.integers(0, 2**63),
    ids,
    u32,
    ids,
    small,
    draft_token_ids=ids,
    after_drafts=st.booleans(),
)
token_mask = st.one_of(
    st.builds(
        TokenMask,
        st.integers(0, 2**63),
        st.sampled_from([MaskKind.ALLOW, MaskKind.DENY]),
        u32,
        ids,
        row=small,
    ),
    st.builds(
        TokenMask,
        st.integers(0, 2**63),
        st.just(MaskKind.BITMAP),
        u32,
        st.just([]),
        st.binary(max_size=64),
        row=small,
    ),
)
step_input = st.builds(
    StepInput,
    step_id=st.integers(0, 2**64 - 1),
    new_seqs=st.lists(new_seq, max_size=3),
    cached_seqs=st.lists(cached_seq, max_size=6),
    forks=st.lists(st.builds(Fork, small, small, small), max_size=3),
    freed_seq_ids=ids,
    blocks_to_swap_out=pairs,
    blocks_to_swap_in=pairs,
    blocks_to_copy=pairs,
    token_masks=st.lists(token_mask, max_size=3),
    released_transfer_ids=st.lists(st.integers(0, 2**64 - 1), max_size=3),
    exports=st.lists(st.builds(BlockExport, st.integers(0, 2**64 - 1), ids), max_size=2),
    imports=st.lists(
        st.builds(BlockImport, st.integers(0, 2**64 - 1), st.text(max_size=20), ids), max_size=2
    ),
)
prompt_logprob = st.builds(PromptLogprob, small, token_logprob, st.lists(token_logprob, max_size=3))


@st.composite
def step_result(draw) -> StepResult:
    seq_ids = draw(st.lists(small, max_size=6, unique=True))
    outputs = [
        SequenceOutput(
            seq_id,
            draw(st.lists(token_logprob, max_size=4)),
            draw(st.lists(token_logprob, max_size=3)),
            draw(st.lists(prompt_logprob, max_size=2)),
        )
        for seq_id in seq_ids
    ]
    return StepResult(
        draw(st.integers(0, 2**64 - 1)),
        outputs,
        draw(u32),
        draw(u32),
        imported_transfer_ids=draw(st.lists(st.integers(0, 2**64 - 1), max_size=3)),
        failed_imports=draw(
            st.lists(st.builds(TransferFailure, st.integers(0, 2**64 - 1), st.text()), max_size=2)
        ),
    )


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


@settings(max_examples=200, deadline=None)
@given(sampling_params)
def test_sampling_params_round_trip(params: SamplingParams) -> None:
    assert sampling_params_from_proto(_wire(sampling_params_to_proto(params))) == params


@settings(max_examples=200, deadline=None)
@given(step_input)
def test_step_input_round_trip(step: StepInput) -> None:
    assert step_input_from_proto(_wire(step_input_to_proto(step))) == step


@settings(max_examples=200, deadline=None)
@given(step_result())
def test_step_result_round_trip(result: StepResult) -> None:
    assert step_result_from_proto(_wire(step_result_to_proto(result))) == result


def test_absent_optional_sampling_fields_take_the_defaults() -> None:
    assert sampling_params_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    msg = common_pb2.SamplingParams(n=2, temperature=0.5)
    assert sampling_params_from_proto(msg, default_max_tokens=100) == SamplingParams(
        n=2, best_of=2, temperature=0.5, max_tokens=100
    )


def test_invalid_sampling_params_name_the_field() -> None:
    with pytest.raises(FieldError) as info:
        sampling_params_from_proto(common_pb2.SamplingParams(n=3, best_of=2))
    assert info.value.field == "sampling_params.best_of"
    assert info.value.message.startswith("sampling_params.best_of: ")
    with pytest.raises(FieldError) as info:
        sampling_params_from_proto(common_pb2.SamplingParams(early_stopping=7), field_name="sp")
    assert info.value.field == "sp.early_stopping"


def test_inconsistent_columns_are_rejected() -> None:
    msg = step_input_to_proto(StepInput(1, cached_seqs=[CachedSequence(5, [1, 2], 3, [9], 2)]))
    del msg.cached_seqs.new_token_ids[-1]
    with pytest.raises(ValueError, match="ragged column has 1 items, its lengths sum to 2"):
        step_input_from_proto(msg)
    msg = step_input_to_proto(StepInput(1, cached_seqs=[CachedSequence(5, [1], 3, [], 1)]))
    msg.cached_seqs.block_offsets.append(4)
    with pytest.raises(ValueError, match="per-sequence columns differ"):
        step_input_from_proto(msg)
    msg = worker_pb2.ExecuteRequest(blocks_to_copy=worker_pb2.BlockMapping(src=[1, 2], dst=[3]))
    with pytest.raises(ValueError, match="2 sources but 1 targets"):
        step_input_from_proto(msg)


def test_mixed_ragged_lengths_split_back_exactly() -> None:
    # Same total as the number of sequences, but not one each: must not take the decode shortcut.
    step = StepInput(
        2,
        cached_seqs=[CachedSequence(1, [], 0, [7, 8], 0), CachedSequence(2, [5, 6], 4, [], 2)],
    )
    assert step_input_from_proto(_wire(step_input_to_proto(step))) == step


# --- per-step size ---------------------------------------------------------------------------

BLOCK_SIZE = 16


def decode_step(num_seqs: int, seq_len: int, step_id: int = 1_000_000) -> StepInput:
    """A pure decode step: each sequence gets its one sampled token, no new block."""
    num_blocks = -(-seq_len // BLOCK_SIZE)
    return StepInput(
        step_id,
        cached_seqs=[
            CachedSequence(10_000 + i, [49_000 + i], num_blocks, [], 1) for i in range(num_seqs)
        ],
    )


def decode_result(num_seqs: int, step_id: int = 1_000_000) -> StepResult:
    return StepResult(
        step_id,
        [SequenceOutput(10_000 + i, [TokenLogprob(49_000 + i, -0.25, 2)]) for i in range(num_seqs)],
        forward_ns=12_345_678,
        sample_ns=1_234_567,
    )


def test_decode_step_bytes_do_not_grow_with_sequence_length() -> None:
    short = step_input_to_proto(decode_step(256, 100)).ByteSize()
    long = step_input_to_proto(decode_step(256, 10_000)).ByteSize()
    assert short == long == 3097


def test_decode_step_and_result_bytes_for_256_sequences() -> None:
    # Exact figures, so a change to the wire format shows up here: about 12 bytes per sequence
    # each way (seq id 3, token 3, block offset 4, three one-byte counts) plus packing overhead.
    assert step_input_to_proto(decode_step(256, 1000)).ByteSize() == 3097
    assert step_result_to_proto(decode_result(256)).ByteSize() == 2847


def test_a_token_mask_of_unknown_kind_is_refused() -> None:
    msg = step_input_to_proto(StepInput(1))
    msg.token_masks.add(seq_id=3, kind=9, vocab_size=10)
    with pytest.raises(ValueError, match="unknown kind"):
        step_input_from_proto(msg)


def test_grammar_round_trip_and_unknown_kind() -> None:
    from llmserve.grammar.spec import GrammarSpec
    from llmserve.proto_convert import grammar_from_proto, grammar_to_proto

    spec = GrammarSpec.regex("[0-9]+", "structured_outputs.regex")
    assert grammar_from_proto(_wire(grammar_to_proto(spec))) == spec
    with pytest.raises(FieldError, match="grammar.kind"):
        grammar_from_proto(common_pb2.Grammar(kind=42, source="x"))
    with pytest.raises(FieldError, match="response_format.source"):
        grammar_from_proto(common_pb2.Grammar(kind=1, field="response_format"))
