"""Our Llama-family implementation against transformers on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from tests.support.models import load_hf, save_tiny_model, tiny_config
from worker_service.config import WorkerConfig, WorkerConfigError
from worker_service.models import UnsupportedModelError
from worker_service.models.linear import pack_weight, packed_linear_available, packed_matmul
from worker_service.models.rope import inverse_frequencies

from .factories import GreedyDriver, hf_greedy, make_worker

PROMPTS = {
    0: [3, 14, 15, 92, 65, 35, 89, 79, 32, 38],
    1: [2, 71, 82],
    2: [11, 12, 13, 14, 15, 16, 17],
}


@pytest.mark.parametrize("linear_impl", ["torch", "onednn", "native"])
@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "mistral"])
def test_tiny_checkpoint_matches_hf_greedy(
    kind: str, linear_impl: str, tiny_model_dir: dict[str, Path]
) -> None:
    hf = load_hf(tiny_model_dir[kind])
    worker = make_worker(tiny_model_dir[kind], linear_impl=linear_impl)
    assert worker.model_info.architecture == type(hf).__name__
    assert worker.model_info.linear_impl == linear_impl
    outputs = GreedyDriver(worker).run_greedy(PROMPTS, max_new_tokens=10)
    for seq_id, prompt in PROMPTS.items():
        assert outputs[seq_id] == hf_greedy(hf, prompt, 10), (kind, seq_id)


def test_qwen2_has_qkv_bias_and_tied_embeddings(tiny_model_dir: dict[str, Path]) -> None:
    model = make_worker(tiny_model_dir["qwen2"], linear_impl="torch").model
    assert model.layers[0].qkv_bias is not None
    assert model.lm_head.data_ptr() == model.embed.data_ptr()
    llama = make_worker(tiny_model_dir["llama"], linear_impl="torch").model
    assert llama.layers[0].qkv_bias is None
    assert llama.lm_head.data_ptr() != llama.embed.data_ptr()


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_packed_matmul_matches_f_linear(dtype: torch.dtype, tol: float) -> None:
    if not packed_linear_available(torch.device("cpu"), dtype):
        # This CPU cannot pack the dtype (bfloat16 without AVX-512): the worker must not try.
        assert dtype == torch.bfloat16
        assert not torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    packed = pack_weight(weight)
    for rows in (0, 1, 7, 130):
        x = torch.randn(rows, 80, generator=gen).to(dtype)
        got = packed_matmul(x, packed, bias)
        assert got.shape == (rows, 96) and got.dtype == dtype
        torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=tol, atol=tol)


def test_linear_impl_auto_follows_the_attention_backend(tiny_model_dir: dict[str, Path]) -> None:
    path = tiny_model_dir["llama"]
    assert make_worker(path, attention_backend="cpu").model_info.linear_impl == "onednn"
    assert make_worker(path, attention_backend="torch").model_info.linear_impl == "torch"
    # Explicit onednn under the reference attention backend is allowed.
    worker = make_worker(path, attention_backend="torch", linear_impl="onednn")
    assert worker.model.packed_linear
    # bfloat16: oneDNN where this CPU lets it pack bfloat16 weights, the native kernels else.
    expected = (
        "onednn" if packed_linear_available(torch.device("cpu"), torch.bfloat16) else "native"
    )
    bf16 = make_worker(path, dtype="bfloat16", attention_backend="cpu")
    assert bf16.model_info.linear_impl == expected


def test_native_linear_refuses_shapes_it_cannot_run_naming_the_option(tmp_path: Path) -> None:
    path = save_tiny_model("llama", tmp_path / "odd", intermediate_size=100)
    with pytest.raises(WorkerConfigError, match="linear_impl: native cannot") as info:
        make_worker(path, linear_impl="native")
    assert info.value.field == "linear_impl"
    assert make_worker(path, dtype="bfloat16").model_info.linear_impl in ("onednn", "torch")


def test_bad_linear_impl_is_named() -> None:
    with pytest.raises(WorkerConfigError, match="linear_impl") as info:
        WorkerConfig(linear_impl="mkl")  # type: ignore[arg-type]
    assert info.value.field == "linear_impl"


def test_onednn_refuses_float16_naming_the_option(tiny_model_dir: dict[str, Path]) -> None:
    with pytest.raises(WorkerConfigError, match="linear_impl: onednn needs") as info:
        make_worker(tiny_model_dir["llama"], dtype="float16", linear_impl="onednn")
    assert info.value.field == "linear_impl"


def test_llama3_inverse_frequencies_match_transformers(tiny_model_dir: dict[str, Path]) -> None:
    hf = load_hf(tiny_model_dir["llama3"])
    ours = inverse_frequencies(16, 500000.0, tiny_config("llama3").rope_parameters)
    torch.testing.assert_close(ours, hf.model.rotary_emb.inv_freq, rtol=0, atol=0)
    # The scaling must actually change something at this head size.
    assert not torch.equal(ours, inverse_frequencies(16, 500000.0, None))


def test_unsupported_architecture_fails_at_load_listing_supported(tmp_path: Path) -> None:
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(
        tmp_path
    )
    with pytest.raises(
        UnsupportedModelError, match="'GPT2LMHeadModel'.*supported: .*Gemma3ForCausalLM"
    ):
        make_worker(tmp_path)


def test_unsupported_rope_type_is_named() -> None:
    with pytest.raises(UnsupportedModelError, match="'dynamic'"):
        inverse_frequencies(16, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


def test_model_info(tiny_model_dir: dict[str, Path]) -> None:
    info = make_worker(tiny_model_dir["llama"], max_model_len=128).model_info
    assert (info.eos_token_id, info.max_model_len, info.dtype, info.block_size) == (
        1,
        128,
        "float32",
        4,
    )
    assert (info.device, info.attention_backend, info.vocab_size) == ("cpu", "cpu", 128)


def test_weight_bytes_are_the_checkpoints_on_the_plain_torch_path(
    tiny_model_dir: dict[str, Path],
) -> None:
    """No packed or native copies: the weights held are the checkpoint's parameters (q/k/v
    and gate/up fused, which moves bytes without adding any), its tied head counted once."""
    path = tiny_model_dir["llama"]
    info = make_worker(path, attention_backend="torch", linear_impl="torch").model_info
    hf = load_hf(path)
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in hf.parameters()
    }
    assert (info.weight_format, info.linear_impl) == ("float32", "torch")
    assert info.weight_bytes == sum(storages.values())
