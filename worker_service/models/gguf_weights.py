"""Weights that stay in a GGUF file's blocks as they are (`--linear-impl gguf`).

The model is loaded as today (transformers dequantizes the file); then each projection, the
embedding and the LM head whose tensors in the file have a kernel (Q4_0, Q4_1, Q5_0, Q8_0,
Q4_K, Q5_K, Q6_K: llmserve_kernels/cpu/quant.py) get those blocks instead of their dense weights,
which are dropped: the decoder's matmul becomes `quant_matmul` and its embedding lookup
`quant_embedding`, and the native decode step is rebuilt on the blocks. Tensors of other
types stay dense (dequantized, with a warning giving their cost). The parts of a fused q/k/v
or gate/up that differ in type are widened to a common one where that loses nothing
(gguf_widen.py: Q4_0 and Q5_0 into Q5_0 or Q8_0), or else stay dense.

Modes (`--quant-mode`, llmserve_kernels/cpu/quant.py):
- exact: a block is dequantized to float32 and multiplied with float32 activations, so the
  model equals HF's dequantized one up to summation order;
- fast: activations are rounded to 8 bits per block of 32 and multiplied with integer dot
  products (every type above). The weights it multiplies (with rows a multiple of 8) are
  interleaved when installed (`quant.interleave`: the same products, faster); a tied LM head
  becomes an interleaved copy, and the embedding keeps the file's rows for its lookups.
Inputs of `dequantize_rows` rows or more (prefill chunks, large decode batches: measured on
this machine per mode and weight shape, fixed for weights too large to time) dequantize the
weight whole and multiply with torch; in fast mode on the activations rounded as the
kernel rounds them, so that a token's product does not depend on how many rows share its step
(a recomputed or transferred sequence, a prefix hit).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType

from llmserve.gguf_files import open_gguf
from llmserve.logs import get_logger
from llmserve.model_spec import ModelSource
from llmserve_kernels.cpu import quant
from llmserve_kernels.cpu.quant import QuantMode, QuantWeight
from worker_service.models.decoder import DecoderModel
from worker_service.models.gguf_widen import common_type, widen
from worker_service.models.native import NativeDecode

log = get_logger("worker.gguf")


# From this many input rows on (prefill chunks, large decode batches), a block weight is
# dequantized whole and multiplied by torch, which wins from there; either way the product is
# the mode's up to the activations' rounding (fast) and summation order. Where the two cross
# differs by machine and mode (bench/RESULTS.md, "on a Zen 4" and "Every family's elementwise
# ops fused"), so it is measured here (`measured_dequantize_rows`) for each mode, type and
# weight shape below LARGE_WEIGHT_BYTES. A weight whose float32 copy outgrows the caches (the
# LM head) writes it to memory and reads it back, so it is dequantized later, from a fixed
# count.
LARGE_WEIGHT_BYTES = 32 << 20
LARGE_DEQUANTIZE_ROWS = 192
# The measurement: these input sizes, smallest first, each path timed best of
# CROSSOVER_REPEATS; dequantizing takes over at the first size where it is faster by
# CROSSOVER_MARGIN, and never (NEVER_DEQUANTIZE) if at none.
CROSSOVER_ROWS = (64, 128, 256, 512, 1024)
CROSSOVER_REPEATS = 3
CROSSOVER_MARGIN = 0.9
NEVER_DEQUANTIZE = 1 << 31

_crossover: dict[tuple[QuantMode, int, tuple[int, int]], int] = {}  # (mode, type, shape) -> rows


def dequantize_rows(weight: QuantWeight, mode: QuantMode) -> int:
    """Inputs of this many rows or more multiply `weight` dequantized whole (see above)."""
    rows, in_features = weight.shape
    if rows * in_features * 4 > LARGE_WEIGHT_BYTES:
        return LARGE_DEQUANTIZE_ROWS
    return measured_dequantize_rows(weight, mode)


def measured_dequantize_rows(weight: QuantWeight, mode: QuantMode) -> int:
    """The crossover for `weight`'s type and shape in `mode`, measured on first use in this
    process (tens to hundreds of ms: every weight of a shape shares it)."""
    key = (mode, weight.code, weight.shape)
    if key not in _crossover:
        _crossover[key] = first_faster(*time_both_paths(weight, mode))
    return _crossover[key]


def time_both_paths(
    weight: QuantWeight, mode: QuantMode
) -> tuple[dict[int, float], dict[int, float]]:
    """Seconds (best of CROSSOVER_REPEATS) of the mode's kernel and of the dequantizing path
    on random inputs of each CROSSOVER_ROWS size, stopping at the first size where
    dequantizing wins."""
    kernel: dict[int, float] = {}
    dequantizing: dict[int, float] = {}
    generator = torch.Generator().manual_seed(0)
    for rows in CROSSOVER_ROWS:
        x = torch.randn(rows, weight.in_features, generator=generator)
        kernel[rows] = _best_of(partial(quant.linear, x, weight.code, weight.blocks, mode))
        dequantizing[rows] = _best_of(partial(dequantized_matmul, x, weight, None, mode))
        if first_faster(kernel, dequantizing) == rows:
            break
    return kernel, dequantizing


def _best_of(run: Callable[[], object]) -> float:
    run()  # warm: first-touch pages, thread pools
    times = []
    for _ in range(CROSSOVER_REPEATS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def first_faster(kernel: dict[int, float], dequantizing: dict[int, float]) -> int:
    """The fewest rows measured at which dequantizing took under CROSSOVER_MARGIN of the
    kernel's time, else NEVER_DEQUANTIZE."""
    for rows in sorted(kernel.keys() & dequantizing.keys()):
        if dequantizing[rows] < CROSSOVER_MARGIN * kernel[rows]:
            return rows
    return NEVER_DEQUANTIZE


def quant_matmul(
    x: torch.Tensor,  # [rows, in] float32
    weight: torch.Tensor | QuantWeight,
    bias: torch.Tensor | None = None,
    mode: QuantMode = "exact",
) -> torch.Tensor:  # [rows, out]
    if not isinstance(weight, QuantWeight):
        return F.linear(x, weight, bias)
    if x.shape[0] >= dequantize_rows(weight, mode):
        return dequantized_matmul(x, weight, bias, mode)
    out = quant.linear(x.contiguous(), weight.code, weight.blocks, mode)
    return out if bias is None else out + bias


def dequantized_matmul(
    x: torch.Tensor,  # [rows, in] float32
    weight: QuantWeight,
    bias: torch.Tensor | None,
    mode: QuantMode,
) -> torch.Tensor:  # [rows, out]: quant.linear's product up to summation order
    dense = quant.dequantize(weight.code, weight.blocks, weight.in_features)
    if mode == "fast":  # the same 8-bit activations as the kernel's, whatever the rows
        x = quant.round_activations(x.contiguous())
    return F.linear(x, dense, bias)


def quant_embedding(
    input_ids: torch.Tensor,  # [n] int64
    weight: torch.Tensor | QuantWeight,  # [vocab, hidden]
) -> torch.Tensor:  # [n, hidden] float32
    if not isinstance(weight, QuantWeight):
        return F.embedding(input_ids, weight)
    assert not weight.interleaved, "an embedding keeps the file's rows (install_blocks)"
    return quant.dequantize(weight.ggml_type, weight.blocks[input_ids], weight.in_features)


# GGUF architectures whose tensors map onto the decoder's projections (the same tensor names),
# and whether llama.cpp's converter permuted their q/k rows for its rotary layout (which the
# loader undoes, as transformers does).
MAPPED_ARCHITECTURES = {"llama": True, "gemma3": False}


def unsupported_reason(source: ModelSource, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `--linear-impl gguf` cannot run this model here, or None."""
    if source.gguf_file is None:
        return f"the model {source.spec!r} is not a GGUF file"
    if device.type != "cpu" or dtype != torch.float32:
        return f"its kernels run on the CPU in float32, not {device} {dtype}"
    arch = str(_reader(source).fields["general.architecture"].contents())
    if arch not in MAPPED_ARCHITECTURES:
        names = ", ".join(sorted(MAPPED_ARCHITECTURES))
        return f"the GGUF architectures mapped so far are {names}, not {arch!r}"
    return None


def holds_blocks(source: ModelSource) -> bool:
    """Whether `source` (a GGUF file) has a tensor in a type the kernels read: a file of
    float32 or bfloat16 tensors would only be dequantized."""
    return any(
        quant.block_bytes(GGMLQuantizationType(int(t.tensor_type))) for t in _reader(source).tensors
    )


def _reader(source: ModelSource) -> GGUFReader:
    assert source.gguf_file is not None
    return open_gguf(Path(source.path) / source.gguf_file)


def keep_gguf_blocks(model: DecoderModel, source: ModelSource, mode: QuantMode = "exact") -> int:
    """Swap the weights of `model` (loaded from `source`, a GGUF file of a mapped architecture) for the file's
    blocks where a kernel reads their type, multiplied in `mode`, and rebuild its native
    decode step (if it has one) on them. Returns the bytes of blocks kept."""
    reader = _reader(source)
    tensors = {t.name: t for t in reader.tensors}
    permuted = MAPPED_ARCHITECTURES[str(reader.fields["general.architecture"].contents())]
    arch = model.arch
    # Per type without a kernel: the bytes its tensors take in the file, and dequantized.
    skipped: dict[str, list[int]] = {}

    def blocks(name: str, heads: int | None = None) -> tuple[int, np.ndarray] | None:
        tensor = tensors[name]
        ggml_type = GGMLQuantizationType(int(tensor.tensor_type))
        if quant.block_bytes(ggml_type) == 0:  # no kernel reads this type
            cost = skipped.setdefault(ggml_type.name, [0, 0])
            cost[0] += int(tensor.n_bytes)
            cost[1] += int(tensor.n_elements) * 4  # float32
            return None
        in_features, out_features = (int(d) for d in tensor.shape)  # ggml: fastest first
        rows = np.array(tensor.data).reshape(out_features, -1)  # a writable copy
        if heads is not None:  # undo llama.cpp's rotary row order, as transformers does
            half = out_features // heads // 2
            rows = rows.reshape(heads, half, 2, -1).swapaxes(1, 2).reshape(out_features, -1)
        return int(ggml_type), rows

    def weight(*parts: tuple[int, np.ndarray] | None) -> QuantWeight | None:
        """The parts' rows stacked (q, k, v; gate, up) as one weight, in their common type
        (gguf_widen.py), or None: a part without a kernel, or parts without a common type,
        stay dense."""
        present = [p for p in parts if p is not None]
        if len(present) != len(parts):
            return None
        types = {t for t, _ in present}
        ggml_type = types.pop() if len(types) == 1 else common_type(types)
        if ggml_type is None:
            return None
        rows = np.concatenate([widen(t, r, ggml_type) for t, r in present])
        in_features = rows.shape[1] // quant.block_bytes(ggml_type) * quant.block_weights(ggml_type)
        return QuantWeight(ggml_type, torch.from_numpy(rows), in_features)

    projections = []
    for i in range(arch.num_layers):
        p = f"blk.{i}."
        projections.append(
            {
                "qkv": weight(
                    blocks(p + "attn_q.weight", arch.num_heads if permuted else None),
                    blocks(p + "attn_k.weight", arch.num_kv_heads if permuted else None),
                    blocks(p + "attn_v.weight"),
                ),
                "o": weight(blocks(p + "attn_output.weight")),
                "gate_up": weight(blocks(p + "ffn_gate.weight"), blocks(p + "ffn_up.weight")),
                "down": weight(blocks(p + "ffn_down.weight")),
            }
        )
    embed = weight(blocks("token_embd.weight"))
    # A tied head is the embedding's tensor.
    head = weight(blocks("output.weight")) if "output.weight" in tensors else embed
    kept = install_blocks(model, projections, embed, head, mode)
    for name, (file_bytes, dense_bytes) in sorted(skipped.items()):
        log.warning(
            "tensors without a block kernel stay dense (dequantized to float32)",
            type=name,
            file_bytes=file_bytes,
            dense_bytes=dense_bytes,
        )
    return kept


def install_blocks(
    model: DecoderModel,
    projections: list[dict[str, QuantWeight | None]],  # per layer: qkv, o, gate_up, down
    embed: QuantWeight | None,
    head: QuantWeight | None,  # the embedding itself when tied
    mode: QuantMode,
    weight_format: str | None = None,
) -> int:
    """Put these blocks in place of `model`'s dense weights (None: that weight stays dense),
    multiplied in `mode`, and rebuild its native decode step (if it has one) on them; the
    dense weights replaced are dropped. `weight_format` is what the model reports it holds
    (None: "gguf", the types installed and the mode). Returns the bytes of blocks installed."""
    kept = 0
    if mode == "fast":  # multiplied weights interleaved where they can be: same outputs, faster
        projections = [
            {name: _interleaved(w) for name, w in swaps.items()} for swaps in projections
        ]
        head = _interleaved(head)  # a tied head becomes a copy: the embedding keeps its rows
    installed = [w for w in (embed, head) if w is not None]
    for layer, swaps in zip(model.layers, projections, strict=True):
        for name, new in swaps.items():
            if new is not None:
                installed.append(new)
                dense = getattr(layer, name)
                assert dense is not None and tuple(dense.shape) == new.shape, name
                setattr(layer, name, new)
                kept += new.nbytes
    if embed is not None:
        assert tuple(model.embed.shape) == embed.shape
        model.embed = embed  # type: ignore[assignment]
        model.embedding = quant_embedding
        kept += embed.nbytes
    if head is not None:
        assert tuple(model.lm_head.shape) == head.shape
        model.lm_head = head  # type: ignore[assignment]
        kept += 0 if head is embed else head.nbytes
    model.linear = partial(quant_matmul, mode=mode)
    for w in installed:  # fast mode's crossovers measured now, not in a request's step
        if w is not embed or w is head:  # an untied embedding is looked up, not multiplied
            dequantize_rows(w, mode)
    types = {GGMLQuantizationType(w.ggml_type).name for w in installed}
    model.weight_format = weight_format or f"gguf {'+'.join(sorted(types))} {mode}"
    if (
        installed
        and model.native_decode is not None
        and (reason := model.native_decode.step.shape.blocks_unsupported_reason())
    ):
        model.native_decode = None
        model.native_decode_refused = f"on GGUF blocks: {reason}"
    if model.native_decode is not None:
        model.native_decode = NativeDecode(
            model.arch,
            model.embed,
            model.layers,
            model.final_norm,
            model.lm_head,
            model.rope_tables,
            model.native_decode.max_batch,
            quant_mode=mode,
        )
    return kept


def _interleaved(weight: QuantWeight | None) -> QuantWeight | None:
    """`weight` interleaved for fast mode's kernels (llmserve_kernels/cpu/quant.py), or itself where
    its type or shape keeps the file's layout."""
    if weight is None:
        return None
    return quant.interleave(weight) or weight
