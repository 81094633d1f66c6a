"""The one factory of tiny random models for tests, saved with `save_pretrained` (no network).

`save_tiny_model(kind, ...)` builds every architecture the worker supports from one shared
config (`KINDS`: the Llama family; `FAMILY_KINDS`: one model per other family, each with
the features that family is about switched on: explicit head_dim, sliding windows smaller
than prompt + output, soft-caps, NoPE layers, experts...; `HYBRID_KINDS`: the families with
linear-attention layers, tested apart: tests/integration/test_worker_engine_hybrid.py). After init every parameter is
perturbed (transformers sets biases to 0 and norms to their neutral value, which would hide
a wrong bias or norm formula), the router weights are sharpened (so near-ties cannot flip
routing) and the output embedding is widened (so greedy near-ties cannot flip tokens).
`build_tiny_llama` is the Llama the service tests run, with SmolLM2's real tokenizer.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from llmserve.gguf_files import reading_gguf_once
from llmserve.model_spec import resolve_model

VOCAB = 128
KINDS = ("llama", "llama3", "qwen2", "mistral")
FAMILY_KINDS = (
    "qwen3",
    "gemma3",
    "gemma3_mm",
    "gemma2",
    "phi3",
    "olmo2",
    "olmo3",
    "granite",
    "smollm3",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "gemma4",
    "gemma4_mm",
)
# Qwen3.5 and Qwen3-Next: Gated DeltaNet and gated attention layers; `qwen3_5_mm` is saved as
# a Qwen3_5ForConditionalGeneration checkpoint (with a vision tower), as Qwen3.5 ships.
HYBRID_KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_mm")
# Three linear-attention layers to each full one, twice.
_HYBRID_TYPES = (["linear_attention"] * 3 + ["full_attention"]) * 2
# The classes kinds are saved as where the causal-LM auto class would build another.
_SAVED_AS = {"qwen3_5_mm": "Qwen3_5ForConditionalGeneration"}
# A window smaller than the test prompts plus their outputs, so that it matters.
WINDOW = 8
_SIX = dict(num_hidden_layers=6)
_GEMMA3_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
# Gemma 4: the last two layers read the K/V of layers 3 (sliding) and 2 (full).
_GEMMA4_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
# OLMo 3's three sliding layers in four, then one more of each kind.
_OLMO3_TYPES = ["sliding_attention"] * 3 + ["full_attention", "sliding_attention", "full_attention"]

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    eos_token_id=1,
    bos_token_id=0,
)


def tiny_config(kind: str, **overrides: Any) -> Any:
    """The HF config of a tiny `kind` model; `overrides` replace the shared values."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = {**_COMMON, **overrides}
    if kind == "llama":
        return LlamaConfig(**{"tie_word_embeddings": False, **common})
    if kind == "llama3":
        return LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if kind == "qwen2":
        return Qwen2Config(**{"tie_word_embeddings": True, **common})
    if kind == "mistral":
        return MistralConfig(**{**common, "num_key_value_heads": 1}, sliding_window=None)
    return _family_config(kind, {**_COMMON, **_SIX, **overrides})


def _family_config(kind: str, common: dict[str, Any]) -> Any:
    import transformers as tf

    if kind == "qwen3":
        return tf.Qwen3Config(
            **common,
            head_dim=32,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=3,
            tie_word_embeddings=True,
        )
    if kind in ("gemma3", "gemma3_mm"):
        window = common.pop("sliding_window", WINDOW)
        text = tf.Gemma3TextConfig(
            **common,
            head_dim=32,
            sliding_window=window,
            layer_types=_GEMMA3_TYPES,
            query_pre_attn_scalar=24,
            final_logit_softcapping=20.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
        if kind == "gemma3":
            return text
        vision = tf.SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        return tf.Gemma3Config(
            text_config=text.to_dict(),
            vision_config=vision.to_dict(),
            mm_tokens_per_image=4,
            image_token_index=VOCAB - 1,
            boi_token_index=VOCAB - 2,
            eoi_token_index=VOCAB - 3,
        )
    if kind == "gemma2":
        return tf.Gemma2Config(
            **common,
            head_dim=32,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=20.0,
            tie_word_embeddings=False,
        )
    if kind == "phi3":
        rotary_pairs = int(32 * 0.75) // 2
        return tf.Phi3Config(
            **{**common, "hidden_size": 128},
            sliding_window=12,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(rotary_pairs)],
                "long_factor": [2.0 + 0.5 * i for i in range(rotary_pairs)],
                "original_max_position_embeddings": 64,
            },
            original_max_position_embeddings=64,
            pad_token_id=0,
        )
    if kind == "olmo2":
        return tf.Olmo2Config(
            **common, attention_bias=True, tie_word_embeddings=False, pad_token_id=0
        )
    if kind == "olmo3":
        return tf.Olmo3Config(
            **common,
            head_dim=32,
            sliding_window=WINDOW,
            layer_types=_OLMO3_TYPES,
            rope_parameters={
                "full_attention": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 5e5,
                    "original_max_position_embeddings": 64,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            tie_word_embeddings=False,
            pad_token_id=0,
        )
    if kind == "granite":
        return tf.GraniteConfig(
            **common,
            embedding_multiplier=6.0,
            attention_multiplier=0.09,
            residual_multiplier=0.4,
            logits_scaling=2.0,
            tie_word_embeddings=True,
        )
    if kind == "smollm3":
        return tf.SmolLM3Config(
            **common,
            no_rope_layers=[1, 1, 1, 0, 1, 0],
            use_sliding_window=True,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 3,
            tie_word_embeddings=True,
            pad_token_id=0,
        )
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0, 3],
            tie_word_embeddings=False,
        )
    if kind == "mixtral":
        return tf.MixtralConfig(
            **common,
            head_dim=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            tie_word_embeddings=False,
        )
    if kind == "gpt_oss":
        return _gpt_oss_config(common)
    if kind in HYBRID_KINDS:
        return _hybrid_config(kind, common)
    if kind == "gemma4":
        return _gemma4_config(common, moe=False)
    if kind == "gemma4_mm":  # a Gemma4ForConditionalGeneration checkpoint without towers
        text = _gemma4_config(common, moe=True)
        return tf.Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=None)
    raise ValueError(kind)


def _gemma4_config(common: dict[str, Any], moe: bool) -> Any:
    """Per-layer inputs, the last two layers reading earlier layers' K/V, keys reused as values
    on the global layers, proportional rotary on a quarter of their head; `moe`: alternating
    layer types (other KV sources), experts beside double-wide dense MLPs. The global layers'
    heads are twice as wide as the local ones (64 against 32, as Gemma 4's 512 against 256):
    twice the K/V width per token, or with `moe` the same width in one K/V head (as the
    large Gemma 4 models' fewer global K/V heads)."""
    import transformers as tf

    types = ["sliding_attention", "full_attention"] * 3 if moe else _GEMMA4_TYPES
    experts = dict(
        num_global_key_value_heads=1,
        enable_moe_block=True,
        use_double_wide_mlp=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=48,
    )
    settings: dict[str, Any] = dict(
        head_dim=32,
        global_head_dim=64,
        sliding_window=WINDOW,
        layer_types=types,
        num_kv_shared_layers=2,
        attention_k_eq_v=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        final_logit_softcapping=30.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1e6,
            },
        },
        pad_token_id=0,
        **(experts if moe else {}),
    )
    return tf.Gemma4TextConfig(**{**settings, **common})  # the caller's overrides win


def _hybrid_config(kind: str, common: dict[str, Any]) -> Any:
    """Eight layers (`_HYBRID_TYPES`), linear attention with twice as many value heads as key
    heads, rotary on a quarter of each head (the families' default); experts with a shared
    one for `qwen3_5_moe`, and for `qwen3_next` beside dense MLPs on a linear-attention layer
    and a full one, with biased attention projections."""
    import transformers as tf

    settings: dict[str, Any] = dict(
        common,
        num_hidden_layers=len(_HYBRID_TYPES),
        layer_types=_HYBRID_TYPES,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    experts: dict[str, Any] = dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=64,
    )
    if kind == "qwen3_5":
        return tf.Qwen3_5TextConfig(**settings)
    if kind == "qwen3_5_moe":
        settings.pop("intermediate_size")
        return tf.Qwen3_5MoeTextConfig(**settings, **experts)
    if kind == "qwen3_next":
        return tf.Qwen3NextConfig(
            **settings,
            **experts,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0, 3],
            attention_bias=True,
        )
    vision = tf.Qwen3_5VisionConfig(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=common["hidden_size"],
        patch_size=14,
    )
    return tf.Qwen3_5Config(
        text_config=tf.Qwen3_5TextConfig(**settings).to_dict(),
        vision_config=vision.to_dict(),
        image_token_id=VOCAB - 1,
        video_token_id=VOCAB - 2,
        vision_start_token_id=VOCAB - 3,
        vision_end_token_id=VOCAB - 4,
    )


def _gpt_oss_config(common: dict[str, Any]) -> Any:
    """Windows on alternate layers, YaRN without truncation, a SwiGLU limit the tiny model's
    activations reach (the released 7.0 never clamps here) and a non-default alpha."""
    import transformers as tf

    return tf.GptOssConfig(
        **common,  # intermediate 96 and hidden 64: both multiples of MXFP4's 32-weight groups
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 3,
        swiglu_limit=0.3,
        swiglu_alpha=1.3,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 8.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
        pad_token_id=0,
    )


def save_tiny_model(
    kind: str, path: Path, seed: int = 0, sharpen: bool = True, **overrides: Any
) -> Path:
    """A randomly initialised `kind` model saved at `path` (like a checkpoint). `sharpen`
    widens the logits: random init keeps them near-uniform, where greedy ties could flip."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(kind, **overrides)
    if kind in _SAVED_AS:
        model = getattr(transformers, _SAVED_AS[kind])(config).to(torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if sharpen:
        with torch.no_grad():
            perturb(model)
            widen_logits(model, 8.0)
    model.save_pretrained(path)
    return path


def widen_logits(model: Any, factor: float) -> None:
    """Multiply the logits by about `factor`. With tied embeddings the shared matrix is
    shrunk instead (x 0.1) and the final norm widened (x 10 * factor): a tied random model
    whose embeddings outweigh its blocks only ever repeats its last input token, which no
    bug in the blocks could change."""
    out = model.get_output_embeddings().weight
    if out.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        out.mul_(factor)
        return
    out.mul_(0.1)
    inner = model.model
    norm = getattr(inner, "language_model", inner).norm.weight
    name = type(model).__name__
    if "Gemma" in name and "Gemma4" not in name:  # the norm scales by (1 + weight)
        norm.copy_((1.0 + norm) * 10 * factor - 1.0)
    else:
        norm.mul_(10 * factor)


def perturb(model: Any) -> None:
    """Move every parameter off its init: norm weights by N(0, 0.2), biases by N(0, 0.02)
    (larger ones, added in every layer, make every output the same token), matrices by
    N(0, 0.05); sharpen routers (x 40) so top-k picks are never near-ties. Layer scalars
    (Gemma 4's, buffers that init leaves at 1) are spread over [0.75, 1.25]."""
    import torch

    for name, buffer in model.named_buffers():
        if name.endswith("layer_scalar"):
            buffer.copy_(0.75 + 0.5 * torch.rand_like(buffer))
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            param.add_(torch.randn_like(param) * 0.02)
        elif param.dim() == 1:
            param.add_(torch.randn_like(param) * 0.2)
        else:
            param.add_(torch.randn_like(param) * 0.05)
        if name.endswith(("mlp.gate.weight", "mlp.router.weight", "router.proj.weight")):
            param.mul_(40.0)


def load_hf(path: Path) -> Any:
    """The saved model in transformers, generating exactly max_new_tokens (no EOS stop)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    _honour_swiglu_config(model)
    return model


def _honour_swiglu_config(model: Any) -> None:
    """gpt-oss's experts clamp and gate with the config's swiglu_limit and swiglu_alpha; the
    tiny model sets both away from their defaults. transformers before 5.18 fixed them at the
    defaults in GptOssExperts (the GPU machine's image has 5.17), so they are set from the
    config here, which changes nothing where transformers reads them itself."""
    config = model.config
    if not hasattr(config, "swiglu_limit"):
        return
    for module in model.modules():
        if type(module).__name__ == "GptOssExperts":
            module.limit = config.swiglu_limit
            module.alpha = config.swiglu_alpha


# A GGUF file runs on its blocks in fast mode by default (llama.cpp's numerics: 8-bit
# activations). Stacks whose outputs are compared with HF's model, or with an undisturbed run
# after a fault, run their workers in exact mode: HF's model, where a sequence recomputed as a
# prompt differs from its decode steps by summation order only, which fast mode's rounding
# of each layer's input can widen into another token at a near tie.
EXACT_MODE_ARGS = ["--quant-mode", "exact"]


# The exactness prompts: greedy output of the real model on these, SMOLLM2_EXACTNESS_NEW tokens
# each, must equal HF's token for token (tests/integration/test_worker_engine_smollm2.py, and
# the GGUF-blocks worker's test).
SMOLLM2_EXACTNESS_TEXTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Write a short poem about the sea. The waves",
    "Q: What is 17 times 23?\nA:",
    "Once upon a time, in a small village at the edge of a dark and ancient forest, there lived "
    "an old clockmaker who had never once left the valley. Every morning he",
    "List three uses of copper:\n1.",
    "Translate to German: I would like a cup of coffee, please.",
    "In machine learning, overfitting happens when",
)
SMOLLM2_EXACTNESS_NEW = 64


def load_smollm2() -> tuple[Any, Any]:
    """The embedded SmolLM2 (its shipped Q4_1 file, dequantized by transformers) as float32
    HF (tokenizer, model), generating exactly max_new_tokens (no EOS stop); shared, as
    load_spec's are."""
    return load_spec("smollm2")


@functools.cache
def smollm2_exactness() -> tuple[list[list[int]], list[list[int]]]:
    """The exactness prompts (SMOLLM2_EXACTNESS_TEXTS) as SmolLM2's token ids, and HF's greedy
    continuation of each, SMOLLM2_EXACTNESS_NEW tokens: computed once per test session."""
    tok, hf = load_smollm2()
    prompts = [tok(text)["input_ids"] for text in SMOLLM2_EXACTNESS_TEXTS]
    return prompts, hf_greedy_outputs(hf, prompts, SMOLLM2_EXACTNESS_NEW)


def hf_greedy_outputs(hf: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF generate's greedy continuation of each prompt, one at a time (no padding)."""
    import torch

    outputs = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@functools.cache
def load_spec(spec: str) -> tuple[Any, Any]:
    """A model spec (llmserve.model_spec: an alias, a directory, a .gguf file) as float32 HF
    (tokenizer, model), generating exactly max_new_tokens (no EOS stop). Loaded once per test
    session and shared by every caller, which must not change it (a worker's load_from_hf
    reads its weights and leaves them as they are)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model(spec)
    with reading_gguf_once():  # the file's header parsed once, fast (tests/unit/common)
        tok = AutoTokenizer.from_pretrained(src.path, **src.pretrained_kwargs())
        model = AutoModelForCausalLM.from_pretrained(
            src.path, **src.pretrained_kwargs(), dtype=torch.float32
        ).eval()
    model.generation_config.eos_token_id = None
    return tok, model


def build_tiny_llama(directory: Path, seed: int = 0, num_layers: int = 2) -> Path:
    """A random Llama with SmolLM2's real tokenizer and chat template, so text tests exercise
    the real byte-level BPE while the model stays fast."""
    return _with_smollm2_tokenizer(
        "llama",
        directory,
        seed=seed,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )


# The window of the windowed service model: far shorter than its tests' sequences.
SERVICE_WINDOW = 24


def build_tiny_windowed(directory: Path, seed: int = 0) -> Path:
    """A random Gemma 3 (two sliding layers of SERVICE_WINDOW tokens to each global one, so a
    hybrid KV layout: a full group and two windowed ones) with SmolLM2's tokenizer, for the
    service tests of the hybrid KV cache."""
    return _with_smollm2_tokenizer(
        "gemma3",
        directory,
        seed=seed,
        intermediate_size=128,
        max_position_embeddings=512,
        sliding_window=SERVICE_WINDOW,
        tie_word_embeddings=True,
    )


def build_tiny_thinker(directory: Path, seed: int = 0) -> Path:
    """A random Qwen3 that thinks: SmolLM2's tokenizer with `<think>` and `</think>` added as
    tokens (as Qwen3's has them) and tests/support/templates/think.jinja as its chat template
    (the prompt opens the block), for the service tests of reasoning. Its logits are widened,
    so greedy choices do not flip between a prefill and the decode steps it replaces."""
    from tests.support.templates import template_text

    return _with_smollm2_tokenizer(
        "qwen3",
        directory,
        seed=seed,
        sharpen=True,
        added_tokens=["<think>", "</think>"],
        chat_template=template_text("think"),
        intermediate_size=128,
        max_position_embeddings=512,
    )


def build_tiny_hybrid(directory: Path, seed: int = 0) -> Path:
    """A random Qwen3.5 (Gated DeltaNet layers beside gated attention ones: a state slot per
    sequence beside its block table) with SmolLM2's tokenizer, for the service tests of the
    hybrid families. Its logits are widened, so greedy choices do not flip between a
    prefill and the decode steps it replaces."""
    return _with_smollm2_tokenizer(
        "qwen3_5", directory, seed=seed, sharpen=True, max_position_embeddings=512
    )


def _with_smollm2_tokenizer(
    kind: str,
    directory: Path,
    seed: int,
    sharpen: bool = False,
    added_tokens: list[str] = (),  # type: ignore[assignment]
    chat_template: str | None = None,
    **overrides: Any,
) -> Path:
    from transformers import AutoTokenizer

    source = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(source.path, **source.pretrained_kwargs())
    if added_tokens:
        tokenizer.add_tokens(list(added_tokens))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    save_tiny_model(
        kind,
        directory,
        seed=seed,
        sharpen=sharpen,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **overrides,
    )
    tokenizer.save_pretrained(directory)
    return directory
