"""Write a model spec (default: the embedded SmolLM2 GGUF) as a plain HF safetensors directory.

Peers such as `transformers serve` take a directory; llmserve reads the GGUF. A GGUF-loaded
model refuses `save_pretrained`, so its (dequantized) state dict goes into a fresh model built
from the same config, which is saved with the tokenizer and chat template. Both servers then
run the same weights. The saved directory is loaded back and must give the same logits.

    .venv/bin/python bench/export_hf_model.py --out /tmp/bench/smollm2-hf --dtype float32
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmserve.model_spec import resolve_model


def export(spec: str, out: Path, dtype: torch.dtype) -> None:
    source = resolve_model(spec)
    loaded = AutoModelForCausalLM.from_pretrained(
        source.path, **source.pretrained_kwargs(), dtype=dtype
    ).eval()
    config = copy.deepcopy(loaded.config)
    # The GGUF reader's marker: the exported weights are plain tensors, not quantized ones.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    keys = fresh.load_state_dict(loaded.state_dict(), strict=False)
    assert not keys.missing_keys and not keys.unexpected_keys, keys
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(source.path, **source.pretrained_kwargs())
    tokenizer.save_pretrained(out)
    check_same_logits(loaded, out, dtype, tokenizer.bos_token_id or 0)


def check_same_logits(loaded: torch.nn.Module, out: Path, dtype: torch.dtype, bos: int) -> None:
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
    ids = torch.tensor([[bos, *range(100, 115)]])  # [1, 16]
    with torch.no_grad():
        expected = loaded(ids).logits  # [1, 16, vocab]
        got = reloaded(ids).logits
    assert torch.equal(expected, got), (expected - got).abs().max()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="llmserve model spec")
    p.add_argument("--out", type=Path, default=Path("/tmp/bench/smollm2-hf"))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args()
    export(args.model, args.out, getattr(torch, args.dtype))
    print(f"wrote {args.out} ({args.dtype}); all weights matched, reloaded logits identical")


if __name__ == "__main__":
    main()
