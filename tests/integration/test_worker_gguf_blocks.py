"""SmolLM2 from its shipped Q4_1 file with its weights kept in the file's blocks
(`--linear-impl gguf`): in exact mode against HF generate on the dequantized file, token for
token in float32; in fast mode (8-bit activations) its perplexity on a fixed text beside
exact mode's and HF's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType

from llmserve.gguf_files import open_gguf
from llmserve.model_spec import resolve_model
from llmserve.sampling_params import SamplingParams
from llmserve_kernels import cpu as cpu_kernels
from llmserve_kernels.cpu.quant import QuantMode, QuantWeight
from scheduler_service.engine.offline import generate
from tests.support.engines import engine_on_worker
from tests.support.models import (
    SMOLLM2_EXACTNESS_NEW,
    SMOLLM2_EXACTNESS_TEXTS,
    hf_greedy_outputs,
    load_smollm2,
    load_spec,
    smollm2_exactness,
)
from worker_service.config import WorkerConfig, WorkerConfigError
from worker_service.models.gguf_weights import (
    CROSSOVER_ROWS,
    NEVER_DEQUANTIZE,
    dequantize_rows,
    dequantized_matmul,
    quant_matmul,
)
from worker_service.worker import Worker

pytestmark = pytest.mark.slow

TEXTS = SMOLLM2_EXACTNESS_TEXTS
NEW = SMOLLM2_EXACTNESS_NEW
# A fixed text for perplexity, read in chunks of PERPLEXITY_CHUNK tokens: under
# dequantize_rows, so that fast mode's kernel (not the dequantizing path) reads every token.
FIXED_TEXT = (
    "The river rises in the hills north of the town and runs south through farmland for "
    "about forty miles before it reaches the sea. In the spring the snow melts and the water "
    "climbs the stone steps of the old mill; by late summer children can wade across it at "
    "the ford below the church. The mill was built in the seventeenth century to grind corn, "
    "later turned to sawing timber, and was finally closed when the railway brought cheaper "
    "flour from the cities. Today it is a small museum, open on weekends, where visitors can "
    "watch the great wheel turn and read the ledgers of the last miller, who recorded every "
    "sack that passed through his doors for forty-one years."
)
PERPLEXITY_CHUNK = 32


def gguf_worker(hf: Any, mode: str) -> Worker:
    worker = Worker(
        WorkerConfig(
            model="smollm2", dtype="float32", num_threads=2, linear_impl="gguf", quant_mode=mode
        )
    )
    worker.load_from_hf(hf)
    return worker


@pytest.fixture(scope="module")
def loaded() -> tuple[Worker, Any, list[list[int]], Any]:
    torch.set_num_threads(2)
    tok, hf = load_smollm2()
    return gguf_worker(hf, "exact"), hf, smollm2_exactness()[0], tok


def test_every_weight_with_a_kernel_runs_on_blocks_and_the_dense_copies_are_gone(
    loaded: Any,
) -> None:
    worker = loaded[0]
    model = worker._model
    assert model.linear.func is quant_matmul and model.linear.keywords == {"mode": "exact"}
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            assert isinstance(getattr(layer, name), QuantWeight), name
    # SmolLM2 ties its head to the embedding, which the file holds as Q8_0: one tensor.
    assert isinstance(model.embed, QuantWeight) and model.embed.ggml_type == 8
    assert model.lm_head is model.embed
    # The native decode step was rebuilt on the blocks, not left on the dense weights.
    step = model.decode_step
    assert step is not None
    assert all(isinstance(w, QuantWeight) for layer in step._layers for w in layer.projections())
    embed, _, head = step._globals
    assert embed == head == model.embed.data_ptr()
    # The worker says so: the weights held are the file's tensors, bytes for bytes (its norms
    # are float32 in the file too).
    source = resolve_model("smollm2")
    tensors = open_gguf(f"{source.path}/{source.gguf_file}").tensors
    info = worker.model_info
    assert (info.linear_impl, info.weight_format) == ("gguf", "gguf Q4_1+Q8_0 exact")
    assert info.weight_bytes == sum(int(t.n_bytes) for t in tensors)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_long_row_blocks_take_the_dequantizing_path_with_the_same_product(
    loaded: Any, mode: QuantMode
) -> None:
    """Prefill-sized inputs may dequantize the weight whole (dequantize_rows, measured here
    per mode); that product is the kernel's in the same mode, row by
    row, up to summation order (fast mode's 8-bit activations included, so a token's product
    does not depend on its step's rows)."""
    weight = loaded[0]._model.layers[0].gate_up
    assert isinstance(weight, QuantWeight)
    assert dequantize_rows(weight, mode) in (*CROSSOVER_ROWS, NEVER_DEQUANTIZE)
    rows = 96
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(3))
    whole = dequantized_matmul(x, weight, None, mode)
    by_row = torch.cat([quant_matmul(x[i : i + 1], weight, mode=mode) for i in range(rows)])
    assert whole.shape == by_row.shape == (rows, weight.shape[0])
    torch.testing.assert_close(whole, by_row, rtol=1e-5, atol=1e-5)


def test_greedy_output_equals_hf_on_the_dequantized_file(loaded: Any) -> None:
    worker, _, prompts, _ = loaded
    expected = smollm2_exactness()[1]
    engine = engine_on_worker(
        worker, gpu_blocks=64, cpu_blocks=0, batched_tokens=64, max_model_len=2048
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outputs = generate(engine, prompts, params)  # batched, the long prompt chunked
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_all_blocks_free(engine)
    # One at a time: every decode step is the native one (a single sequence).
    single = generate(engine, prompts[:1], params)
    assert single[0].outputs[0].token_ids == expected[0]


def perplexity(worker: Worker, ids: list[int]) -> float:
    engine = engine_on_worker(
        worker, gpu_blocks=64, cpu_blocks=0, batched_tokens=PERPLEXITY_CHUNK, max_model_len=2048
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    (out,) = generate(engine, [ids], params)
    logprobs = [e.token.logprob for e in out.prompt_logprobs or []]
    assert len(logprobs) == len(ids) - 1
    return float(torch.tensor(logprobs).mean().neg().exp())


def hf_perplexity(hf: Any, ids: list[int]) -> float:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1]
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).exp())


def test_fast_mode_perplexity_on_a_fixed_text_is_exact_modes_within_two_percent(
    loaded: Any,
) -> None:
    """Fast mode is not HF's model: its 8-bit activations, its K/V cache in bfloat16, and its
    prompts' attention in bfloat16 dot products where the CPU has them, cost a little
    perplexity. Exact mode's is
    HF's; the figures are in bench/RESULTS.md (bench/quant_quality.py)."""
    exact_worker, hf, _, tok = loaded
    fast_worker = gguf_worker(hf, "fast")
    assert [b.bf16_prompt_dots for b in fast_worker.runner.backends] == [
        cpu_kernels.has_bf16_dots()
    ] * len(fast_worker.runner.backends)
    assert not any(b.bf16_prompt_dots for b in exact_worker.runner.backends)
    # ... and its K/V cache in bfloat16 (`kv_cache_dtype` auto); exact mode keeps float32.
    assert fast_worker.kv_dtype == torch.bfloat16 and exact_worker.kv_dtype == torch.float32
    ids = tok(FIXED_TEXT)["input_ids"]
    hf_ppl = hf_perplexity(hf, ids)
    exact = perplexity(exact_worker, ids)
    fast = perplexity(fast_worker, ids)
    assert exact == pytest.approx(hf_ppl, rel=1e-4)
    assert fast != exact  # the fast kernel ran
    assert fast == pytest.approx(exact, rel=0.02)


def test_a_model_that_is_not_a_gguf_file_is_refused_by_name(tmp_path: Any) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    worker = Worker(WorkerConfig(model=str(tmp_path), dtype="float32", linear_impl="gguf"))
    with pytest.raises(WorkerConfigError, match="linear_impl.*not a GGUF file"):
        worker.load_model()


def test_gemma3s_mixed_file_runs_on_its_q5_0_q4_k_q6_k_q8_0_blocks_as_hf() -> None:
    """Gemma 3 270M's Q4_K_M file (the dev dependency): the k-quants and Q5_0 in exact mode,
    through the native step and the per-layer path, greedy as HF's dequantized model. Its
    layers whose v is Q8_0 and q, k Q5_0 run on a Q8_0 q/k/v (gguf_widen.py), the others on
    Q5_0."""
    torch.set_num_threads(2)
    tok, hf = load_spec("gemma3-270m")
    prompts = [tok(t)["input_ids"] for t in TEXTS[:4]]
    expected = hf_greedy_outputs(hf, prompts, 32)
    worker = Worker(
        WorkerConfig(
            model="gemma3-270m", dtype="float32", num_threads=2, linear_impl="gguf",
            quant_mode="exact",
        )
    )  # fmt: skip
    worker.load_from_hf(hf)
    model = worker._model
    assert worker.model_info.weight_format == "gguf Q4_K+Q5_0+Q6_K+Q8_0 exact"
    assert all(isinstance(layer.down, QuantWeight) for layer in model.layers)
    qkv_types = [GGMLQuantizationType(layer.qkv.ggml_type).name for layer in model.layers]
    assert sorted(set(qkv_types)) == ["Q5_0", "Q8_0"], qkv_types
    assert isinstance(model.embed, QuantWeight) and model.decode_step is not None
    engine = engine_on_worker(
        worker, gpu_blocks=64, cpu_blocks=0, batched_tokens=64, max_model_len=2048
    )
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = generate(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_all_blocks_free(engine)


def assert_all_blocks_free(engine: Any) -> None:
    """Every block is free again (the null block of a windowed layout is never free)."""
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks - bm.num_reserved
