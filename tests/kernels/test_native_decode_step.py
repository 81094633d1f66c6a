"""The native decode step (llmserve_kernels/cpu/decode.cpp) against the per-layer path, one feature
at a time, on a tiny random model whose caches hold contexts longer than its sliding window.

Each case builds the same weights twice: a `DecoderModel` that takes the native step and one
that decodes per layer (the `cpu` backend's paged kernel, torch or fused elementwise ops).
Their logits for one decode step of three sequences must agree; and the feature must matter:
the native logits without it differ by far more than that tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from llmserve_kernels import KernelArgumentError
from llmserve_kernels.cpu import quant
from llmserve_kernels.cpu.quant import MODES, QuantMode, QuantWeight
from tests.kernels.paged import assert_unchanged_outside, block_pool, layer_views
from worker_service.attention import AttentionMetadata, AttentionSpec, get_backend_class
from worker_service.models.arch import LayerKind, ModelArchConfig
from worker_service.models.decoder import DecoderModel
from worker_service.models.gguf_weights import install_blocks
from worker_service.models.rope import RopeSpec
from worker_service.models.weights import LayerWeights

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 64, 96, 4, 2, 32, 128, 3
BLOCK, MAX_POSITIONS, WINDOW = 16, 128, 8
CONTEXTS = [5, 23, 40]  # tokens cached before the step; two exceed the window
# Per dtype: how far native and per-layer logits may differ (summation order; bfloat16
# roundings), and how far a feature must move them to count as exercised.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.1}
# bfloat16 caches in a float32 model: a q, k or v element the paths' summation orders put on
# either side of a bfloat16 rounding boundary differs by one bfloat16 step.
BF16_CACHE_TOLERANCE = 5e-3
MATTERS = 0.5
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _rope(rotary_dim: int = HEAD_DIM, theta: float = 10000.0) -> RopeSpec:
    return RopeSpec(theta, (), rotary_dim, MAX_POSITIONS)


def _arch(**features: Any) -> ModelArchConfig:
    defaults: dict[str, Any] = dict(
        ropes=(_rope(),), layers=(LayerKind(sliding_window=None, rope=0),) * LAYERS
    )
    return ModelArchConfig(
        "Tiny",
        LAYERS,
        HIDDEN,
        INTER,
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        VOCAB,
        1e-6,
        MAX_POSITIONS,
        **{**defaults, **features},
    )


def _windowed() -> tuple[LayerKind, ...]:
    return (LayerKind(WINDOW, 0), LayerKind(None, 0), LayerKind(WINDOW, 0))


# name -> (the arch with the feature, the same arch without it)
CASES: dict[str, tuple[ModelArchConfig, ModelArchConfig]] = {
    "window": (_arch(layers=_windowed()), _arch()),
    "attn_softcap": (_arch(attn_softcap=0.3), _arch()),
    "final_softcap": (_arch(final_softcap=1.5), _arch()),
    "nope": (
        _arch(layers=(LayerKind(None, 0), LayerKind(None, None), LayerKind(None, 0))),
        _arch(),
    ),
    "partial_rotary": (_arch(ropes=(_rope(16),)), _arch()),
    "two_rotary_tables": (
        _arch(ropes=(_rope(), _rope(theta=50.0)), layers=(LayerKind(WINDOW, 1),) * LAYERS),
        _arch(layers=(LayerKind(WINDOW, 0),) * LAYERS),
    ),
    "qk_norm_head": (_arch(qk_norm="head"), _arch()),
    "gemma": (
        _arch(
            norm="gemma",
            qk_norm="head",
            activation="gelu_tanh",
            output_norms=True,
            attention_scale=24**-0.5,
            embed_scale=HIDDEN**0.5,
            round_embed_scale=True,
            layers=_windowed(),
        ),
        _arch(layers=_windowed()),
    ),
    "olmo2": (_arch(norm="rms_f32", qk_norm="full", input_norms=False, output_norms=True), _arch()),
    "granite": (
        _arch(embed_scale=6.0, attention_scale=0.09, residual_scale=0.4, logits_divisor=0.5),
        _arch(),
    ),
}


@dataclass
class Weights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]


def _weights(arch: ModelArchConfig, dtype: torch.dtype, gen: torch.Generator) -> Weights:
    def randn(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    def norm(width: int) -> torch.Tensor:  # off its neutral value, as tests/support does
        neutral = 0.0 if arch.norm == "gemma" else 1.0
        return (neutral + torch.randn(width, generator=gen) * 0.2).to(dtype)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qk_width = {"head": (HEAD_DIM, HEAD_DIM), "full": (q, kv), None: None}[arch.qk_norm]
    layers = []
    for _ in range(arch.num_layers):
        layers.append(
            LayerWeights(
                input_norm=norm(HIDDEN) if arch.input_norms else None,
                qkv=randn(q + 2 * kv, HIDDEN),
                qkv_bias=randn(q + 2 * kv, scale=0.02),
                o=randn(HIDDEN, q),
                post_norm=norm(HIDDEN) if arch.input_norms else None,
                gate_up=randn(2 * INTER, HIDDEN),
                down=randn(HIDDEN, INTER),
                o_bias=randn(HIDDEN, scale=0.02),
                q_norm=None if qk_width is None else norm(qk_width[0]),
                k_norm=None if qk_width is None else norm(qk_width[1]),
                attn_out_norm=norm(HIDDEN) if arch.output_norms else None,
                mlp_out_norm=norm(HIDDEN) if arch.output_norms else None,
            )
        )
    return Weights(randn(VOCAB, HIDDEN, scale=1.0), layers, norm(HIDDEN), randn(VOCAB, HIDDEN))


@dataclass
class DecodeBatch:
    input_ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    metadata: AttentionMetadata
    caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [blocks, BLOCK, kv, head_dim]


def _batch(dtype: torch.dtype, gen: torch.Generator) -> DecodeBatch:
    """One new token per sequence after CONTEXTS random cached keys and values, in shuffled
    blocks; unowned slots hold NaN so that reading one shows."""
    per_seq = [c // BLOCK + 1 for c in CONTEXTS]
    order = torch.randperm(sum(per_seq) + 2, generator=gen).tolist()
    tables, slots = [], []
    for context, count in zip(CONTEXTS, per_seq, strict=True):
        table, order = order[:count], order[count:]
        tables.append(table + [0] * (max(per_seq) - count))
        slots.append(table[context // BLOCK] * BLOCK + context % BLOCK)
    num_blocks = sum(per_seq) + 2
    caches = []
    for _ in range(LAYERS):
        pair = []
        for _ in range(2):
            cache = torch.full((num_blocks, BLOCK, KV_HEADS, HEAD_DIM), float("nan"))
            for table, context in zip(tables, CONTEXTS, strict=True):
                for t in range(context):
                    block = table[t // BLOCK]
                    cache[block, t % BLOCK] = torch.randn(KV_HEADS, HEAD_DIM, generator=gen)
            pair.append(cache.to(dtype))
        caches.append((pair[0], pair[1]))
    lens = torch.tensor([c + 1 for c in CONTEXTS], dtype=torch.int32)
    metadata = AttentionMetadata.for_decodes(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens=lens,
        block_tables=torch.tensor(tables, dtype=torch.int32),
        max_seq_len=int(lens.max()),
        block_size=BLOCK,
    )
    ids = torch.randint(0, VOCAB, (len(CONTEXTS),), generator=gen)
    return DecodeBatch(ids, torch.tensor(CONTEXTS), metadata, caches)


@dataclass
class Blocks:
    """A float32 model's weights in GGUF blocks (tests of `--linear-impl gguf`)."""

    projections: list[dict[str, QuantWeight | None]]
    embed: QuantWeight
    lm_head: QuantWeight
    mode: QuantMode


def _logits(
    arch: ModelArchConfig,
    w: Weights,
    batch: DecodeBatch,
    native: bool,
    blocks: Blocks | None = None,
    caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """One decode step's logits ([n, vocab], float32) on `caches` (written in place), by
    default fresh copies of the batch's."""
    model = DecoderModel(
        arch,
        w.embed,
        [replace(layer) for layer in w.layers],
        w.final_norm,
        w.lm_head,
        MAX_POSITIONS,
        fused_ops=True,
        native_decode_max_batch=16 if native else 0,
    )
    assert (model.decode_step is not None) == native, model.native_decode_refused
    if blocks is not None:
        install_blocks(model, blocks.projections, blocks.embed, blocks.lm_head, blocks.mode)
    spec = AttentionSpec(torch.device("cpu"), w.embed.dtype, HEADS, KV_HEADS, HEAD_DIM)
    backend = get_backend_class("cpu", spec)(
        HEADS, KV_HEADS, HEAD_DIM, arch.scale, arch.attn_softcap
    )
    if caches is None:
        caches = [(k.clone(), v.clone()) for k, v in batch.caches]
    rows = torch.arange(len(CONTEXTS))
    logits = model.forward(batch.input_ids, batch.positions, caches, batch.metadata, backend, rows)
    assert (model.argmax_logprobs is not None) == native  # the native step ran, or not
    return logits.float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_native_step_equals_the_per_layer_path(case: str, dtype: torch.dtype) -> None:
    with_feature, without = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    weights = _weights(with_feature, dtype, gen)
    batch = _batch(dtype, gen)
    native = _logits(with_feature, weights, batch, native=True)
    per_layer = _logits(with_feature, weights, batch, native=False)
    assert bool(native.isfinite().all())
    difference = (native - per_layer).abs().max().item()
    assert difference <= TOLERANCE[dtype], (case, difference)
    # The feature changes the logits: a step that ignored it would fail above.
    plain = _logits(without, weights, batch, native=True)
    assert (native - plain).abs().max().item() > MATTERS, case


def _pooled(
    caches: list[tuple[torch.Tensor, torch.Tensor]], pad: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Copies of every layer's caches as views into one NaN-filled block-major pool (the
    worker's layout: blocks a pool row apart); and the pool."""
    shape = tuple(caches[0][0].shape)
    pool = block_pool(len(caches), shape, pad, dtype=caches[0][0].dtype)
    views = [layer_views(pool, layer, len(caches), shape) for layer in range(len(caches))]
    for (key, value), (key_view, value_view) in zip(caches, views, strict=True):
        key_view.copy_(key)
        value_view.copy_(value)
    return views, pool


@pytest.mark.parametrize("pool_pad", [0, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_step_over_a_block_pool_equals_it_over_caches_of_their_own(
    dtype: torch.dtype, pool_pad: int
) -> None:
    """Every layer's caches as views into one pool: the native step's logits are bit for bit
    those over caches in their own memory, each layer's cache afterwards holds what theirs
    does (the new tokens' K/V in their slots), nothing else in the pool changed; the
    per-layer path over the pool agrees too."""
    arch = CASES["window"][0]
    gen = torch.Generator().manual_seed(31)
    weights = _weights(arch, dtype, gen)
    batch = _batch(dtype, gen)
    own = [(k.clone(), v.clone()) for k, v in batch.caches]
    expected = _logits(arch, weights, batch, native=True, caches=own)
    views, pool = _pooled(batch.caches, pool_pad)
    before = pool.clone()
    assert torch.equal(_logits(arch, weights, batch, native=True, caches=views), expected)
    for (key, value), (key_view, value_view) in zip(own, views, strict=True):
        torch.testing.assert_close(key_view, key, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(value_view, value, rtol=0, atol=0, equal_nan=True)
    assert_unchanged_outside(before, pool, *(cache for pair in views for cache in pair))
    views, _ = _pooled(batch.caches, pool_pad)
    per_layer = _logits(arch, weights, batch, native=False, caches=views)
    assert (per_layer - expected).abs().max().item() <= TOLERANCE[dtype]


def test_native_step_refuses_layers_whose_blocks_lie_differently_apart() -> None:
    arch = _arch()
    gen = torch.Generator().manual_seed(32)
    weights = _weights(arch, torch.float32, gen)
    batch = _batch(torch.float32, gen)
    views, _ = _pooled(batch.caches, 0)
    views[1] = batch.caches[1]  # one layer in its own memory: blocks a block apart
    with pytest.raises(KernelArgumentError) as info:
        _logits(arch, weights, batch, native=True, caches=views)
    assert info.value.name == "kv_caches"


# Block types of the four projections, in turn per layer, so every type meets every shape.
BLOCK_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)


def _in_blocks(w: Weights, mode: QuantMode) -> tuple[Blocks, Weights]:
    """`w`'s projections, embedding and head in GGUF blocks; and the dense weights those
    blocks dequantize to."""

    def block(tensor: torch.Tensor, ggml_type: GGMLQuantizationType) -> QuantWeight:
        rows = quantize(tensor.numpy(), ggml_type)
        return QuantWeight(int(ggml_type), torch.from_numpy(rows), tensor.shape[1])

    def dense(weight: QuantWeight) -> torch.Tensor:
        data = dequantize(weight.blocks.numpy(), GGMLQuantizationType(weight.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(data))

    projections, layers = [], []
    for i, layer in enumerate(w.layers):
        swaps = {
            name: block(getattr(layer, name), BLOCK_TYPES[(i + j) % len(BLOCK_TYPES)])
            for j, name in enumerate(("qkv", "o", "gate_up", "down"))
        }
        projections.append(dict(swaps))
        layers.append(replace(layer, **{name: dense(b) for name, b in swaps.items()}))
    embed = block(w.embed, GGMLQuantizationType.Q8_0)
    head = block(w.lm_head, GGMLQuantizationType.Q4_1)
    dequantized = Weights(dense(embed), layers, w.final_norm, dense(head))
    return Blocks(projections, embed, head, mode), dequantized


@pytest.mark.parametrize("mode", MODES)
def test_native_step_on_gguf_blocks_equals_the_per_layer_path(mode: QuantMode) -> None:
    """Projections, embedding and head in blocks: the native step and the per-layer path run
    the same kernels; in exact mode both are the model of the dequantized weights, in fast
    mode 8-bit activations move the logits off it."""
    arch = _arch()
    gen = torch.Generator().manual_seed(27)
    weights = _weights(arch, torch.float32, gen)
    batch = _batch(torch.float32, gen)
    blocks, dequantized = _in_blocks(weights, mode)
    native = _logits(arch, weights, batch, native=True, blocks=blocks)
    per_layer = _logits(arch, weights, batch, native=False, blocks=blocks)
    assert bool(native.isfinite().all())
    tolerance = TOLERANCE[torch.float32]
    assert (native - per_layer).abs().max().item() <= tolerance
    reference = _logits(arch, dequantized, batch, native=False)
    off_reference = (native - reference).abs().max().item()
    if mode == "exact":
        assert off_reference <= tolerance
    else:
        assert off_reference > 10 * tolerance
    # The blocks are what the step multiplies: the original dense weights give other logits.
    assert (native - _logits(arch, weights, batch, native=True)).abs().max().item() > MATTERS


def test_fast_mode_interleaves_what_it_multiplies_and_changes_no_logit(monkeypatch) -> None:
    """install_blocks in fast mode interleaves every projection and the head (all of these
    have rows in eights; quant_interleaved.cpp): both paths then give the file layout's
    logits bit for bit."""
    if not quant.interleaves(GGMLQuantizationType.Q4_0):
        pytest.skip("this build has no AVX2 kernels, so nothing is interleaved")
    arch = _arch()
    gen = torch.Generator().manual_seed(28)
    weights = _weights(arch, torch.float32, gen)
    batch = _batch(torch.float32, gen)
    blocks, _ = _in_blocks(weights, "fast")
    made: list[QuantWeight | None] = []
    interleave = quant.interleave

    def counted(weight: QuantWeight) -> QuantWeight | None:
        made.append(interleave(weight))
        return made[-1]

    monkeypatch.setattr(quant, "interleave", counted)
    native = _logits(arch, weights, batch, native=True, blocks=blocks)
    per_layer = _logits(arch, weights, batch, native=False, blocks=blocks)
    assert len(made) == 2 * (4 * arch.num_layers + 1) and all(w is not None for w in made)
    monkeypatch.setattr(quant, "interleave", lambda weight: None)
    assert torch.equal(native, _logits(arch, weights, batch, native=True, blocks=blocks))
    assert torch.equal(per_layer, _logits(arch, weights, batch, native=False, blocks=blocks))


def test_exact_mode_refuses_interleaved_blocks() -> None:
    if not quant.interleaves(GGMLQuantizationType.Q4_0):
        pytest.skip("this build has no AVX2 kernels, so nothing is interleaved")
    arch = _arch()
    gen = torch.Generator().manual_seed(29)
    weights = _weights(arch, torch.float32, gen)
    blocks, _ = _in_blocks(weights, "exact")
    blocks.lm_head = quant.interleave(blocks.lm_head) or blocks.lm_head
    assert blocks.lm_head.interleaved
    with pytest.raises(KernelArgumentError, match="fast mode only"):
        _logits(arch, weights, _batch(torch.float32, gen), native=True, blocks=blocks)


@pytest.mark.parametrize("case", ["window", "attn_softcap", "gemma"])
def test_bfloat16_caches_of_a_float32_model_take_the_same_rows_on_both_paths(case: str) -> None:
    """`kv_cache_dtype` bfloat16 in a float32 model: both paths round the step's q, k and v
    rows to bfloat16, write k and v, attend on bfloat16 rows and widen the output, so their
    logits agree as with float32 caches and they write the same cache rows; the float32
    caches give other logits (the bfloat16 ones are what is read)."""
    arch = CASES[case][0]
    gen = torch.Generator().manual_seed(31)
    weights = _weights(arch, torch.float32, gen)
    batch = _batch(torch.float32, gen)

    def bf16_copies() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in batch.caches]

    native_caches, per_layer_caches = bf16_copies(), bf16_copies()
    native = _logits(arch, weights, batch, native=True, caches=native_caches)
    per_layer = _logits(arch, weights, batch, native=False, caches=per_layer_caches)
    assert bool(native.isfinite().all())
    assert (native - per_layer).abs().max().item() <= BF16_CACHE_TOLERANCE
    slots = batch.metadata.slot_mapping
    for (nk, nv), (pk, pv) in zip(native_caches, per_layer_caches, strict=True):
        assert nk.dtype == torch.bfloat16
        for native_cache, per_layer_cache in ((nk, pk), (nv, pv)):
            written = native_cache.flatten(0, 1)[slots].float()
            assert bool(written.isfinite().all())  # the step's rows replaced the NaN slots
            torch.testing.assert_close(
                written, per_layer_cache.flatten(0, 1)[slots].float(), rtol=2**-7, atol=1e-6
            )
    float_caches = _logits(arch, weights, batch, native=True)
    assert (native - float_caches).abs().max().item() > TOLERANCE[torch.float32]


def test_the_native_step_refuses_caches_of_another_dtype_but_bfloat16() -> None:
    arch = _arch()
    gen = torch.Generator().manual_seed(32)
    weights = _weights(arch, torch.float32, gen)
    batch = _batch(torch.float32, gen)
    halves = [(k.half(), v.half()) for k, v in batch.caches]
    with pytest.raises(KernelArgumentError, match="kv_caches"):
        _logits(arch, weights, batch, native=True, caches=halves)
