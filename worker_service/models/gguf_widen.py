"""Block types widened without loss, so that the parts of a fused projection share one type.

A GGUF file may quantize the parts of what the decoder multiplies as one weight differently
(Gemma 3 270M's Q4_K_M file: q and k in Q5_0, v in Q8_0 in half its layers). Q4_0, Q5_0 and
Q8_0 all hold d * (integer) with one fp16 d per block of 32, their integers in [-8, 7],
[-16, 15] and [-128, 127]: a block of one is exactly a block of any later type in WIDENING,
with the same d and the same integers, so every weight dequantizes to the same float (d times
an integer-valued float, one rounding either way). Parts of other types (Q4_1's offsets, the
k-quants' sub-block scales) have no such wider form and keep a fused weight dense.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGMLQuantizationType

Q4_0, Q5_0, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0
WIDENING = (Q4_0, Q5_0, Q8_0)  # each type's blocks are exactly blocks of the later ones
_BLOCK_BYTES = {Q4_0: 18, Q5_0: 22, Q8_0: 34}
_ZERO = {Q4_0: 8, Q5_0: 16}  # what the unsigned quants hold for 0


def common_type(types: set[int]) -> int | None:
    """The narrowest type in WIDENING that all of `types` widen to, or None."""
    if not types <= set(WIDENING):
        return None
    return int(max(types, key=WIDENING.index))


def widen(ggml_type: int, rows: np.ndarray, target: int) -> np.ndarray:
    """Blocks [rows, n * block bytes] of `ggml_type` as blocks of `target` (a later type in
    WIDENING, or the same): the same scales and integers."""
    if ggml_type == target:
        return rows
    assert WIDENING.index(GGMLQuantizationType(ggml_type)) < WIDENING.index(
        GGMLQuantizationType(target)
    ), (ggml_type, target)
    blocks = rows.reshape(rows.shape[0], -1, _BLOCK_BYTES[GGMLQuantizationType(ggml_type)])
    d, q = _integers(GGMLQuantizationType(ggml_type), blocks)
    return _pack(GGMLQuantizationType(target), d, q).reshape(rows.shape[0], -1)


def _integers(ggml_type: GGMLQuantizationType, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Blocks [..., bytes] -> their fp16 d as bytes [..., 2] and integers [..., 32] (int16)."""
    d = blocks[..., :2]
    if ggml_type == Q8_0:
        return d, blocks[..., 2:].view(np.int8).astype(np.int16)
    nibbles = blocks[..., -16:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.int16)
    if ggml_type == Q5_0:  # fifth bits: bit j of the little-endian 32 bits is weight j's
        high = blocks[..., 2:6].copy().view("<u4")
        q |= (((high >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int16)
    return d, q - _ZERO[ggml_type]


def _pack(ggml_type: GGMLQuantizationType, d: np.ndarray, q: np.ndarray) -> np.ndarray:
    """_integers' inverse for `ggml_type`."""
    if ggml_type == Q8_0:
        return np.concatenate([d, q.astype(np.int8).view(np.uint8)], axis=-1)
    u = (q + _ZERO[ggml_type]).astype(np.uint32)
    nibbles = ((u[..., :16] & 0x0F) | (u[..., 16:] & 0x0F) << 4).astype(np.uint8)
    parts = [d]
    if ggml_type == Q5_0:
        high = (((u >> 4) & 1) << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
        parts.append(high[..., None].astype("<u4").view(np.uint8))
    return np.concatenate([*parts, nibbles], axis=-1)
