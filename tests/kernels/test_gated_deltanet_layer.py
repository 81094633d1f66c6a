"""A whole Gated DeltaNet layer of transformers' Qwen3.5 against the ops composed as a serving
engine runs them: a prompt in two prefill chunks, then decode tokens, the states carried in
pool slots between calls. The projections and the gated norm are the layer's own modules."""

from __future__ import annotations

import pytest
import torch

from llmserve_kernels.causal_conv1d import causal_conv1d, causal_conv1d_update
from llmserve_kernels.gated_delta_rule import (
    gated_delta_gates,
    gated_delta_rule_chunked,
    gated_delta_rule_decode,
)
from tests.kernels.linear_state import offsets, slots

NUM_K_HEADS, NUM_V_HEADS, K_DIM, V_DIM, KERNEL = 2, 4, 16, 8, 4


def make_layer(seed: int) -> torch.nn.Module:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(
        hidden_size=32,
        linear_num_key_heads=NUM_K_HEADS,
        linear_num_value_heads=NUM_V_HEADS,
        linear_key_head_dim=K_DIM,
        linear_value_head_dim=V_DIM,
        linear_conv_kernel_dim=KERNEL,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=16,
        vocab_size=16,
    )
    torch.manual_seed(seed)
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():  # trained-looking biases and norm weights instead of ones
        layer.dt_bias.normal_()
        layer.norm.weight.uniform_(0.5, 1.5)
    return layer.eval()


class ServedLayer:
    """The layer's mixing part on the ops, one sequence in pool slot `slot`."""

    def __init__(self, layer: torch.nn.Module, slot: int, num_slots: int) -> None:
        self.layer = layer
        self.slot = slots([slot])
        conv_dim = 2 * NUM_K_HEADS * K_DIM + NUM_V_HEADS * V_DIM
        self.conv_state = torch.full((num_slots, KERNEL - 1, conv_dim), float("nan"))
        self.state = torch.full((num_slots, NUM_V_HEADS, K_DIM, V_DIM), float("nan"))
        self.started = False

    def prefill(self, hidden: torch.Tensor) -> torch.Tensor:  # [len, hidden] -> same
        mixed, z, a, b = self._project(hidden)
        where = offsets([hidden.shape[0]])
        initial = torch.tensor([self.started])
        weight = self.layer.conv1d.weight[:, 0]
        mixed = causal_conv1d(mixed, self.conv_state, weight, None, where, self.slot, initial)
        q, k, v = self._split(mixed)
        g, beta = gated_delta_gates(a, b, self.layer.A_log, self.layer.dt_bias)
        core = gated_delta_rule_chunked(
            q, k, v, g, beta, self.state, where, self.slot, initial, chunk_size=8
        )
        self.started = True
        return self._finish(core, z)

    def decode(self, hidden: torch.Tensor) -> torch.Tensor:  # [1, hidden] -> same
        mixed, z, a, b = self._project(hidden)
        weight = self.layer.conv1d.weight[:, 0]
        mixed = causal_conv1d_update(mixed, self.conv_state, weight, None, self.slot)
        q, k, v = self._split(mixed)
        g, beta = gated_delta_gates(a, b, self.layer.A_log, self.layer.dt_bias)
        core = gated_delta_rule_decode(q, k, v, g, beta, self.state, self.slot)
        return self._finish(core, z)

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        layer = self.layer
        return (
            layer.in_proj_qkv(hidden),
            layer.in_proj_z(hidden),
            layer.in_proj_a(hidden),
            layer.in_proj_b(hidden),
        )

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        key_width = NUM_K_HEADS * K_DIM
        q, k, v = mixed.split([key_width, key_width, NUM_V_HEADS * V_DIM], dim=-1)
        n = mixed.shape[0]
        return q.view(n, NUM_K_HEADS, K_DIM), k.view(n, NUM_K_HEADS, K_DIM), v.view(n, -1, V_DIM)

    def _finish(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = self.layer.norm(core.reshape(-1, V_DIM), z.reshape(-1, V_DIM))
        return self.layer.out_proj(normed.reshape(core.shape[0], -1))


@pytest.mark.parametrize(("first_chunk", "prompt", "total"), [(5, 11, 14), (16, 30, 33), (1, 2, 6)])
@torch.no_grad()
def test_layer_in_chunks_and_decode_steps_matches_transformers(
    first_chunk: int, prompt: int, total: int
) -> None:
    layer = make_layer(seed=prompt)
    hidden = torch.randn(1, total, 32, generator=torch.Generator().manual_seed(total))
    expected = layer(hidden)[0]  # the whole sequence at once, no cache
    served = ServedLayer(layer, slot=2, num_slots=3)
    outs = [served.prefill(hidden[0, :first_chunk]), served.prefill(hidden[0, first_chunk:prompt])]
    outs += [served.decode(hidden[0, t : t + 1]) for t in range(prompt, total)]
    torch.testing.assert_close(torch.cat(outs), expected, atol=2e-5, rtol=2e-5)
