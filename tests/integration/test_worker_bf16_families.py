"""bfloat16: every family's greedy tokens are transformers' bfloat16 argmax, up to near-ties.

Summation orders differ between our kernels and transformers', and in bfloat16 that moves
logits by an ulp or two, so exact token equality is not the criterion. Instead HF's
bfloat16 model is run teacher-forced over each prompt plus our output, and at every
generated position our token's logit must be within `NEAR_TIE_ULPS` bfloat16 ulps (of the
row's largest |logit|) of the row's maximum. Measured on these tiny models: the worst gap
is 0.125 (2 ulps at |logit| 8-16), and 42-48 of 48 tokens per family are exact argmaxes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from llmserve.sampling_params import SamplingParams
from scheduler_service.engine.offline import generate
from tests.integration.test_worker_engine_tiny import BLOCK, PROMPTS, make_engine
from tests.support.models import FAMILY_KINDS, save_tiny_model
from worker_service.config import WorkerConfig
from worker_service.worker import Worker

NEAR_TIE_ULPS = 4
NEW_TOKENS = 16


def bf16_ulp(magnitude: float) -> float:
    """The spacing of bfloat16 numbers (8 significant bits) around `magnitude`."""
    return 2.0 ** (math.floor(math.log2(magnitude)) - 7)


# Gemma 4 scores are unscaled (scale 1): its tiny models' attention is so peaked that bfloat16
# rounding orders move logits by 2-4x the tolerance. Measured on the tiny `gemma4` (global
# heads of 64): HF's own bfloat16 model is 17.9 tolerances from its float32 one, as ours is on
# either backend; ours is 2.25 tolerances from HF's bfloat16 on `torch` and 3.25 on `cpu`.
# Float32 output is HF's token for token on both: a rounding order, not a feature, differs.
# Strict on our kernels (`cpu`), so that matching SDPA's rounding turns it into a failure to
# fix. On `torch` the rounding is torch's own bfloat16 kernels', which differ by CPU: on a
# Zen 4 EPYC (family 25 model 17) gemma4 falls within the tolerance there, on the Xeon and the
# AVX2 EPYCs it did not, so that case may pass.
_REASON = "bfloat16 rounding orders vs SDPA on unscaled, peaked scores"
_ROUNDING_CASES = {
    ("gemma4", "torch"): pytest.mark.xfail(strict=False, reason=_REASON + " (torch's, by CPU)"),
    ("gemma4", "cpu"): pytest.mark.xfail(strict=True, reason=_REASON),
    ("gemma4_mm", "cpu"): pytest.mark.xfail(strict=True, reason=_REASON),
}
CASES = [
    pytest.param(kind, backend, marks=_ROUNDING_CASES[kind, backend])
    if (kind, backend) in _ROUNDING_CASES
    else (kind, backend)
    for kind in ["qwen2", *FAMILY_KINDS]
    for backend in ("torch", "cpu")
]


@pytest.mark.parametrize(("kind", "backend"), CASES)
def test_bfloat16_greedy_is_hf_argmax_up_to_near_ties(
    kind: str, backend: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(kind, tmp_path / kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    worker = Worker(
        WorkerConfig(
            model=str(path),
            block_size=BLOCK,
            num_threads=1,
            attention_backend=backend,
            dtype="bfloat16",
        )
    )
    worker.load_model()
    engine = make_engine(worker)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = PROMPTS[:4]
    outputs = generate(engine, prompts, params)
    exact = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
        for i, token in enumerate(tokens):
            row = logits[len(prompt) - 1 + i]
            gap = (row.max() - row[token]).item()
            tolerance = NEAR_TIE_ULPS * bf16_ulp(row.abs().max().item())
            assert gap <= tolerance, (kind, i, gap, tolerance)
            exact += gap == 0
    # Near-ties are the exception: most tokens are HF's exact argmax.
    assert exact >= 0.8 * len(prompts) * NEW_TOKENS
