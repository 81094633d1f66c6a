"""Every model family through the scheduler and a real worker, against HF generate.

One tiny random model per family (tests/support/models.py: perturbed parameters, explicit
head_dim where the family allows it, sliding windows smaller than prompt + output, tied and
untied embeddings), on the `torch` and `cpu` attention backends; greedy output must equal
`generate(do_sample=False)` token for token in float32, also with chunked prefill, recompute
preemption and prefix-cache hits. On `cpu` the dense families' decode steps run as one native
call (models/native.py), and the tests check that they did; the experts families decode per
layer (and so does gpt-oss, whose attention sinks the native step lacks too, and Gemma 4,
whose per-layer inputs, KV-shared layers, value norm and layer scalars it lacks). Gemma 4's
KV-shared layers store no K/V: its layout holds blocks for the other layers only, and the
tests check that every block comes back."""

from __future__ import annotations

from typing import Any

import pytest

from llmserve.kv_layout import NULL_BLOCK
from scheduler_service.engine.config import PreemptionMode
from scheduler_service.engine.offline import generate
from scheduler_service.engine.sequence import SequenceStatus
from tests.integration.test_worker_engine_tiny import (
    BLOCK,
    GREEDY,
    NEW_TOKENS,
    PROMPTS,
    assert_all_free,
    hf_greedy,
    make_engine,
)
from tests.support.models import FAMILY_KINDS, WINDOW, load_hf, save_tiny_model, tiny_config
from worker_service.config import WorkerConfig
from worker_service.worker import Worker

FAMILIES = [(kind, backend) for kind in FAMILY_KINDS for backend in ("torch", "cpu")]


def _family_id(param: tuple[str, str]) -> str:
    return f"{param[0]}-{param[1]}"


def _has_window(kind: str) -> bool:
    """Whether the family's tiny HF config asks for sliding-window attention."""
    config = tiny_config(kind)
    text = getattr(config, "text_config", config)
    return (
        getattr(text, "sliding_window", None) is not None
        and getattr(text, "use_sliding_window", True) is not False
    )


@pytest.fixture(scope="module", params=FAMILIES, ids=_family_id)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Worker, Any, list[list[int]]]:
    kind, backend = request.param
    path = save_tiny_model(kind, tmp_path_factory.mktemp(kind) / kind)
    hf = load_hf(path)
    worker = Worker(
        WorkerConfig(model=str(path), block_size=BLOCK, num_threads=1, attention_backend=backend)
    )
    worker.load_model()
    assert worker.model_info.attention_backend == backend
    assert worker.model_info.architecture == type(hf).__name__
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    return worker, hf, expected


@pytest.mark.parametrize(
    "family", [p for p in FAMILIES if _has_window(p[0])], ids=_family_id, indirect=True
)
def test_windows_are_smaller_than_the_longest_sequence(family: tuple[Worker, Any, Any]) -> None:
    """The worker reads the family's window, and the prompts outrun it (so the HF comparisons
    below exercise the window)."""
    window = family[0].model.arch.sliding_window
    assert window is not None
    assert window <= WINDOW + 4 < max(map(len, PROMPTS)) + NEW_TOKENS


@pytest.mark.parametrize(
    "setup",
    [
        dict(),
        dict(batched_tokens=16),  # chunked prefill mixed with decodes
        dict(gpu_blocks=14, preemption=PreemptionMode.RECOMPUTE),
    ],
    ids=["plain", "chunked", "recompute"],
)
def test_greedy_batch_matches_hf(
    family: tuple[Worker, Any, list[list[int]]],
    setup: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker, _, expected = family
    native_steps = _count_native_steps(worker, monkeypatch)
    engine = make_engine(worker, **setup)
    outputs = generate(engine, PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # Most steps after the prefills are pure decodes: on `cpu` the native step ran them.
    assert (len(native_steps) > NEW_TOKENS // 2) == _runs_native(worker)
    if "preemption" in setup:
        assert engine.get_stats().num_preemptions_recompute > 0
    assert_all_free(engine, worker)


def test_prefix_cache_hits_keep_greedy_exact(family: tuple[Worker, Any, Any]) -> None:
    worker, hf, _ = family
    shared = PROMPTS[2] + PROMPTS[0]  # 34 tokens: 8 full blocks shared
    prompts = [shared + [7, 8, 9], shared + [100], shared[:20] + [3, 3]]
    engine = make_engine(worker)
    first = generate(engine, prompts[:1], GREEDY)
    rest = generate(engine, prompts[1:], GREEDY)
    assert engine.get_stats().prefix_cache_hits > 0
    got = [o.outputs[0].token_ids for o in first + rest]
    assert got == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert_all_free(engine, worker)


@pytest.mark.parametrize(
    "family", [p for p in FAMILIES if p[0] == "gemma3"], ids=_family_id, indirect=True
)
@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])
def test_windowed_groups_free_what_their_windows_left_under_preemption(
    family: tuple[Worker, Any, list[list[int]]], mode: PreemptionMode
) -> None:
    """Gemma 3's local layers form windowed KV groups: before every step, no running
    sequence's windowed table holds a block its window left, and the worker's windowed
    groups hold fewer blocks than its full group; preempted (swapped or recomputed) and
    resumed, the outputs still equal HF's."""
    worker, _, expected = family
    layout = worker.model_info.kv_layout
    assert len(layout.groups) > 1 and layout.reserves_null_block
    engine = make_engine(worker, gpu_blocks=14, preemption=mode)
    bm = engine.scheduler.block_manager
    execute = worker.execute
    checked: list[list[int]] = []

    def checking(step: Any, *args: Any) -> Any:
        for seq_group in engine.scheduler.running:
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                for g, group in enumerate(layout.groups):
                    first = group.first_live_block(seq.num_computed_tokens, BLOCK)
                    assert set(bm.get_block_table(seq, g)[:first]) <= {NULL_BLOCK}
        result = execute(step, *args)
        checked.append(worker.group_blocks_used())
        return result

    worker.execute = checking  # type: ignore[method-assign]
    try:
        outputs = generate(engine, PROMPTS, GREEDY)
    finally:
        del worker.execute
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = engine.get_stats()
    preemptions = {
        PreemptionMode.SWAP: stats.num_preemptions_swap,
        PreemptionMode.RECOMPUTE: stats.num_preemptions_recompute,
    }
    assert preemptions[mode] > 0
    # Once the sequences outgrow the window, each windowed group holds less than the full one.
    full = [g for g, group in enumerate(layout.groups) if group.sliding_window is None]
    windowed = [g for g, group in enumerate(layout.groups) if group.sliding_window is not None]
    assert any(all(used[w] < used[full[0]] for w in windowed) for used in checked), checked
    assert_all_free(engine, worker)


# Families with experts: their decode steps stay on the per-layer path (models/native.py).
EXPERTS = {"Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM"}
# Families with attention sinks, which the native decode step refuses too.
SINKS = {"GptOssForCausalLM"}
# Gemma 4 decodes per layer, with or without experts (the features the native step lacks).
GEMMA4 = {"Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"}
GEMMA4_BLOCKERS = ("KV-shared layers", "value norm", "per-layer inputs", "layer scalars")


def _runs_native(worker: Worker) -> bool:
    info = worker.model_info
    return info.attention_backend == "cpu" and info.architecture not in EXPERTS | GEMMA4


def _count_native_steps(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The batch size of every native decode step from now on (none without the step)."""
    calls: list[int] = []
    step = worker.model.decode_step
    if step is not None:
        run = step.run

        def counted(input_ids: Any, *args: Any) -> Any:
            calls.append(input_ids.shape[0])
            return run(input_ids, *args)

        monkeypatch.setattr(step, "run", counted)
    return calls


def test_cpu_backend_fuses_the_elementwise_ops_where_the_family_allows(
    family: tuple[Worker, Any, Any],
) -> None:
    """The cpu backend runs every family's norms, q/k norms, rotary and gated activations
    through the fused C++ ops, but Gemma 4's (KV-shared layers, per-layer head sizes: the
    equality with HF above covers both paths)."""
    worker = family[0]
    on_cpu = worker.model_info.attention_backend == "cpu"
    fused = on_cpu and worker.model_info.architecture not in GEMMA4
    assert worker.model.fused_ops == fused
    if worker.model_info.architecture in GEMMA4:
        assert "KV-shared layers" in worker.model.arch.fused_blockers()


def test_cpu_backend_selects_the_native_step_for_dense_families(
    family: tuple[Worker, Any, Any],
) -> None:
    model = family[0].model
    assert (model.decode_step is not None) == _runs_native(family[0])
    on_cpu = family[0].model_info.attention_backend == "cpu"
    architecture = family[0].model_info.architecture
    if on_cpu and architecture in EXPERTS:
        assert "mixture of experts" in (model.native_decode_refused or "")
        assert ("attention sinks" in (model.native_decode_refused or "")) == (architecture in SINKS)
    elif on_cpu and architecture in GEMMA4:
        refused = model.native_decode_refused or ""
        assert all(blocker in refused for blocker in GEMMA4_BLOCKERS), refused
        text = getattr(family[1].config, "text_config", family[1].config)
        assert ("mixture of experts" in refused) == text.enable_moe_block
    else:
        assert model.native_decode_refused is None
