"""The causal conv1d with per-sequence states: hand-worked numbers, calls split and packed,
the decode update, and transformers' own torch functions as the oracle."""

from __future__ import annotations

import pytest
import torch

from llmserve_kernels import KernelArgumentError
from llmserve_kernels.causal_conv1d import Activation, causal_conv1d, causal_conv1d_update
from tests.kernels.linear_state import make_state_pool, offsets, slots

TIGHT = dict(atol=1e-6, rtol=1e-6)
DIM, KERNEL = 12, 4


def make_conv(
    gen: torch.Generator, dim: int = DIM, kernel_size: int = KERNEL
) -> tuple[torch.Tensor, torch.Tensor]:  # weight [dim, kernel_size], bias [dim]
    weight = torch.randn(dim, kernel_size, generator=gen) / kernel_size
    return weight, torch.randn(dim, generator=gen)


def run_one(
    x: torch.Tensor,  # [len, dim]
    state: torch.Tensor | None,  # [kernel_size - 1, dim]; None: a new sequence
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: Activation = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: its outputs and the state its slot keeps after."""
    pool = torch.zeros(1, weight.shape[1] - 1, x.shape[1]) if state is None else state[None].clone()
    initial = torch.tensor([state is not None])
    where = offsets([x.shape[0]])
    out = causal_conv1d(x, pool, weight, bias, where, slots([0]), initial, activation)
    return out, pool[0]


def test_hand_worked_taps() -> None:
    """One channel, taps (1, 10, 100) oldest first, no bias or activation: each output is
    x[t-2] + 10 x[t-1] + 100 x[t]; the slot then keeps the last two inputs."""
    weight = torch.tensor([[1.0, 10.0, 100.0]])
    x = torch.tensor([[1.0], [2.0], [3.0]])
    out, state = run_one(x, None, weight, None, activation=None)
    assert out.flatten().tolist() == [100.0, 210.0, 321.0]
    assert state.flatten().tolist() == [2.0, 3.0]
    # From kept inputs (5, 7), one token 4: 5 + 70 + 400, then (7, 4) are kept; bias 0.5.
    out, state = run_one(torch.tensor([[4.0]]), torch.tensor([[5.0], [7.0]]), weight, None, None)
    assert out.item() == 475.0 and state.flatten().tolist() == [7.0, 4.0]
    out, _ = run_one(
        torch.tensor([[4.0]]), torch.tensor([[5.0], [7.0]]), weight, torch.tensor([0.5])
    )
    assert out.item() == pytest.approx(475.5)  # SiLU of a large number is itself


@pytest.mark.parametrize("cuts", [[1], [2], [3], [1, 2], [5, 6], [2, 17], [19]])
def test_state_carried_across_calls(cuts: list[int]) -> None:
    """Pieces shorter than the kept window included: the slot keeps old inputs beside new."""
    gen = torch.Generator().manual_seed(len(cuts) * 31 + cuts[0])
    weight, bias = make_conv(gen)
    x = torch.randn(20, DIM, generator=gen)
    state = torch.randn(KERNEL - 1, DIM, generator=gen)
    expected, expected_state = run_one(x, state, weight, bias)
    pieces, kept = [], state
    for begin, end in zip([0, *cuts], [*cuts, 20], strict=True):
        out, kept = run_one(x[begin:end], kept, weight, bias)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces), expected, **TIGHT)
    torch.testing.assert_close(kept, expected_state, **TIGHT)


def test_packed_batch_equals_per_sequence() -> None:
    gen = torch.Generator().manual_seed(3)
    weight, bias = make_conv(gen)
    lens = [6, 1, 0, 2, 15, 1]
    seq_slots = [3, 0, 5, 7, 1, 6]
    new = [True, False, False, True, False, False]
    x = torch.randn(sum(lens), DIM, generator=gen)
    pool = make_state_pool(8, KERNEL - 1, DIM, generator=gen)
    for slot, is_new in zip(seq_slots, new, strict=True):
        if is_new:
            pool[slot] = float("nan")
    before = pool.clone()
    has_initial = torch.tensor([not n for n in new])
    out = causal_conv1d(x, pool, weight, bias, offsets(lens), slots(seq_slots), has_initial)
    starts = offsets(lens).tolist()
    for seq, slot in enumerate(seq_slots):
        begin, end = starts[seq], starts[seq + 1]
        if begin == end:
            assert torch.equal(pool[slot], before[slot])
            continue
        expected, expected_state = run_one(
            x[begin:end], None if new[seq] else before[slot], weight, bias
        )
        torch.testing.assert_close(out[begin:end], expected, **TIGHT)
        torch.testing.assert_close(pool[slot], expected_state, **TIGHT)
    assert torch.equal(pool[[2, 4]], before[[2, 4]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_update_token_by_token_equals_one_call(dtype: torch.dtype) -> None:
    """Four sequences decoding six tokens with causal_conv1d_update, against each sequence's
    six tokens in one causal_conv1d call."""
    gen = torch.Generator().manual_seed(8)
    weight, bias = make_conv(gen)
    seq_slots = [2, 4, 0, 3]
    x = torch.randn(6, 4, DIM, generator=gen).to(dtype)  # [step, seq, dim]
    pool = make_state_pool(5, KERNEL - 1, DIM, generator=gen, dtype=dtype)
    before = pool.clone()
    out = torch.stack(
        [causal_conv1d_update(x[t], pool, weight, bias, slots(seq_slots)) for t in range(6)]
    )
    assert out.dtype == dtype
    for seq, slot in enumerate(seq_slots):
        expected, expected_state = run_one(x[:, seq], before[slot], weight, bias)
        torch.testing.assert_close(out[:, seq], expected, **TIGHT)
        torch.testing.assert_close(pool[slot], expected_state, **TIGHT)
    assert torch.equal(pool[1], before[1])


# transformers as the oracle. Its conv state is [batch, dim, kernel_size]: our kept inputs
# as columns, after one oldest column that no output reads.


def test_prefill_matches_transformers() -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    gen = torch.Generator().manual_seed(4)
    weight, bias = make_conv(gen)
    x = torch.randn(2, 9, DIM, generator=gen)  # [batch, len, dim]
    for conv_bias in (None, bias):
        expected = causal_conv1d_fn(x.transpose(1, 2), weight, conv_bias, activation="silu")
        pool = torch.full((2, KERNEL - 1, DIM), float("nan"))
        new = torch.tensor([False, False])
        out = causal_conv1d(
            x.flatten(0, 1), pool, weight, conv_bias, offsets([9, 9]), slots([1, 0]), new
        )
        torch.testing.assert_close(out, expected.transpose(1, 2).flatten(0, 1), **TIGHT)
        # The layer's cached prefill runs the same function over its kept inputs and the
        # new ones, keeping the last outputs.
        kept = torch.randn(2, KERNEL - 1, DIM, generator=gen)
        history = torch.cat([kept, x], dim=1).transpose(1, 2)  # [batch, dim, kernel - 1 + len]
        expected = causal_conv1d_fn(history, weight, conv_bias, activation="silu")[..., -9:]
        pool = kept.clone()
        out = causal_conv1d(
            x.flatten(0, 1), pool, weight, conv_bias, offsets([9, 9]), slots([0, 1])
        )
        torch.testing.assert_close(out, expected.transpose(1, 2).flatten(0, 1), **TIGHT)
        torch.testing.assert_close(pool, x[:, -(KERNEL - 1) :], **TIGHT)


def test_update_matches_transformers() -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update as theirs

    gen = torch.Generator().manual_seed(6)
    weight, bias = make_conv(gen)
    pool = make_state_pool(3, KERNEL - 1, DIM, generator=gen)
    seq_slots = [2, 0]
    their_state = torch.cat(
        [torch.randn(2, DIM, 1, generator=gen), pool[seq_slots].transpose(1, 2)], dim=2
    )  # [batch, dim, kernel_size]
    for _ in range(3):
        x = torch.randn(2, DIM, generator=gen)
        expected = theirs(x[:, :, None], their_state, weight, bias, "silu")[:, :, 0]
        torch.testing.assert_close(
            causal_conv1d_update(x, pool, weight, bias, slots(seq_slots)), expected, **TIGHT
        )
        torch.testing.assert_close(pool[seq_slots], their_state[:, :, 1:].transpose(1, 2), **TIGHT)


@pytest.mark.parametrize(
    ("change", "name"),
    [
        (dict(weight=torch.zeros(DIM, 1)), "weight"),  # kernel_size 1 keeps nothing
        (dict(conv_state=torch.zeros(4, KERNEL, DIM)), "conv_state"),  # kernel_size columns
        (dict(conv_state=torch.zeros(4, KERNEL - 1, DIM, dtype=torch.bfloat16)), "conv_state"),
        (dict(bias=torch.zeros(DIM + 1)), "bias"),
        (dict(state_slots=slots([4, 0])), "state_slots"),
        (dict(query_start_loc=offsets([2, 2])), "query_start_loc"),
        (dict(activation="gelu"), "activation"),
    ],
)
def test_argument_errors_name_the_argument(change: dict[str, object], name: str) -> None:
    args: dict[str, object] = dict(
        x=torch.zeros(5, DIM),
        conv_state=torch.zeros(4, KERNEL - 1, DIM),
        weight=torch.zeros(DIM, KERNEL),
        bias=None,
        query_start_loc=offsets([2, 3]),
        state_slots=slots([1, 2]),
    )
    args.update(change)
    with pytest.raises(KernelArgumentError) as error:
        causal_conv1d(**args)  # type: ignore[arg-type]
    assert error.value.name == name
