"""MXFP4 expert weights as gpt-oss checkpoints ship them, dequantized at load.

A checkpoint whose `quantization_config` names `mxfp4` stores each expert projection
`<name>` as `<name>_blocks` (uint8 `[experts, out, in / 32, 16]`: 32 e2m1 values a group, two
per byte, the even-indexed one in the low nibble) and `<name>_scales` (uint8
`[experts, out, in / 32]`: one e8m0 exponent a group, biased by 127). `load_dequantized`
reads them straight from the safetensors files, multiplies them out into the model dtype, and
puts them into a transformers model built without its quantizer (which would otherwise want
GPU kernels, or dequantize on its own terms); everything else loads as usual. The worker then
holds plain weights: 4.25 bits a weight on disk become 16 or 32 in memory, logged at load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from llmserve.logs import get_logger
from worker_service.models.rope import UnsupportedModelError

log = get_logger(__name__)

GROUP = 32  # weights per scale
_BLOCKS, _SCALES = "_blocks", "_scales"
_EXPONENT_BIAS = 127


def _e2m1_table() -> torch.Tensor:  # [16] float32, the value of each 4-bit code
    """Bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa; exponent 0 is
    subnormal (0 or 0.5)."""
    codes = torch.arange(16)
    sign = 1.0 - 2.0 * (codes >> 3).float()
    exponent = (codes >> 1) & 3
    mantissa = (codes & 1).float()
    normal = torch.pow(2.0, (exponent - 1).float()) * (1.0 + mantissa / 2)
    return sign * torch.where(exponent == 0, mantissa / 2, normal)


E2M1 = _e2m1_table()


def dequantize(
    blocks: torch.Tensor,  # [..., groups, 16] uint8
    scales: torch.Tensor,  # [..., groups] uint8
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., groups * 32] in dtype
    """Each group's 32 values times 2 ** (scale - 127), computed in float32 (exact: the e2m1
    values times a power of two) and then cast."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, not {blocks.dtype}/{scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    table = E2M1.to(blocks.device)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., groups, 32]
    exponents = scales.to(torch.int32) - _EXPONENT_BIAS
    values = torch.ldexp(values, exponents[..., None])
    return values.flatten(-2).to(dtype)


def is_mxfp4_checkpoint(path: str) -> bool:
    """Whether the local checkpoint at `path` declares MXFP4 weights; refuses other declared
    quantizations of gpt-oss by name."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return False
    config = json.loads(config_file.read_text())
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method is None:
        return False
    if method == "mxfp4":
        return True
    if config.get("model_type") == "gpt_oss":
        raise UnsupportedModelError(f"gpt-oss quantization {method!r} is not supported (mxfp4 is)")
    return False


def load_dequantized(path: str, dtype: torch.dtype) -> Any:
    """The transformers model of an MXFP4 checkpoint, its experts dequantized to `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    packed = _packed_tensors(Path(path))
    # The experts' plain weights are missing from the files (they come from `packed` below):
    # transformers initialises them, and they are replaced before the model is used.
    hf_model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    packed_bytes = dequantized_bytes = 0
    for name, (blocks, scales) in packed.items():
        weight = dequantize(blocks, scales, dtype)  # [experts, out, in], the checkpoint's order
        module_name, _, attr = name.rpartition(".")
        module = hf_model.get_submodule(module_name)
        # transformers keeps expert weights as [experts, in, out].
        current = getattr(module, attr)
        if current.shape != weight.transpose(1, 2).shape:
            raise ValueError(
                f"{name}: MXFP4 weights dequantize to {tuple(weight.shape)}, the model expects "
                f"the transpose of {tuple(current.shape)}"
            )
        setattr(module, attr, torch.nn.Parameter(weight.transpose(1, 2), requires_grad=False))
        packed_bytes += blocks.nbytes + scales.nbytes
        dequantized_bytes += weight.nbytes
    if not packed:
        raise ValueError(f"{path}: declares mxfp4 but holds no *{_BLOCKS} / *{_SCALES} tensors")
    log.info(
        "mxfp4 experts dequantized",
        tensors=len(packed),
        packed_bytes=packed_bytes,
        dequantized_bytes=dequantized_bytes,
        dtype=str(dtype).removeprefix("torch."),
    )
    return hf_model


def _packed_tensors(directory: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every `<name>_blocks` / `<name>_scales` pair of the checkpoint's safetensors files, by
    `<name>` (the parameter they stand for)."""
    from safetensors import safe_open

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                for suffix in (_BLOCKS, _SCALES):
                    if key.endswith(suffix):
                        pairs.setdefault(key.removesuffix(suffix), {})[suffix] = handle.get_tensor(
                            key
                        )
    missing = [name for name, pair in pairs.items() if len(pair) != 2]
    if missing:
        raise ValueError(f"MXFP4 tensors without their blocks or scales: {missing}")
    return {name: (pair[_BLOCKS], pair[_SCALES]) for name, pair in pairs.items()}
