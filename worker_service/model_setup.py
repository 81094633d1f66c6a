"""From a transformers model and the worker's config to what the worker runs: the decoder on
the chosen attention backend and matmul implementation (GGUF blocks installed where asked
for), its KV layout, the model info the scheduler reads, and the runner over them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmserve.kv_layout import KvLayout, KvLayoutError, plan_layout
from llmserve.logs import get_logger
from llmserve.model_spec import resolve_model
from worker_service.attention import AttentionSpec, get_backend_class
from worker_service.attention.base import AttentionBackend
from worker_service.config import WorkerConfig
from worker_service.cuda_graphs import layout_allows_graphs
from worker_service.linear_impl import choose_linear_impl
from worker_service.model_info import ModelInfo
from worker_service.model_runner import ModelRunner
from worker_service.models import DecoderModel, model_from_hf, read_arch
from worker_service.models.arch import ModelArchConfig
from worker_service.models.held_weights import weight_bytes
from worker_service.models.native import default_native_max_batch
from worker_service.models.quantize_at_load import load_blocks
from worker_service.sampler import Sampler

log = get_logger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    model: DecoderModel
    info: ModelInfo
    runner: ModelRunner


def set_up_model(
    config: WorkerConfig, device: torch.device, dtype: torch.dtype, hf_model: Any
) -> LoadedModel:
    """The worker's model from `hf_model` (moved to `device` and `dtype`)."""
    arch = read_arch(hf_model.config, type(hf_model).__name__)
    max_len = arch.max_position_embeddings
    if config.max_model_len is not None:
        max_len = min(max_len, config.max_model_len)
    backend_cls = _backend_class(config, arch, device, dtype)
    hf_model = hf_model.to(device=device, dtype=dtype)
    # The native CPU backend brings the fused elementwise kernels and the prepacked
    # matmuls along; `torch` stays plain torch throughout, as the reference.
    linear_impl = choose_linear_impl(
        config.linear_impl, backend_cls.name, arch, device, dtype,
        lambda: resolve_model(config.model), config.quantization,
    )  # fmt: skip
    # The model takes the native decode step where it can run it (models/native.py)
    # and says why not otherwise: those models decode on the per-layer path.
    native_max = config.native_decode_max_batch
    if native_max is None:
        native_max = default_native_max_batch(arch, blocks=linear_impl == "gguf")
    model = model_from_hf(
        hf_model,
        max_positions=max_len,
        fused_ops=backend_cls.name == "cpu",
        packed_linear=linear_impl == "onednn",
        native_linear=linear_impl == "native",
        native_decode_max_batch=native_max if backend_cls.name == "cpu" else 0,
    )
    if linear_impl == "gguf":
        load_blocks(
            model, config.quantization, config.quant_mode,
            resolve_model(config.model),
        )  # fmt: skip
    if model.native_decode_refused is not None:
        log.info("native decode step off", reason=model.native_decode_refused)
    eos = _eos_ids(hf_model)
    layout = _kv_layout(config, arch)
    kv_dtype = config.resolve_kv_cache_dtype(dtype, backend_cls.name, linear_impl)
    if kv_dtype != dtype:
        log.info(
            "K/V cache in another dtype than the model",
            kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
        )
    info = ModelInfo(
        model=config.model,
        architecture=arch.architecture,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        block_size=config.block_size,
        max_model_len=max_len,
        vocab_size=arch.vocab_size,
        eos_token_id=eos[0] if eos else None,
        eos_token_ids=eos,
        attention_backend=backend_cls.name,
        linear_impl=linear_impl,
        num_threads=torch.get_num_threads(),
        weight_format=model.weight_format,
        weight_bytes=weight_bytes(model),
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
        kv_layout=layout,
    )
    # One backend per KV group: a backend keeps per-step state (masks, gather indices)
    # built from its group's block tables.
    backends: list[AttentionBackend] = []
    for group in layout.groups:
        num_kv_heads, head_dim = arch.kv_shape(group.layers[0])
        scale = arch.layer_scale(group.layers[0])
        backends.append(
            backend_cls(arch.num_heads, num_kv_heads, head_dim, scale, arch.attn_softcap)
        )
    if linear_impl == "gguf" and config.quant_mode == "fast":
        taken = [backend.take_bf16_prompt_dots() for backend in backends]
        log.info("prompts' attention in bfloat16 dot products", taken=all(taken))
    sampler = Sampler(
        arch.vocab_size, eos, seed=config.seed, native_reductions=backend_cls.name == "cpu"
    )
    runner = ModelRunner(model, backends, sampler, config.block_size, layout)
    return LoadedModel(model, info, runner)


def _backend_class(
    config: WorkerConfig, arch: ModelArchConfig, device: torch.device, dtype: torch.dtype
) -> type[AttentionBackend]:
    """The configured attention backend, for every attention shape the model has."""
    kv_layers = [i for i, kind in enumerate(arch.layers) if not kind.linear]
    specs = [
        AttentionSpec(
            device,
            dtype,
            arch.num_heads,
            num_kv_heads,
            head_dim,
            sliding_window=arch.sliding_window,
            softcap=arch.attn_softcap,
            sinks=arch.attention_sinks,
        )
        for num_kv_heads, head_dim in sorted({arch.kv_shape(i) for i in kv_layers})
    ]
    return get_backend_class(config.attention_backend, specs)


def _kv_layout(config: WorkerConfig, arch: ModelArchConfig) -> KvLayout:
    """The layers' KV groups (one, without the hybrid KV cache)."""
    # Layers that read another layer's K/V (Gemma 4) store none: they map to its slot.
    windows = [kind.sliding_window for kind in arch.layers]
    if not config.hybrid_kv_cache:
        windows = [None] * len(windows)  # one full group: every layer keeps every token
    widths = [heads * head_dim for heads, head_dim in map(arch.kv_shape, range(arch.num_layers))]
    layout = plan_layout(windows, arch.kv_sources, arch.linear_layers, widths)
    _check_group_shapes(layout, arch)
    if len(layout.groups) > 1 or layout.reserves_null_block:
        log.info(
            "hybrid KV cache",
            cuda_graphs_allowed=layout_allows_graphs(layout),
            groups=[
                f"{'full' if g.sliding_window is None else g.sliding_window}:{len(g.layers)}"
                for g in layout.groups
            ],
            slots_per_block=layout.slots,
        )
    return layout


def _check_group_shapes(layout: KvLayout, arch: ModelArchConfig) -> None:
    """A group's layers attend with one backend: refuse layers of one width but different
    shapes laid out together (say 2 heads of 256 beside 1 of 512), by name."""
    for group in layout.groups:
        shapes = {arch.kv_shape(layer): layer for layer in group.layers}
        if len(shapes) > 1:
            described = ", ".join(f"layer {i}: {h} kv heads x {d}" for (h, d), i in shapes.items())
            raise KvLayoutError(f"one KV group holds layers of different shapes ({described})")


def _eos_ids(hf_model: Any) -> tuple[int, ...]:
    gen = getattr(hf_model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(hf_model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
