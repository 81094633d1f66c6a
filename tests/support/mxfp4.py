"""Packing weights into MXFP4 the way gpt-oss checkpoints store their experts (tests only):
the tests build such checkpoints from tiny models and check the worker's dequantization
against transformers' own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

# The magnitudes of the positive e2m1 codes 0-7 (codes 8-15 are their negatives).
_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize(
    weight: torch.Tensor,  # [..., in], in a multiple of 32
) -> tuple[torch.Tensor, torch.Tensor]:  # [..., in / 32, 16] uint8 blocks, [..., in / 32] scales
    """Per 32-weight group: the smallest power of two that brings the largest magnitude within
    6, and every weight rounded to the nearest e2m1 value at that scale."""
    groups = weight.float().reshape(*weight.shape[:-1], -1, 32)
    largest = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(largest / 6.0)).clamp(-127, 127)
    scaled = groups / torch.pow(2.0, exponent)[..., None]
    nearest = (scaled.abs()[..., None] - _MAGNITUDES).abs().argmin(dim=-1)  # [..., 32] 0-7
    codes = nearest + 8 * (scaled < 0).long()
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def save_mxfp4_copy(plain: Path, target: Path) -> Path:
    """`plain` (a saved gpt-oss model) with its experts' projections stored as MXFP4 blocks and
    scales in the checkpoint's [experts, out, in] order, and the config saying so."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(plain, target)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(target.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
        file.unlink()
    packed: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize(tensor.transpose(1, 2))  # transformers: [experts, in, out]
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        else:
            packed[name] = tensor.contiguous()
    save_file(packed, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "model.safetensors.index.json").unlink(missing_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
