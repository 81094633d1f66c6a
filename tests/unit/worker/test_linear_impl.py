"""What `--linear-impl auto` picks for GGUF files (worker_service/linear_impl.py): a file
with blocks the kernels read runs on them with the native `cpu` backend on CPU float32;
a file of float tensors, another dtype or another backend keeps dense weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from llmserve.model_spec import ModelSource, resolve_model
from tests.support.models import tiny_config
from worker_service.linear_impl import choose_linear_impl
from worker_service.models import read_arch

CPU = torch.device("cpu")


def choose(source: ModelSource, backend: str = "cpu", dtype: torch.dtype = torch.float32) -> str:
    arch = read_arch(tiny_config("llama"), "LlamaForCausalLM")
    return choose_linear_impl("auto", backend, arch, CPU, dtype, lambda: source)


def float_gguf(directory: Path) -> ModelSource:
    """A Llama GGUF file whose one tensor is float32: no block a kernel reads."""
    writer = GGUFWriter(directory / "tiny.F32.gguf", "llama")
    writer.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return ModelSource("tiny-f32", str(directory), "tiny.F32.gguf")


def test_a_quantized_gguf_file_runs_on_its_blocks_with_the_cpu_backend() -> None:
    assert choose(resolve_model("smollm2")) == "gguf"


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [("torch", torch.float32), ("cpu", torch.bfloat16)],
    ids=["torch-backend", "bfloat16"],
)
def test_a_quantized_gguf_file_keeps_dense_weights_where_its_kernels_do_not_run(
    backend: str, dtype: torch.dtype
) -> None:
    assert choose(resolve_model("smollm2"), backend, dtype) in ("onednn", "native", "torch")


def test_a_gguf_file_of_float_tensors_keeps_dense_weights(tmp_path: Path) -> None:
    assert choose(float_gguf(tmp_path)) == "onednn"
