"""Gemma 4 (models/gemma4.py): what is read from the config, the proportional rotary table
against transformers, the features refused by name, and the worker's KV layout for the
layers that store no K/V."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tests.support.models import save_tiny_model, tiny_config
from worker_service.models import UnsupportedModelError, read_arch
from worker_service.models.rope import inverse_frequencies

from .factories import make_worker

CAUSAL = "Gemma4ForCausalLM"


def test_features_are_read_from_the_config() -> None:
    arch = read_arch(tiny_config("gemma4"), CAUSAL)
    # layer_types: sliding, sliding, full, twice; the last two read layers 3 and 2.
    assert [k.kv_source for k in arch.layers] == [None] * 4 + [3, 2]
    assert [k.sliding_window for k in arch.layers] == [8, 8, None] * 2
    assert arch.kv_sources == {4: 3, 5: 2}
    assert (arch.norm, arch.qk_norm, arch.activation) == ("rms_f32", "head", "gelu_tanh")
    assert (arch.scale, arch.final_softcap, arch.embed_scale) == (1.0, 30.0, 64**0.5)
    assert arch.value_norm and arch.layer_scalars and arch.per_layer_input_size == 8
    assert arch.moe is None
    full = arch.ropes[arch.layers[2].rope]  # type: ignore[index]
    assert (full.rope_type, full.rotary_dim, full.theta) == ("proportional", 64, 1e6)
    # The global layers' heads are twice as wide; the shared layer 5 reads layer 2's.
    assert [arch.kv_shape(i) for i in range(6)] == [(2, 32), (2, 32), (2, 64)] * 2
    assert arch.layer_head_dim(5) == 64 and not arch.uniform_attention
    text = tiny_config("gemma4_mm").text_config
    text.architectures = None
    moe_arch = read_arch(text, CAUSAL)
    assert moe_arch.kv_shape(1) == (1, 64) and moe_arch.kv_shape(0) == (2, 32)
    moe = moe_arch.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.intermediate_size) == (4, 2, 48)
    assert moe.routing == "scaled_softmax_topk" and moe.beside_dense and moe.norm_topk_prob


def test_proportional_frequencies_equal_transformers() -> None:
    """A quarter of the head's pairs turn, at full rotary's rates over the whole head; the
    others stay still (frequency 0)."""
    config = tiny_config("gemma4")
    params = config.rope_parameters["full_attention"]
    ours = inverse_frequencies(64, 1e6, params)
    theirs, factor = ROPE_INIT_FUNCTIONS["proportional"](config, None, layer_type="full_attention")
    assert factor == 1.0
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert ours[:8].gt(0).all() and ours[8:].eq(0).all()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            dict(per_layer_config={2: {"head_dim": 64}}),
            r"per_layer_config: full_attention layers of different shapes \(2 kv heads x "
            r"head_dim 32, 2 kv heads x head_dim 64\)",
        ),
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
        (dict(vocab_size_per_layer_input=64), "vocab_size_per_layer_input 64"),
        (dict(num_kv_shared_layers=6), "num_kv_shared_layers 6"),
    ],
)
def test_unimplemented_config_features_are_refused_by_name(
    change: dict[str, object], named: str
) -> None:
    with pytest.raises(UnsupportedModelError, match=named):
        read_arch(tiny_config("gemma4", **change), CAUSAL)


def test_kv_shared_layers_store_nothing(tmp_path: Path) -> None:
    """The layout holds blocks for the four layers that store K/V: the full layer 2, twice as
    wide (two slots), and the sliding layers 0, 1, 3 (one slot each, in groups that fill two);
    layers 4 and 5 read the slots of 3 and 2."""
    worker = make_worker(save_tiny_model("gemma4", tmp_path / "gemma4"), attention_backend="torch")
    layout = worker.model_info.kv_layout
    assert (layout.unit, layout.slots) == (64, 2)
    assert [(g.sliding_window, g.layers, g.units) for g in layout.groups] == [
        (None, (2,), 2),
        (8, (0, 1), 1),
        (8, (3,), 1),
    ]
    assert layout.shared == ((4, 3), (5, 2))
    assert worker.model.layer_groups == (1, 1, 0, 2, 2, 0)
    caches = worker.cache_engine.layer_caches()
    assert caches[4][0].data_ptr() == caches[3][0].data_ptr()
    assert caches[5][1].data_ptr() == caches[2][1].data_ptr()
