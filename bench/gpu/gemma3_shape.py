"""Gemma 3 270M's shape with random weights, for serving figures on the lent GPU machine.

The GGUF (247 MB) is over what one call to that machine carries (64 MiB with the working
tree), so the serving benchmark there runs a model of the same configuration (18 layers, 5 of
6 with a 512-token sliding window, 4 query heads per KV head of 256, 262,144-token vocabulary)
and the same tokenizer, with weights drawn at random: with ignore_eos and fixed lengths, the
work per step, and so every timing, is the same as with the real weights. Its outputs are
not text; exactness is checked elsewhere (tiny Gemma 3 models against HF on the GPU,
tests/integration/test_gpu_families.py; the real model on CPU, tests/e2e/test_up_gemma3.py).

    .venv/bin/python bench/gpu/gemma3_shape.py export DIR   # here: config + tokenizer (3.5 MB xz)
    python3 bench/gpu/gemma3_shape.py init DIR              # there: random bfloat16 weights
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def export(out: Path) -> None:
    """The GGUF's configuration and tokenizer, as a model directory without weights."""
    from transformers import AutoConfig, AutoTokenizer

    from llmserve.model_spec import GEMMA3_270M, resolve_model

    src = resolve_model(GEMMA3_270M)
    AutoConfig.from_pretrained(src.path, **src.pretrained_kwargs()).save_pretrained(out)
    AutoTokenizer.from_pretrained(src.path, **src.pretrained_kwargs()).save_pretrained(out)


def init(directory: Path) -> None:
    """Random bfloat16 weights for the configuration in `directory`, saved beside it."""
    import torch
    from transformers import AutoConfig, Gemma3ForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(directory)
    model = Gemma3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    params = sum(p.numel() for p in model.parameters())
    print(f"{directory}: {params / 1e6:.0f}M random parameters, {config.num_hidden_layers} layers")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["export", "init"])
    p.add_argument("directory", type=Path)
    args = p.parse_args()
    (export if args.action == "export" else init)(args.directory)


if __name__ == "__main__":
    main()
