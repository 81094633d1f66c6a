"""What the worker knows about a model's architecture: one frozen `ModelArchConfig`, read
from a transformers config by the family's module (see `registry`).

The fields are the features families differ in (norm kind, q/k norms, norm placement,
activation, multipliers, soft-capping, per-layer attention), so that one decoder
(`decoder.DecoderModel`) runs them all. `read_common` reads the fields every family shares
and refuses what no family here implements, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from worker_service.models.rope import RopeSpec, UnsupportedModelError, read_rope_spec

# How an RMSNorm applies its weight. "rms": weight * normalized.to(dtype) (Llama);
# "rms_f32": (weight * normalized).to(dtype) (OLMo 2); "gemma": (normalized * (1 + weight))
# in float32, then cast (Gemma 2 and 3, Qwen3.5, Qwen3-Next).
NormKind = Literal["rms", "rms_f32", "gemma"]
# "head": one [head_dim] norm per head after the projection (Qwen3, Gemma 3); "full": one
# norm over the whole q (or k) projection (OLMo 2).
QKNorm = Literal["head", "full"] | None
# SwiGLU (silu) or GeGLU with tanh-approximated gelu (Gemma).
Activation = Literal["silu", "gelu_tanh"]
# How a router turns logits into top-k weights: "softmax_topk" takes the top k of a float32
# softmax over every expert (Mixtral, Qwen3-MoE); "topk_softmax" takes the top k logits and
# softmaxes only those, in the model dtype (gpt-oss); "scaled_softmax_topk" routes an
# RMS-normalized input times a learned scale and hidden ** -0.5, takes "softmax_topk" always
# renormalised, then scales each pick by its expert's learned scale (Gemma 4).
Routing = Literal["softmax_topk", "topk_softmax", "scaled_softmax_topk"]

_ACTIVATIONS: dict[str, Activation] = {
    "silu": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
}
_LAYER_TYPES = ("full_attention", "sliding_attention")
# A Gated DeltaNet layer's type (`LayerKind.linear`), where a family's layer types have it.
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True, slots=True)
class LayerKind:
    """How one layer attends."""

    sliding_window: int | None  # keys with query_pos - key_pos < window; None = all
    rope: int | None  # index into ModelArchConfig.ropes; None = no rotary (NoPE)
    # The layer whose K/V this one reads (KV shared across layers, Gemma 4): it projects no
    # keys or values and stores none. None: it stores its own.
    kv_source: int | None = None
    # A Gated DeltaNet layer (`ModelArchConfig.linear_attention`): it stores no K/V and keeps
    # a fixed-size state per sequence instead (`delta_net`); window and rope do not apply.
    linear: bool = False
    # This layer's attention shape where it differs from the model's (Gemma 4's global
    # layers): its head size (queries, keys and values) and its K/V heads. None: the model's.
    head_dim: int | None = None
    num_kv_heads: int | None = None


@dataclass(frozen=True, slots=True)
class LinearAttentionSpec:
    """The shape of a model's Gated DeltaNet layers (`delta_net`) and of their per-sequence
    states (`worker_service.linear_state`)."""

    num_k_heads: int  # query and key heads
    num_v_heads: int  # value heads, a multiple of num_k_heads
    k_dim: int  # per query/key head
    v_dim: int  # per value head
    conv_kernel: int  # taps of the causal convolution over q, k and v

    @property
    def key_width(self) -> int:
        return self.num_k_heads * self.k_dim

    @property
    def value_width(self) -> int:
        return self.num_v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_width + self.value_width

    def conv_state_shape(self) -> tuple[int, int]:
        """One sequence's conv state (its last conv_kernel - 1 inputs); its pool's dtype is
        in `linear_state`, as the recurrent state's."""
        return (self.conv_kernel - 1, self.conv_dim)

    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """One sequence's delta-rule state: a [k_dim, v_dim] matrix per value head."""
        return (self.num_v_heads, self.k_dim, self.v_dim)


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A sparse MLP: `num_experts` SwiGLU experts of `intermediate_size`, top-k routing."""

    num_experts: int
    top_k: int
    intermediate_size: int
    # Renormalise the top-k probabilities to sum to 1 (Mixtral always, Qwen3-MoE by flag).
    norm_topk_prob: bool
    # Layers that keep a dense MLP of the model's intermediate_size.
    dense_layers: frozenset[int] = frozenset()
    # Cast the routing weights to the model dtype before scaling expert outputs (Qwen3-MoE,
    # Qwen3-Next, Qwen3.5-MoE); Mixtral scales in float32.
    round_weights: bool = False
    routing: Routing = "softmax_topk"
    # The clamped SwiGLU of gpt-oss's experts when set: gate clamped above and up on both
    # sides at this limit, then (up + 1) * gate * sigmoid(swiglu_alpha * gate).
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    # The experts run beside the layer's dense MLP, not instead of it (Gemma 4): each with
    # its own norms, outputs added (`moe.parallel_moe_mlp`).
    beside_dense: bool = False
    # A shared expert of this width beside the routed ones (Qwen3-Next, Qwen3.5-MoE): a SwiGLU
    # MLP every token runs, times sigmoid of a learned gate on the token, added to their sum
    # (`moe.moe_mlp`). None: none.
    shared_expert_size: int | None = None


@dataclass(frozen=True, slots=True)
class ModelArchConfig:
    """The shape and features of a decoder-only model, read from a transformers config."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    ropes: tuple[RopeSpec, ...]  # the distinct rotary tables; layers index them
    layers: tuple[LayerKind, ...]
    norm: NormKind = "rms"
    qk_norm: QKNorm = None
    activation: Activation = "silu"
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    embed_scale: float | None = None  # embeddings times this (Granite, Gemma)
    # Gemma rounds its embedding scale to the weight dtype before multiplying.
    round_embed_scale: bool = False
    residual_scale: float | None = None  # each block's output times this (Granite)
    logits_divisor: float | None = None  # logits / this (Granite's logits_scaling)
    moe: MoeSpec | None = None
    # Norms on block outputs (Gemma's post-attention/post-feedforward norms, OLMo 2's only
    # norms) and whether blocks have input norms (OLMo 2: none).
    output_norms: bool = False
    input_norms: bool = True
    # A learned per-head logit in every softmax's denominator (gpt-oss's `sinks`): each layer
    # has its own `LayerWeights.sinks`, which the attention backend takes per call.
    attention_sinks: bool = False
    # Values normalized per head (RMS, no weight) before they are stored (Gemma 4).
    value_norm: bool = False
    # Per-layer inputs (Gemma 4): each token gets a vector of this width per layer, from an
    # embedding of its id and a projection of its embedding, that gates a residual branch
    # after the MLP (`decoder.PerLayerInputs`). None: none.
    per_layer_input_size: int | None = None
    # Every layer's output (the residual stream) times its learned scalar (Gemma 4).
    layer_scalars: bool = False
    # The query projection also yields a gate per query dim; the attention output times its
    # sigmoid goes into the output projection (Qwen3.5, Qwen3-Next). The gate rows follow
    # q, k and v in `LayerWeights.qkv`.
    attention_output_gate: bool = False
    # The Gated DeltaNet layers' shape (the layers with `LayerKind.linear`); None: none.
    linear_attention: LinearAttentionSpec | None = None

    @property
    def scale(self) -> float:
        return self.layer_scale(0)

    def layer_scale(self, layer: int) -> float:
        """The attention scale of one layer (its head size's, unless the family fixes one)."""
        if self.attention_scale is not None:
            return self.attention_scale
        return self.layer_head_dim(layer) ** -0.5

    def layer_head_dim(self, layer: int) -> int:
        kind = self.layers[layer]
        return self.head_dim if kind.head_dim is None else kind.head_dim

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """One layer's (num_kv_heads, head_dim) as its K/V cache holds them."""
        kind = self.layers[layer]
        heads = self.num_kv_heads if kind.num_kv_heads is None else kind.num_kv_heads
        return heads, self.layer_head_dim(layer)

    @property
    def uniform_attention(self) -> bool:
        """Whether every layer attends with the model's head size and K/V heads."""
        return all(k.head_dim is None and k.num_kv_heads is None for k in self.layers)

    @property
    def rope(self) -> RopeSpec:
        """The first rotary table (the only one for most families)."""
        return self.ropes[0]

    @property
    def kv_sources(self) -> dict[int, int]:
        """Layer -> the layer whose K/V it reads, for the layers that store none."""
        return {i: k.kv_source for i, k in enumerate(self.layers) if k.kv_source is not None}

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The Gated DeltaNet layers: they keep a state per sequence, not K/V."""
        return tuple(i for i, k in enumerate(self.layers) if k.linear)

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        return tuple(sorted({k.sliding_window for k in self.layers if k.sliding_window}))

    @property
    def sliding_window(self) -> int | None:
        """The smallest window of any layer, or None when every layer attends to all keys."""
        windows = self.sliding_windows
        return windows[0] if windows else None

    def fused_blockers(self) -> list[str]:
        """The features the fused CPU elementwise ops (the norms of every kind, the q/k
        norms, rotary over the first rotary_dim dims of each head, SiLU- and GELU-and-
        multiply, all on the layer's one attention shape) cannot compute; the rest of the
        decoder runs around them."""
        checks = {
            "KV-shared layers": bool(self.kv_sources),
            "per-layer attention shapes": not self.uniform_attention,
        }
        return [name for name, present in checks.items() if present]

    def native_blockers(self) -> list[str]:
        """The features of this model that the native decode step (llmserve_kernels/cpu/decode.cpp)
        does not run, by name: such a model decodes on the per-layer path."""
        checks = {
            "mixture of experts": self.moe is not None,
            "attention sinks": self.attention_sinks,
            "rotary tables of different widths": len({r.rotary_dim for r in self.ropes}) > 1,
            "KV-shared layers": bool(self.kv_sources),
            "value norm": self.value_norm,
            "per-layer inputs": self.per_layer_input_size is not None,
            "layer scalars": self.layer_scalars,
            "attention output gate": self.attention_output_gate,
            "linear-attention layers": bool(self.linear_layers),
            "per-layer attention shapes": not self.uniform_attention,
        }
        return [name for name, present in checks.items() if present]


def read_activation(config: Any, *names: str) -> Activation:
    """The MLP activation under the first of `names` the config has."""
    value = next((getattr(config, n) for n in names if getattr(config, n, None)), "silu")
    if value not in _ACTIVATIONS:
        raise UnsupportedModelError(
            f"activation {value!r} is not supported; supported: {', '.join(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[value]


def read_layer_kinds(
    config: Any,
    num_layers: int,
    rope_of_type: dict[str, int] | None = None,
    use_rope: list[bool] | None = None,
    windows: bool = True,
    supported: tuple[str, ...] = _LAYER_TYPES,
) -> tuple[LayerKind, ...]:
    """Per-layer attention: `layer_types` when the config has them (a layer of type
    `sliding_attention` gets `sliding_window`, one of type `linear_attention` is a Gated
    DeltaNet layer), else the model-wide `sliding_window` on every layer (Mistral, Phi-3,
    Mixtral). `rope_of_type` maps a layer type to its rotary table; `use_rope[i]` False makes
    layer i a NoPE layer; `windows` False turns windows off; `supported`: the layer types the
    family runs, others are refused by name."""
    window = (getattr(config, "sliding_window", None) or None) if windows else None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        types = ["sliding_attention" if window else "full_attention"] * num_layers
    else:
        types = list(layer_types)
        if len(types) != num_layers:
            raise UnsupportedModelError(
                f"layer_types has {len(types)} entries for {num_layers} layers"
            )
    unknown = sorted({t for t in types if t not in supported})
    if unknown:
        raise UnsupportedModelError(
            f"layer types {unknown} are not supported; supported: {', '.join(supported)}"
        )
    kinds = []
    for i, kind in enumerate(types):
        if kind == LINEAR_ATTENTION:
            kinds.append(LayerKind(sliding_window=None, rope=None, linear=True))
            continue
        rope: int | None = (rope_of_type or {}).get(kind, 0)
        if use_rope is not None and not use_rope[i]:
            rope = None
        sliding = window if kind == "sliding_attention" else None
        kinds.append(LayerKind(sliding_window=sliding, rope=rope))
    return tuple(kinds)


def read_head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def read_ropes_by_layer_type(
    config: Any, head_dims: dict[str, int] | None = None
) -> tuple[tuple[RopeSpec, ...], dict[str, int]]:
    """One rotary table per layer type, from `rope_parameters` keyed by layer type (Gemma 3,
    OLMo 3): the tables, and the map from layer type to table that `read_layer_kinds`
    takes. `head_dims`: the head size of a layer type where it is not the config's. Refuses
    rope parameters that do not name every layer type."""
    params = getattr(config, "rope_parameters", None) or {}
    missing = [t for t in _LAYER_TYPES if t not in params]
    if missing:
        raise UnsupportedModelError(
            f"rope_parameters must be keyed by layer type {_LAYER_TYPES}; "
            f"missing {missing}, got {list(params)}"
        )
    head_dim = read_head_dim(config)
    sizes = head_dims or {}
    ropes = tuple(read_rope_spec(params[t], sizes.get(t, head_dim), config) for t in _LAYER_TYPES)
    return ropes, {t: i for i, t in enumerate(_LAYER_TYPES)}


def read_common(
    config: Any, architecture: str, *, rope_params: dict[str, Any] | None = None, **features: Any
) -> ModelArchConfig:
    """The fields every family shares, plus `features` (ModelArchConfig's other fields).
    `layers`/`ropes` default to one rotary table and `read_layer_kinds`; `intermediate_size`
    to the config's (a model whose every MLP is sparse may have none)."""
    num_heads = config.num_attention_heads
    head_dim = read_head_dim(config)
    num_layers = config.num_hidden_layers
    if "ropes" not in features:
        params = rope_params if rope_params is not None else _rope_parameters(config)
        features["ropes"] = (read_rope_spec(params, head_dim, config),)
    if "layers" not in features:
        features["layers"] = read_layer_kinds(config, num_layers)
    if "activation" not in features:
        features["activation"] = read_activation(config, "hidden_act")
    if "intermediate_size" not in features:
        features["intermediate_size"] = config.intermediate_size
    return ModelArchConfig(
        architecture=architecture,
        num_layers=num_layers,
        hidden_size=config.hidden_size,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        **features,
    )


def _rope_parameters(config: Any) -> dict[str, Any]:
    """The config's rope parameters as one dict (transformers 5's `rope_parameters`, or the
    older `rope_theta` + `rope_scaling`)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    return params
