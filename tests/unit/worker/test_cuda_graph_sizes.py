"""Which decode batch sizes the worker captures as CUDA graphs, which models' layouts allow
them, the flag that turns them off, and why a step runs eagerly (the capture itself runs on a
GPU: tests/integration/test_gpu_smollm2.py and test_gpu_families.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.models import save_tiny_model
from worker_service.config import WorkerConfig
from worker_service.cuda_graphs import (
    EAGER_ENFORCED,
    EAGER_KV_LAYOUT,
    capture_sizes,
    eager_reason,
    graphs_off,
    layout_allows_graphs,
    padded_size,
)
from worker_service.worker import Worker


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


# Which tiny models' layouts replay decode graphs: one KV group and no state pool. Windows
# beside full layers (or NoPE layers, or K/V shared across layers) make several groups;
# Gated DeltaNet layers keep a state.
CAPTURES = {"llama": True, "phi3": True, "mixtral": True, "qwen3_moe": True, "granite": True}
EAGER_BY_LAYOUT = ("gemma3", "gemma2", "qwen3", "gpt_oss", "gemma4", "olmo3", "smollm3")
EAGER_BY_STATE = ("qwen3_5", "qwen3_next")


@pytest.mark.parametrize("kind", [*CAPTURES, *EAGER_BY_LAYOUT, *EAGER_BY_STATE])
def test_which_layouts_replay_decode_graphs(kind: str, tmp_path: Path) -> None:
    worker = Worker(WorkerConfig(model=str(save_tiny_model(kind, tmp_path / kind))))
    worker.load_model()
    layout = worker.model_info.kv_layout
    allowed = layout_allows_graphs(layout)
    assert allowed == (kind in CAPTURES)
    assert graphs_off(False, layout) == (None if allowed else EAGER_KV_LAYOUT)
    assert graphs_off(True, layout) == EAGER_ENFORCED
    assert worker._graphs_off() is None  # a CPU worker has no graphs to count
