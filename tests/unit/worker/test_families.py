"""The architecture registry and the family building blocks, against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Phi3Config, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tests.support.models import save_tiny_model, tiny_config
from worker_service.models import UnsupportedModelError, read_arch
from worker_service.models.arch import MoeSpec
from worker_service.models.moe import every_expert_mlp, moe_mlp
from worker_service.models.rope import RopeSpec, _yarn, cos_sin_for, read_rope_spec
from worker_service.models.weights import MoeWeights

from .factories import make_worker

# torch's float32 cos/sin of large angles is not bit-stable across calls (seen: 1.7e-4 apart
# at angle ~190 between two runs of the same computation), so tables compare with a
# tolerance; the inverse frequencies and the attention factor behind them compare exactly.
TABLE_TOL = dict(rtol=0.0, atol=1e-3)


def _hf_cos_sin(config: object, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    params = config.rope_parameters  # type: ignore[attr-defined]
    inv_freq, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, None)
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos() * factor, angles.sin() * factor


def test_yarn_table_matches_transformers() -> None:
    config = Qwen3Config(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 128,
        },
    )
    spec = read_rope_spec(config.rope_parameters, 32, config)
    cos, sin = cos_sin_for(spec, 300, torch.float32, torch.device("cpu"))
    ref_cos, ref_sin = _hf_cos_sin(config, 300)
    torch.testing.assert_close(cos, ref_cos, **TABLE_TOL)
    torch.testing.assert_close(sin, ref_sin, **TABLE_TOL)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, None)
    assert (_yarn(32, spec.theta, spec.params, 512)[1], factor) == (factor, factor)
    torch.testing.assert_close(_yarn(32, spec.theta, spec.params, 512)[0], inv_freq, rtol=0, atol=0)
    assert not torch.allclose(
        cos, cos_sin_for(RopeSpec(10000.0, (), 32, 512), 300, torch.float32, torch.device("cpu"))[0]
    )


def test_longrope_short_factors_within_the_original_context_long_beyond() -> None:
    config = tiny_config("phi3")
    assert isinstance(config, Phi3Config)
    head_dim = config.hidden_size // config.num_attention_heads
    spec = read_rope_spec(config.rope_parameters, head_dim, config)
    assert spec.rotary_dim == 24  # partial_rotary_factor 0.75 of 32
    cos, sin = cos_sin_for(spec, 200, torch.float32, torch.device("cpu"))
    short_cos, short_sin = _hf_cos_sin(config, 200)  # transformers' short set (seq_len None)
    torch.testing.assert_close(cos[:64], short_cos[:64], **TABLE_TOL)
    torch.testing.assert_close(sin[:64], short_sin[:64], **TABLE_TOL)
    assert not torch.allclose(cos[64:], short_cos[64:], **TABLE_TOL)
    assert cos[0, 0] > 1.0  # the attention factor sqrt(1 + ln 4 / ln 64) scales the table


def test_unknown_architecture_names_the_class_and_lists_the_supported(tmp_path: Path) -> None:
    config = tiny_config("qwen3")
    config.architectures = ["JambaForCausalLM"]
    with pytest.raises(UnsupportedModelError, match="JambaForCausalLM.*supported: .*Mixtral"):
        read_arch(config)


@pytest.mark.parametrize(
    ("kind", "change", "named"),
    [
        ("qwen3", dict(layer_types=["linear_attention"] * 6), "linear_attention"),
        (
            "qwen3",
            dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
            "'dynamic'",
        ),
        ("qwen3", dict(hidden_act="relu"), "'relu'"),
        ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        ("olmo3", dict(sliding_window=None), "sliding_window"),
        ("olmo3", dict(layer_types=["chunked_attention"] * 6), "chunked_attention"),
        (
            "olmo3",
            dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
            "rope_parameters must be keyed by layer type",
        ),
        (
            "olmo3",
            dict(
                rope_parameters={
                    "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            ),
            "'dynamic'",
        ),
        (
            "olmo3",
            dict(
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": 1e4},
                    "sliding_attention": {
                        "rope_type": "default",
                        "rope_theta": 1e4,
                        "partial_rotary_factor": 0.5,
                    },
                }
            ),
            "partial_rotary_factor",
        ),
    ],
)
def test_unimplemented_config_features_are_refused_by_name(
    kind: str, change: dict[str, object], named: str
) -> None:
    config = tiny_config(kind)
    classes = {"qwen3": "Qwen3", "gemma3": "Gemma3", "olmo3": "Olmo3"}
    config.architectures = [f"{classes[kind]}ForCausalLM"]
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(UnsupportedModelError, match=named):
        read_arch(config)


def test_family_features_are_read_from_the_config() -> None:
    gemma3 = read_arch(tiny_config("gemma3"), "Gemma3ForCausalLM")
    assert (gemma3.norm, gemma3.qk_norm, gemma3.activation) == ("gemma", "head", "gelu_tanh")
    assert len(gemma3.ropes) == 2 and gemma3.ropes[0].theta == 1e6
    assert [k.sliding_window for k in gemma3.layers] == [8, 8, None] * 2
    assert [k.rope for k in gemma3.layers] == [1, 1, 0] * 2
    assert gemma3.scale == 24**-0.5 and gemma3.head_dim == 32
    smol = read_arch(tiny_config("smollm3"), "SmolLM3ForCausalLM")
    assert [k.rope for k in smol.layers] == [0, 0, 0, None, 0, None]
    moe = read_arch(tiny_config("qwen3_moe"), "Qwen3MoeForCausalLM")
    assert moe.moe is not None and moe.moe.dense_layers == {0, 3}
    granite = read_arch(tiny_config("granite"), "GraniteForCausalLM")
    assert (granite.embed_scale, granite.scale, granite.logits_divisor) == (6.0, 0.09, 2.0)
    olmo3 = read_arch(tiny_config("olmo3"), "Olmo3ForCausalLM")
    assert (olmo3.norm, olmo3.qk_norm, olmo3.input_norms, olmo3.output_norms) == (
        "rms_f32",
        "full",
        False,
        True,
    )
    assert [k.sliding_window for k in olmo3.layers] == [8, 8, 8, None, 8, None]
    assert [olmo3.ropes[k.rope].rope_type for k in olmo3.layers if k.rope is not None] == [
        "default",
        "default",
        "default",
        "yarn",
        "default",
        "yarn",
    ]
    assert olmo3.head_dim == 32 and olmo3.scale == 32**-0.5


def test_olmo3_windows_follow_transformers_default_layer_pattern() -> None:
    """No layer_types in the config: the windows are those transformers' layers get."""
    from transformers import Olmo3Config, Olmo3ForCausalLM

    config = Olmo3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=8,
        num_attention_heads=4,
        sliding_window=16,
    )
    arch = read_arch(config, "Olmo3ForCausalLM")
    hf_layers = Olmo3ForCausalLM(config).model.layers
    assert [k.sliding_window for k in arch.layers] == [
        layer.self_attn.sliding_window for layer in hf_layers
    ]
    assert {k.sliding_window for k in arch.layers} == {16, None}
    assert arch.head_dim == hf_layers[0].self_attn.head_dim


def test_grouped_experts_equal_a_loop_over_tokens() -> None:
    torch.manual_seed(0)
    experts, hidden, inter, tokens = 6, 16, 24, 11
    w = MoeWeights(
        router=torch.randn(experts, hidden),
        gate_up=torch.randn(experts, 2 * inter, hidden) * 0.2,
        down=torch.randn(experts, hidden, inter) * 0.2,
    )
    spec = MoeSpec(num_experts=experts, top_k=2, intermediate_size=inter, norm_topk_prob=True)
    x = torch.randn(tokens, hidden)
    out = moe_mlp(x, w, spec, "silu")
    expected = torch.zeros_like(x)
    for t in range(tokens):
        probs = torch.softmax(w.router @ x[t], dim=-1)
        top, ids = probs.topk(2)
        for p, e in zip(top / top.sum(), ids.tolist(), strict=True):
            gate, up = (w.gate_up[e] @ x[t]).chunk(2)
            expected[t] += p * (w.down[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # The path CUDA graphs capture (no host sync) gives the same sums.
    torch.testing.assert_close(every_expert_mlp(x, w, spec, "silu"), out, rtol=1e-6, atol=1e-6)


def test_dense_families_take_the_native_decode_step(tmp_path: Path) -> None:
    # Qwen3's q/k norms and windows once kept it on the per-layer path; the step runs them.
    worker = make_worker(save_tiny_model("qwen3", tmp_path / "q3"), attention_backend="cpu")
    assert worker.model.native_decode is not None
    assert worker.model.native_decode_refused is None


def test_qwen2_biases_are_nonzero_and_used(tiny_model_dir: dict[str, Path]) -> None:
    model = make_worker(tiny_model_dir["qwen2"], linear_impl="torch").model
    bias = model.layers[0].qkv_bias
    assert bias is not None and bool((bias != 0).all())


def test_multimodal_gemma3_serves_its_text_model(tmp_path: Path) -> None:
    worker = make_worker(save_tiny_model("gemma3_mm", tmp_path / "mm"), linear_impl="torch")
    info = worker.model_info
    assert info.architecture == "Gemma3ForConditionalGeneration"
    assert worker.model.arch.num_layers == 6 and worker.model.arch.qk_norm == "head"


@pytest.mark.parametrize("linear_impl", ["onednn", "native"])
@pytest.mark.parametrize("kind", ["gemma2", "phi3", "qwen3_moe", "granite", "gemma4_mm"])
def test_families_with_every_matmul_implementation(
    kind: str, linear_impl: str, tmp_path: Path
) -> None:
    from tests.support.models import load_hf

    from .factories import GreedyDriver, hf_greedy

    path = save_tiny_model(kind, tmp_path / kind)
    hf = load_hf(path)
    worker = make_worker(path, attention_backend="cpu", linear_impl=linear_impl)
    assert worker.model_info.linear_impl == linear_impl
    prompts = {0: [3, 14, 15, 92, 65, 35, 89, 79, 32, 38], 1: [2, 71, 82]}
    outputs = GreedyDriver(worker).run_greedy(prompts, max_new_tokens=12)
    for seq_id, prompt in prompts.items():
        assert outputs[seq_id] == hf_greedy(hf, prompt, 12), (kind, seq_id)
