"""A model's shape with random weights, for serving figures on the lent GPU machine.

A call to that machine carries at most 64 MiB with the working tree, less than SmolLM2's GGUF
(98 MB) or Gemma 3 270M's (247 MB). So the figures there come from a model of the same
configuration (layers, heads, windows, vocabulary) and tokenizer with weights drawn at random:
with ignore_eos and fixed lengths a step's work, and so every timing, does not depend on the
weights' values. Its outputs are not text; exactness is checked elsewhere (tiny models of each
family against HF on the GPU, tests/integration/test_gpu_families.py; the real models on CPU).

    .venv/bin/python bench/gpu/model_shape.py export SPEC DIR   # here: config + tokenizer
    python3 bench/gpu/model_shape.py init DIR                   # there: random bf16 weights
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def export(spec: str, out: Path) -> None:
    """The model's configuration and tokenizer, as a model directory without weights."""
    from transformers import AutoConfig, AutoTokenizer

    from llmserve.model_spec import resolve_model

    src = resolve_model(spec)
    AutoConfig.from_pretrained(src.path, **src.pretrained_kwargs()).save_pretrained(out)
    AutoTokenizer.from_pretrained(src.path, **src.pretrained_kwargs()).save_pretrained(out)


def init(directory: Path) -> None:
    """Random bfloat16 weights for the configuration in `directory`, saved beside it (drawn on
    the GPU where there is one: faster than the CPU there)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(directory)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    params = sum(p.numel() for p in model.parameters())
    print(f"{directory}: {params / 1e6:.0f}M random parameters, {config.num_hidden_layers} layers")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="action", required=True)
    e = sub.add_parser("export", help="config and tokenizer of a model spec, into DIR")
    e.add_argument("spec", help="llmserve's --model: smollm2, gemma3-270m, or a path")
    e.add_argument("directory", type=Path)
    i = sub.add_parser("init", help="random bfloat16 weights for DIR's config, saved in DIR")
    i.add_argument("directory", type=Path)
    args = p.parse_args()
    if args.action == "export":
        export(args.spec, args.directory)
    else:
        init(args.directory)


if __name__ == "__main__":
    main()
