"""The native decode step (llmserve_kernels/cpu/decode.cpp): one call per step for pure decode
batches, against the per-layer path of the same worker and against torch's matmul, for the Llama
kinds and every dense family (their tiny models have windows shorter than these sequences,
soft-caps, NoPE layers, partial rotary...)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from llmserve_kernels import KernelArgumentError
from llmserve_kernels.cpu import argmax_logsumexp
from llmserve_kernels.cpu.decode import ArgmaxLogprobs, DecodeShape
from llmserve_kernels.cpu.linear_rows import linear_rows
from tests.support.models import FAMILY_KINDS, KINDS, save_tiny_model
from worker_service.models.native import default_native_max_batch
from worker_service.worker import Worker

from .factories import GreedyDriver, make_worker

PROMPTS = {0: [3, 14, 15, 92, 65, 35, 89, 79, 32, 38], 1: [2, 71, 82], 2: [11, 12, 13, 14, 15]}
# The families whose decode steps stay on the per-layer path (models/native.py).
MOE_KINDS = ("qwen3_moe", "mixtral", "gpt_oss")
# Gemma 4: per-layer inputs, KV-shared layers, value norm, layer scalars, global layers of
# another shape (and experts in the multimodal tiny model) are not in decode.cpp.
GEMMA4_KINDS = ("gemma4", "gemma4_mm")
DENSE_FAMILIES = [kind for kind in FAMILY_KINDS if kind not in MOE_KINDS + GEMMA4_KINDS]


@pytest.fixture(scope="module")
def model_dir(
    tiny_model_dir: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    families = {kind: save_tiny_model(kind, root / kind) for kind in FAMILY_KINDS}
    return {**tiny_model_dir, **families}


def _count_native_steps(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the batch size of every step the native decode call runs, and checks the
    argmax and logprob it finds per row against `argmax_logsumexp` on its logits."""
    step = worker.model.decode_step
    assert step is not None
    calls: list[int] = []
    run = step.run

    def counted(input_ids: torch.Tensor, *args: object) -> tuple[torch.Tensor, ArgmaxLogprobs]:
        calls.append(input_ids.shape[0])
        logits, argmax = run(input_ids, *args)  # type: ignore[arg-type]
        best, lse, top = argmax_logsumexp(logits)
        assert argmax.tokens == best.tolist()
        assert argmax.logprobs == (top - lse).tolist()
        return logits, argmax

    monkeypatch.setattr(step, "run", counted)
    return calls


def _greedy_with_logprobs(worker: Worker, steps: int) -> dict[int, list[tuple[int, float]]]:
    driver = GreedyDriver(worker)
    seen: dict[int, list[tuple[int, float]]] = {seq_id: [] for seq_id in PROMPTS}
    execute = worker.execute

    def recording(step):  # type: ignore[no-untyped-def]
        result = execute(step)
        for out in result.outputs:
            seen[out.seq_id].append((out.samples[0].token_id, out.samples[0].logprob))
        return result

    worker.execute = recording  # type: ignore[method-assign]
    driver.run_greedy(PROMPTS, max_new_tokens=steps)
    return seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", [*KINDS, *DENSE_FAMILIES])
def test_native_decode_matches_the_per_layer_path(
    kind: str, dtype: str, model_dir: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    native = make_worker(model_dir[kind], dtype=dtype)
    per_layer = make_worker(model_dir[kind], dtype=dtype, native_decode_max_batch=0)
    assert per_layer.model.decode_step is None
    calls = _count_native_steps(native, monkeypatch)
    got = _greedy_with_logprobs(native, steps=12)
    want = _greedy_with_logprobs(per_layer, steps=12)
    assert calls == [len(PROMPTS)] * 11  # every decode step, none of the prefill
    tolerance = 1e-4 if dtype == "float32" else 0.1
    for seq_id in PROMPTS:
        pairs = list(zip(got[seq_id], want[seq_id], strict=True))
        if dtype == "bfloat16":
            # A bfloat16 near-tie may pick another token (both the best within the
            # tolerance); the sequences differ from there on, so the comparison stops.
            split = next((i for i, (a, b) in enumerate(pairs) if a[0] != b[0]), len(pairs))
            assert split >= len(pairs) // 2, (kind, seq_id, pairs)
            pairs = pairs[: split + 1]
        else:
            assert [a[0] for a, _ in pairs] == [b[0] for _, b in pairs], (kind, seq_id)
        for (_, a), (_, b) in pairs:
            assert abs(a - b) <= tolerance, (kind, seq_id, a, b)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_experts_decode_per_layer_saying_why(kind: str, model_dir: dict[str, Path]) -> None:
    worker = make_worker(model_dir[kind])
    assert worker.model.decode_step is None
    assert "mixture of experts" in (worker.model.native_decode_refused or "")
    assert ("attention sinks" in (worker.model.native_decode_refused or "")) == (kind == "gpt_oss")


@pytest.mark.parametrize("kind", GEMMA4_KINDS)
def test_gemma4_decodes_per_layer_naming_its_features(
    kind: str, model_dir: dict[str, Path]
) -> None:
    worker = make_worker(model_dir[kind])
    assert worker.model.decode_step is None
    refused = worker.model.native_decode_refused or ""
    features = ("KV-shared layers", "value norm", "per-layer inputs", "layer scalars")
    for feature in (*features, "per-layer attention shapes"):
        assert feature in refused, (feature, refused)
    assert ("mixture of experts" in refused) == (kind == "gemma4_mm")


def test_batches_over_the_limit_take_the_per_layer_path(
    tiny_model_dir: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = make_worker(tiny_model_dir["llama"], native_decode_max_batch=2)
    calls = _count_native_steps(worker, monkeypatch)
    _greedy_with_logprobs(worker, steps=4)
    assert calls == []  # three sequences decode together: over the limit of 2


def test_default_native_batch_follows_the_lm_head_size(tiny_model_dir: dict[str, Path]) -> None:
    # Measured (bench/RESULTS.md): SmolLM2's native step gains through 8 sequences and loses
    # from about 12; Gemma 3 270M's 262144 x 640 head loses to oneDNN from 8 on.
    smollm2 = SimpleNamespace(vocab_size=49152, hidden_size=576)
    gemma3_270m = SimpleNamespace(vocab_size=262144, hidden_size=640)
    assert default_native_max_batch(smollm2) == 8  # type: ignore[arg-type]
    assert default_native_max_batch(gemma3_270m) == 4  # type: ignore[arg-type]
    # Weights in GGUF blocks: the native step wins at every batch measured, for any head.
    assert default_native_max_batch(gemma3_270m, blocks=True) == 256  # type: ignore[arg-type]
    worker = make_worker(tiny_model_dir["llama"])  # no flag: the model's default
    assert worker.model.native_decode is not None and worker.model.native_decode.max_batch == 8


def test_shapes_the_step_cannot_run_keep_the_per_layer_path(tmp_path: Path) -> None:
    assert DecodeShape(2, 64, 100, 4, 2, 16, 128, 1e-6).unsupported_reason() == (
        "intermediate size 100 not a multiple of 8"
    )
    # Its attention is the paged decode kernel, compiled for a fixed set of head sizes.
    reason = DecodeShape(2, 96, 128, 4, 2, 24, 128, 1e-6).unsupported_reason()
    assert reason is not None and reason.startswith("head_dim 24 ")
    assert "20 query heads over 1 kv heads" in str(
        DecodeShape(2, 1280, 128, 20, 1, 64, 128, 1e-6).unsupported_reason()
    )
    path = save_tiny_model("llama", tmp_path / "odd", intermediate_size=100)
    assert make_worker(path).model.decode_step is None


@pytest.mark.parametrize("rows", [1, 2, 3, 17])
@pytest.mark.parametrize("out_features", [4, 13, 96])
def test_linear_rows_matches_f_linear_float32(rows: int, out_features: int) -> None:
    gen = torch.Generator().manual_seed(rows * 100 + out_features)
    x = torch.randn(rows, 72, generator=gen)
    weight = torch.randn(out_features, 72, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    want = x.double() @ weight.double().T + bias.double()
    torch.testing.assert_close(linear_rows(x, weight, bias).double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear_rows(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 17])  # 3 and 17 widen each weight tile once
def test_linear_rows_bfloat16_rounds_the_float32_sum_once(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    weight = torch.randn(21, 64, generator=gen).bfloat16()
    exact = (x.double() @ weight.double().T).float()
    got = linear_rows(x, weight)
    assert got.dtype == torch.bfloat16
    # Within half a bfloat16 step of the exact sum (a step is at most |x| * 2^-7), plus
    # float32 summation noise; rounding the inputs' product to bfloat16 first would not be.
    half_step = exact.abs() * 2.0**-8
    assert bool(((got.float() - exact).abs() <= half_step + 1e-4).all())


def test_linear_rows_names_bad_arguments() -> None:
    with pytest.raises(KernelArgumentError, match="weight"):
        linear_rows(torch.randn(2, 12), torch.randn(5, 12))  # 12 is not a multiple of 8
    with pytest.raises(KernelArgumentError, match="bias"):
        linear_rows(torch.randn(2, 16), torch.randn(5, 16), torch.randn(4))
    with pytest.raises(KernelArgumentError, match="weight"):
        linear_rows(torch.randn(2, 16), torch.randn(5, 16).bfloat16())


def test_positions_past_the_rotary_tables_are_refused_on_the_native_step_too(
    tiny_model_dir: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The native step indexes the rotary tables unchecked: the model checks every step's
    positions before it, as it does for the per-layer path. A worker driven past its length
    (no scheduler stops it here) gets a named error, not a read past the tables."""
    worker = make_worker(tiny_model_dir["llama"], max_model_len=12)
    assert worker.model.decode_step is not None
    steps = _count_native_steps(worker, monkeypatch)
    driver = GreedyDriver(worker)
    with pytest.raises(KernelArgumentError, match="positions"):
        # The prompt's 10 positions, then decode steps at 10, 11 and 12.
        driver.run_greedy({0: PROMPTS[0]}, max_new_tokens=4)
    assert steps == [1, 1]  # positions 10 and 11 ran natively; 12 was refused before it
