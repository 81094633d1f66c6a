"""Which decode batch sizes the worker captures as CUDA graphs, and the flag that turns them
off (the capture itself runs on a GPU: tests/integration/test_gpu_smollm2.py)."""

from __future__ import annotations

import pytest

from worker_service.cuda_graphs import capture_sizes, eager_reason, padded_size


@pytest.mark.parametrize(
    ("max_batch", "sizes"),
    [
        (0, []),
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (20, [1, 2, 4, 8, 16, 20]),
        (32, [1, 2, 4, 8, 16, 24, 32]),
    ],
)
def test_capture_sizes(max_batch: int, sizes: list[int]) -> None:
    assert capture_sizes(max_batch) == sizes


def test_256_sequences_take_35_graphs() -> None:
    sizes = capture_sizes(256)
    assert len(sizes) == 35 and sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256


def test_enforce_eager_reaches_the_worker_config() -> None:
    from worker_service.__main__ import build_config, parse_args

    assert build_config(parse_args([])).enforce_eager is False
    assert build_config(parse_args(["--enforce-eager"])).enforce_eager is True


SIZES = capture_sizes(20)  # 1, 2, 4, 8, 16, 20


@pytest.mark.parametrize(
    ("shape", "reason"),
    [
        # (prefills, decodes, logit rows, table width): a decode-only step of 1-20 rows replays.
        ((0, 1, 1, 4), None),
        ((0, 13, 13, 64), None),
        ((0, 20, 20, 64), None),
        # A prompt chunk in the step, alone or beside decodes.
        ((1, 0, 1, 4), "prefill"),
        ((2, 6, 8, 4), "prefill"),
        # Drafted rows: more rows computed than sample, or fewer rows sampling than decode.
        ((0, 4, 9, 4), "partial_logits"),
        ((0, 4, 3, 4), "partial_logits"),
        ((0, 4, 4, 65), "wide_tables"),
        ((0, 21, 21, 4), "too_many_seqs"),
    ],
)
def test_eager_reason_names_why_a_step_cannot_replay(
    shape: tuple[int, int, int, int], reason: str | None
) -> None:
    prefills, decodes, rows, width = shape
    got = eager_reason(
        SIZES,
        64,
        num_prefills=prefills,
        num_decodes=decodes,
        num_logit_rows=rows,
        table_width=width,
    )
    assert got == reason


@pytest.mark.parametrize(("num_seqs", "padded"), [(1, 1), (3, 4), (5, 8), (9, 16), (20, 20)])
def test_padded_size_is_the_smallest_captured_size_that_holds_the_rows(
    num_seqs: int, padded: int
) -> None:
    assert padded_size(SIZES, num_seqs) == padded
    assert padded_size(SIZES, 21) is None
