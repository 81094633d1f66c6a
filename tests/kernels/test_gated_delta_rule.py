"""The gated delta rule's three forms against each other, against hand-worked numbers and
against transformers' own torch functions (the oracle for Qwen3.5's layer)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from llmserve_kernels import KernelArgumentError
from llmserve_kernels.gated_delta_rule import (
    gated_delta_rule_chunked,
    gated_delta_rule_decode,
    gated_delta_rule_recurrent,
)
from tests.kernels.linear_state import (
    DeltaInputs,
    delta_args,
    make_delta_inputs,
    make_state_pool,
    offsets,
    slots,
)

TIGHT = dict(atol=2e-5, rtol=2e-5)
# (num_k_heads, num_v_heads, k_dim, v_dim): one head; two value heads per key head with
# k_dim != v_dim (Qwen3.5 has 16 key heads over 32 or 48 value heads, both dims 128).
SHAPES = [(1, 1, 8, 8), (2, 4, 16, 8), (2, 6, 32, 16)]

Form = Callable[..., torch.Tensor]


def chunked(chunk_size: int) -> Form:
    def run(*args: object, **kwargs: object) -> torch.Tensor:
        return gated_delta_rule_chunked(*args, chunk_size=chunk_size, **kwargs)  # type: ignore[arg-type]

    return run


FORMS = [
    pytest.param(gated_delta_rule_recurrent, id="recurrent"),
    pytest.param(chunked(8), id="chunked8"),
    pytest.param(chunked(64), id="chunked64"),
]


def run_one(
    form: Form, inputs: DeltaInputs, state: torch.Tensor, **kwargs: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence from `state` ([heads, k_dim, v_dim]): its outputs and final state."""
    pool = state[None].clone()
    out = form(*inputs.tensors(), pool, offsets([inputs.v.shape[0]]), slots([0]), **kwargs)
    return out, pool[0]


@pytest.mark.parametrize(("num_k_heads", "num_v_heads", "k_dim", "v_dim"), SHAPES)
@pytest.mark.parametrize(
    ("length", "chunk_size"),
    [
        (1, 8),
        (5, 8),
        (7, 8),
        (8, 8),
        (9, 8),
        (23, 8),
        (40, 8),
        (1, 64),
        (37, 64),
        (64, 64),
        (150, 64),
    ],
)
def test_chunked_equals_recurrent(
    num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, length: int, chunk_size: int
) -> None:
    gen = torch.Generator().manual_seed(length * 7 + chunk_size + k_dim)
    inputs = make_delta_inputs(length, num_k_heads, num_v_heads, k_dim, v_dim, gen)
    state = make_state_pool(1, num_v_heads, k_dim, v_dim, generator=gen)[0]
    expected, expected_state = run_one(gated_delta_rule_recurrent, inputs, state)
    out, final = run_one(chunked(chunk_size), inputs, state)
    torch.testing.assert_close(out, expected, **TIGHT)
    torch.testing.assert_close(final, expected_state, **TIGHT)


@pytest.mark.parametrize("form", FORMS)
def test_hand_worked_steps(form: Form) -> None:
    """One head, k = q = 1 (unnormalised), scale 1, v = 2, beta = 1/2, from S = 0:
    token 1 reads 0, steps (2 - 0) / 2 = 1, S = 1; token 2 decays S to 1/2, reads 1/2,
    steps (2 - 1/2) / 2 = 3/4, S = 5/4; token 3 (no decay) reads 5/4, steps 3/8, S = 13/8.
    Outputs read S after each update."""
    ones = torch.ones(3, 1, 1)
    g = torch.tensor([[0.0], [math.log(0.5)], [0.0]])
    inputs = DeltaInputs(ones, ones, 2 * ones, g, torch.full((3, 1), 0.5))
    out, final = run_one(form, inputs, torch.zeros(1, 1, 1), scale=1.0, qk_l2norm=False)
    assert out.flatten().tolist() == pytest.approx([1.0, 1.25, 1.625], abs=1e-6)
    assert final.item() == pytest.approx(1.625, abs=1e-6)


@pytest.mark.parametrize("form", FORMS)
def test_l2_norm_and_scale(form: Form) -> None:
    """q and k are normalised (k = (3, 4) reads like (0.6, 0.8)) and q scaled by k_dim^-1/2:
    from S = 0 with beta = 1, S becomes k v^T, so the output is (q . k) v / sqrt(2)."""
    q = torch.tensor([[[0.0, 5.0]]])  # normalises to (0, 1)
    k = torch.tensor([[[3.0, 4.0]]])
    v = torch.tensor([[[10.0]]])
    inputs = DeltaInputs(q, k, v, torch.zeros(1, 1), torch.ones(1, 1))
    out, final = run_one(form, inputs, torch.zeros(1, 2, 1))
    assert out.item() == pytest.approx(0.8 * 10.0 / math.sqrt(2), rel=1e-5)
    assert final.flatten().tolist() == pytest.approx([6.0, 8.0], rel=1e-5)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("cuts", [[1], [13], [7, 8], [3, 35], [20, 21], [39]])
def test_state_carried_across_calls(form: Form, cuts: list[int]) -> None:
    """A sequence in pieces (cut at these tokens), each call continuing from the slot the
    last one wrote, gives the outputs and final state of one call."""
    gen = torch.Generator().manual_seed(sum(cuts))
    inputs = make_delta_inputs(40, 2, 4, 16, 8, gen)
    state = make_state_pool(1, 4, 16, 8, generator=gen)[0]
    expected, expected_state = run_one(form, inputs, state)
    pool = state[None].clone()
    pieces = []
    for begin, end in zip([0, *cuts], [*cuts, 40], strict=True):
        piece = inputs.rows(begin, end)
        pieces.append(form(*piece.tensors(), pool, offsets([end - begin]), slots([0])))
    torch.testing.assert_close(torch.cat(pieces), expected, **TIGHT)
    torch.testing.assert_close(pool[0], expected_state, **TIGHT)


@pytest.mark.parametrize("form", FORMS)
def test_packed_batch_equals_per_sequence(form: Form) -> None:
    """Sequences of mixed lengths (an empty one, decode tokens, chunks longer than C) in one
    call, in shuffled slots, two of them new (their slots hold NaN: never read)."""
    gen = torch.Generator().manual_seed(5)
    lens = [5, 0, 17, 1, 70, 1, 9]
    seq_slots = [6, 2, 0, 9, 3, 7, 1]
    new = [False, False, True, False, False, True, False]
    inputs = make_delta_inputs(sum(lens), 2, 4, 16, 8, gen)
    pool = make_state_pool(10, 4, 16, 8, generator=gen)
    for slot, is_new in zip(seq_slots, new, strict=True):
        if is_new:
            pool[slot] = float("nan")
    before = pool.clone()
    has_initial = torch.tensor([not x for x in new])
    out = form(*inputs.tensors(), pool, offsets(lens), slots(seq_slots), has_initial)
    starts = offsets(lens).tolist()
    for seq, slot in enumerate(seq_slots):
        begin, end = starts[seq], starts[seq + 1]
        initial = torch.zeros_like(before[slot]) if new[seq] else before[slot]
        expected, expected_state = run_one(form, inputs.rows(begin, end), initial)
        torch.testing.assert_close(out[begin:end], expected, **TIGHT)
        if begin < end:
            torch.testing.assert_close(pool[slot], expected_state, **TIGHT)
        else:
            torch.testing.assert_close(pool[slot], before[slot], equal_nan=True, atol=0, rtol=0)
    untouched = sorted(set(range(10)) - set(seq_slots))
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize(("num_k_heads", "num_v_heads", "k_dim", "v_dim"), SHAPES)
def test_decode_equals_recurrent(
    num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int
) -> None:
    """Three decode steps of five sequences, the batch at once, against each sequence's
    recurrent run over the same three tokens."""
    gen = torch.Generator().manual_seed(k_dim + num_v_heads)
    num_seqs, steps = 5, 3
    seq_slots = [4, 0, 7, 2, 5]
    inputs = make_delta_inputs(num_seqs * steps, num_k_heads, num_v_heads, k_dim, v_dim, gen)
    pool = make_state_pool(8, num_v_heads, k_dim, v_dim, generator=gen)
    before = pool.clone()
    outs = []
    for step in range(steps):
        tokens = inputs.rows(step * num_seqs, (step + 1) * num_seqs)
        outs.append(gated_delta_rule_decode(*tokens.tensors(), pool, slots(seq_slots)))
    for seq, slot in enumerate(seq_slots):
        rows = [step * num_seqs + seq for step in range(steps)]
        sequence = DeltaInputs(*(x[rows] for x in inputs.tensors()))
        expected, expected_state = run_one(gated_delta_rule_recurrent, sequence, before[slot])
        torch.testing.assert_close(torch.stack([o[seq] for o in outs]), expected, **TIGHT)
        torch.testing.assert_close(pool[slot], expected_state, **TIGHT)
    assert torch.equal(pool[[1, 3, 6]], before[[1, 3, 6]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_low_precision_inputs_keep_a_float32_state(dtype: torch.dtype) -> None:
    """bf16 q/k/v give bf16 outputs; the float32 pool stays float32 and the forms agree to
    the outputs' precision."""
    gen = torch.Generator().manual_seed(11)
    inputs = make_delta_inputs(30, 2, 4, 16, 8, gen, dtype=dtype)
    state = make_state_pool(1, 4, 16, 8, generator=gen)[0]
    expected, expected_state = run_one(gated_delta_rule_recurrent, inputs, state)
    out, final = run_one(chunked(8), inputs, state)
    assert out.dtype == dtype and final.dtype == torch.float32
    tolerance = TIGHT if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)
    torch.testing.assert_close(final, expected_state, **TIGHT)


# transformers as the oracle: its reference functions, on the same inputs (a batch of two
# sequences of equal length against our packed call).


@pytest.mark.parametrize(("num_k_heads", "num_v_heads", "k_dim", "v_dim"), SHAPES)
@pytest.mark.parametrize("length", [1, 30, 64, 100])
def test_matches_transformers(
    num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, length: int
) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    gen = torch.Generator().manual_seed(length + k_dim)
    inputs = make_delta_inputs(2 * length, num_k_heads, num_v_heads, k_dim, v_dim, gen)
    pool = make_state_pool(3, num_v_heads, k_dim, v_dim, generator=gen)
    seq_slots = [2, 0]
    # [2, length, heads, dim]: the two sequences as transformers' batch
    batched = [x.reshape(2, length, *x.shape[1:]) for x in inputs.tensors()]
    for theirs, ours in (
        (torch_chunk_gated_delta_rule, chunked(64)),
        (torch_recurrent_gated_delta_rule, gated_delta_rule_recurrent),
    ):
        expected, expected_state = theirs(
            *batched,
            initial_state=pool[seq_slots].clone(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        ours_pool = pool.clone()
        out = ours(*inputs.tensors(), ours_pool, offsets([length, length]), slots(seq_slots))
        torch.testing.assert_close(out, expected.flatten(0, 1), **TIGHT)
        torch.testing.assert_close(ours_pool[seq_slots], expected_state, **TIGHT)


@pytest.mark.parametrize(
    ("change", "name"),
    [
        (dict(state_slots=slots([0, 5])), "state_slots"),  # past the pool
        (dict(state_slots=slots([1, 1])), "state_slots"),  # one slot twice
        (dict(query_start_loc=offsets([3, 2])), "query_start_loc"),  # 5 tokens, not 6
        (dict(query_start_loc=torch.tensor([0, 4, 3, 6], dtype=torch.int32)), "query_start_loc"),
        (dict(v=torch.zeros(6, 3, 8)), "v"),  # 3 value heads over 2 key heads
        (dict(state=torch.zeros(4, 4, 8, 16)), "state"),  # k_dim and v_dim swapped
        (dict(g=torch.zeros(6, 2)), "g"),
        (dict(has_initial_state=torch.ones(2, dtype=torch.int32)), "has_initial_state"),
    ],
)
def test_argument_errors_name_the_argument(change: dict[str, torch.Tensor], name: str) -> None:
    args = delta_args(**change)
    for form in (gated_delta_rule_recurrent, gated_delta_rule_chunked):
        with pytest.raises(KernelArgumentError) as error:
            form(**args)
        assert error.value.name == name
