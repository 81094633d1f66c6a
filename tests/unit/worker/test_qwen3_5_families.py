"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next (hybrids of Gated DeltaNet and gated attention layers):
`DecoderModel.forward` over hand-built paged K/V caches and state pools against transformers'
greedy generation, and what their configs declare or are refused for."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from tests.support.models import HYBRID_KINDS, load_hf, save_tiny_model, tiny_config
from worker_service.attention.base import AttentionMetadata
from worker_service.attention.torch_backend import TorchAttentionBackend
from worker_service.linear_state import StateMetadata
from worker_service.models import UnsupportedModelError, model_from_hf, read_arch
from worker_service.models.decoder import DecoderModel
from worker_service.models.held_weights import weight_bytes

from .factories import hf_greedy

BLOCK_SIZE = 4
BLOCKS_PER_SEQ = 8  # each sequence's own contiguous blocks: 32 tokens
NUM_SLOTS = 4
NEW_TOKENS = 6
# A prompt in two chunks, a prompt in two chunks started while the first decodes, and a
# one-token prompt, whose first step is a decode row of a sequence with no state yet.
PROMPTS = ([3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [2, 71, 82, 18, 28, 44, 5], [77])
FIRST_CHUNKS = (5, 4)  # the first two prompts' first chunks
SLOTS = (2, 0, 3)  # a slot per sequence, not in sequence order
# Options of `model_from_hf`: plain torch; the native CPU ops (the fused elementwise ops, and
# the state kernels on prefill and decode rows); every matmul on prepacked oneDNN weights, or
# on the native matmul kernel.
PATHS = {
    "torch": {},
    "native_states": {"fused_ops": True},
    "onednn": {"packed_linear": True},
    "native_linear": {"native_linear": True},
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrids")
    return {kind: save_tiny_model(kind, root / kind) for kind in HYBRID_KINDS}


@pytest.fixture(scope="module")
def hf_models(saved: dict[str, Path]) -> dict[str, Any]:
    """Each kind as the worker loads it (transformers' causal-LM auto class)."""
    torch.set_num_threads(1)
    return {kind: load_hf(path) for kind, path in saved.items()}


@pytest.fixture(scope="module")
def expected(hf_models: dict[str, Any]) -> dict[str, list[list[int]]]:
    """transformers' greedy output of each prompt alone."""
    return {
        kind: [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in PROMPTS]
        for kind, hf in hf_models.items()
    }


@dataclass
class Seq:
    """One sequence of the hand-driven engine: its own blocks and state slot."""

    tokens: list[int]
    slot: int
    first_block: int
    computed: int = 0
    out: list[int] = field(default_factory=list)

    @property
    def block_table(self) -> list[int]:
        return list(range(self.first_block, self.first_block + BLOCKS_PER_SEQ))


class Engine:
    """Caches laid out as the worker lays them out (K/V per attention layer, two state pools
    per linear-attention layer: the conv state's in the model dtype, the recurrent state's in
    float32), and steps built by hand, prefill rows first."""

    def __init__(self, model: DecoderModel) -> None:
        self.model = model
        arch = model.arch
        spec = arch.linear_attention
        assert spec is not None
        num_blocks = BLOCKS_PER_SEQ * len(PROMPTS)
        kv_shape = (num_blocks, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for kind in arch.layers:
            if kind.linear:  # leftovers of other sequences: what no fresh sequence may read
                conv_shape = (NUM_SLOTS, *spec.conv_state_shape())
                conv = torch.full(conv_shape, float("nan"), dtype=model.dtype)
                state = torch.full((NUM_SLOTS, *spec.recurrent_state_shape()), float("nan"))
                self.caches.append((conv, state))
            else:
                kv = (torch.zeros(kv_shape, dtype=model.dtype) for _ in range(2))
                self.caches.append((next(kv), next(kv)))
        self.backend = TorchAttentionBackend(
            arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.scale
        )

    def step(self, rows: list[tuple[Seq, int]]) -> None:
        """Compute `rows` (a sequence and its number of new tokens; several-token rows
        first); a sequence whose row reaches its last token samples its next greedily."""
        logits = self.forward(rows)
        for (seq, n), row in zip(rows, logits, strict=True):
            seq.computed += n
            if seq.computed == len(seq.tokens):
                token = int(row.argmax())
                seq.tokens.append(token)
                seq.out.append(token)

    def forward(
        self, rows: list[tuple[Seq, int]], every_token: bool = False
    ) -> torch.Tensor:  # [len(rows) (every_token: tokens), vocab]
        """The logits of each row's last token (or of every token) of one step over `rows`;
        the sequences' computed counts stay as they were."""
        prefills = [(s, n) for s, n in rows if n > 1]
        decodes = [(s, n) for s, n in rows if n == 1]
        assert rows == prefills + decodes
        ids, positions, slots, starts, logit_rows = [], [], [], [0], []
        for seq, n in rows:
            span = range(seq.computed, seq.computed + n)
            ids += [seq.tokens[p] for p in span]
            positions += list(span)
            slots += [seq.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in span]
            logit_rows += list(range(starts[-1], starts[-1] + n)) if every_token else []
            starts.append(starts[-1] + n)
            logit_rows += [] if every_token else [starts[-1] - 1]
        return self.model.forward(
            torch.tensor(ids),
            torch.tensor(positions),
            self.caches,
            _attention_metadata(prefills, decodes, slots, starts),
            self.backend,
            torch.tensor(logit_rows),
            state_metadata=StateMetadata(
                num_prefills=len(prefills),
                num_decodes=len(decodes),
                query_start_loc=_i32(starts),
                state_slots=_i32([seq.slot for seq, _ in rows]),
                has_initial_state=torch.tensor([seq.computed > 0 for seq, _ in rows]),
            ),
        )


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _attention_metadata(
    prefills: list[tuple[Seq, int]],
    decodes: list[tuple[Seq, int]],
    slots: list[int],
    starts: list[int],
) -> AttentionMetadata:
    def tables(rows: list[tuple[Seq, int]]) -> torch.Tensor:  # [len(rows), BLOCKS_PER_SEQ]
        return _i32([seq.block_table for seq, _ in rows]).view(len(rows), BLOCKS_PER_SEQ)

    prefill_seq_lens = [s.computed + n for s, n in prefills]
    decode_seq_lens = [s.computed + 1 for s, _ in decodes]
    return AttentionMetadata(
        num_prefills=len(prefills),
        num_prefill_tokens=starts[len(prefills)],
        num_decodes=len(decodes),
        slot_mapping=torch.tensor(slots),
        prefill_query_start_loc=_i32(starts[: len(prefills) + 1]),
        prefill_query_lens=_i32([n for _, n in prefills]),
        prefill_context_lens=_i32([s.computed for s, _ in prefills]),
        prefill_seq_lens=_i32(prefill_seq_lens),
        prefill_block_tables=tables(prefills),
        max_prefill_query_len=max((n for _, n in prefills), default=0),
        max_prefill_seq_len=max(prefill_seq_lens, default=0),
        prefill_no_context=all(s.computed == 0 for s, _ in prefills),
        decode_seq_lens=_i32(decode_seq_lens),
        decode_block_tables=tables(decodes),
        max_decode_seq_len=max(decode_seq_lens, default=0),
        block_size=BLOCK_SIZE,
    )


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("kind", HYBRID_KINDS)
@torch.no_grad()
def test_chunked_prefills_beside_decodes_match_transformers_greedy(
    kind: str, path: str, hf_models: dict[str, Any], expected: dict[str, list[list[int]]]
) -> None:
    model = model_from_hf(hf_models[kind], max_positions=64, **PATHS[path])
    engine = Engine(model)
    a, b, c = (
        Seq(list(prompt), slot, i * BLOCKS_PER_SEQ)
        for i, (prompt, slot) in enumerate(zip(PROMPTS, SLOTS, strict=True))
    )
    first_a, first_b = FIRST_CHUNKS
    engine.step([(a, first_a)])  # a fresh sequence's first chunk
    engine.step([(a, len(PROMPTS[0]) - first_a)])  # its second, from its state
    engine.step([(b, first_b), (a, 1)])  # one prefills while the other decodes
    engine.step([(b, len(PROMPTS[1]) - first_b), (a, 1), (c, 1)])  # c: a fresh decode row
    while any(len(seq.out) < NEW_TOKENS for seq in (a, b, c)):
        engine.step([(seq, 1) for seq in (a, b, c) if len(seq.out) < NEW_TOKENS])
    assert [a.out, b.out, c.out] == expected[kind]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@torch.no_grad()
def test_bfloat16_rounds_where_transformers_does(kind: str, saved: dict[str, Path]) -> None:
    """The first position's logits in bfloat16, on the prefill and the decode path: the
    mixer rounds the convolution's output and the step beta to the model dtype as
    transformers does (rounding them anywhere else moves these logits past the tolerance)."""
    hf = load_hf(saved[kind]).to(torch.bfloat16)
    prompt = PROMPTS[0]
    expected = hf(torch.tensor([prompt])).logits[0, 0].float()
    engine = Engine(model_from_hf(hf, max_positions=64))
    prefill = engine.forward([(Seq(list(prompt), 0, 0), len(prompt))], every_token=True)[0]
    decode = engine.forward([(Seq(prompt[:1], 1, BLOCKS_PER_SEQ), 1)])[0]
    for logits in (prefill, decode):
        torch.testing.assert_close(logits.float(), expected, rtol=0, atol=0.02)


def test_hybrid_features_are_read_from_the_config() -> None:
    arch = read_arch(tiny_config("qwen3_5"), "Qwen3_5ForCausalLM")
    assert arch.linear_layers == (0, 1, 2, 4, 5, 6)
    assert [k.linear for k in arch.layers] == [True, True, True, False] * 2
    assert (arch.norm, arch.qk_norm, arch.attention_output_gate) == ("gemma", "head", True)
    assert arch.rope.rotary_dim == 8  # a quarter of head_dim 32
    spec = arch.linear_attention
    assert spec is not None and spec.conv_dim == 2 * 2 * 16 + 4 * 16
    assert spec.conv_state_shape() == (3, 128) and spec.recurrent_state_shape() == (4, 16, 16)
    assert {"linear-attention layers", "attention output gate"} <= set(arch.native_blockers())
    moe = read_arch(tiny_config("qwen3_5_moe"), "Qwen3_5MoeForCausalLM").moe
    assert moe is not None and (moe.dense_layers, moe.shared_expert_size) == (frozenset(), 64)
    assert moe.norm_topk_prob
    nxt = read_arch(tiny_config("qwen3_next"), "Qwen3NextForCausalLM").moe
    assert nxt is not None and nxt.dense_layers == {0, 3}


@torch.no_grad()
def test_a_conditional_generation_checkpoint_reads_as_its_text_model(
    saved: dict[str, Path], hf_models: dict[str, Any]
) -> None:
    from transformers import Qwen3_5ForConditionalGeneration

    config = AutoConfig.from_pretrained(saved["qwen3_5_mm"])
    assert config.architectures == ["Qwen3_5ForConditionalGeneration"]
    loaded = hf_models["qwen3_5_mm"]  # the auto class loads the text model alone
    assert type(loaded).__name__ == "Qwen3_5ForCausalLM"
    text_arch = read_arch(loaded.config, type(loaded).__name__)
    assert read_arch(config) == replace(text_arch, architecture=config.architectures[0])
    # The whole multimodal model gives the decoder the same text weights.
    whole = Qwen3_5ForConditionalGeneration.from_pretrained(saved["qwen3_5_mm"]).eval()
    prompt = PROMPTS[0]
    logits = [
        Engine(model_from_hf(hf, max_positions=64)).forward([(Seq(prompt, 0, 0), len(prompt))])
        for hf in (loaded, whole)
    ]
    assert torch.equal(*logits)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_weight_bytes_are_the_checkpoints(kind: str, hf_models: dict[str, Any]) -> None:
    """The mixer's weights, the shared experts and the reordered projections are counted,
    each byte once."""
    hf = hf_models[kind]
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in hf.parameters()
    }
    assert weight_bytes(model_from_hf(hf, max_positions=64)) == sum(storages.values())


@pytest.mark.parametrize(
    ("kind", "change", "named"),
    [
        ("qwen3_5", dict(layer_types=["mamba"] + ["linear_attention"] * 7), "'mamba'"),
        ("qwen3_next", dict(layer_types=["sliding_attention"] * 8), "'sliding_attention'"),
        ("qwen3_5", dict(linear_num_value_heads=3), "linear_num_value_heads 3"),
        ("qwen3_5_moe", dict(hidden_act="gelu_pytorch_tanh"), "'gelu_pytorch_tanh'"),
    ],
)
def test_unimplemented_layer_types_and_state_layouts_are_refused_by_name(
    kind: str, change: dict[str, object], named: str
) -> None:
    config = tiny_config(kind)
    classes = {
        "qwen3_5": "Qwen3_5ForCausalLM",
        "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
        "qwen3_next": "Qwen3NextForCausalLM",
    }
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(UnsupportedModelError, match=named):
        read_arch(config, classes[kind])


def test_forward_without_state_metadata_is_refused(hf_models: dict[str, Any]) -> None:
    model = model_from_hf(hf_models["qwen3_5"], max_positions=64)
    engine = Engine(model)
    with pytest.raises(ValueError, match="state_metadata"):
        model.forward(
            torch.tensor([5]),
            torch.tensor([0]),
            engine.caches,
            AttentionMetadata.for_decodes(torch.tensor([0]), _i32([1]), _i32([[0]]), 1, BLOCK_SIZE),
            engine.backend,
            torch.tensor([0]),
        )


def test_multi_token_prediction_layers_are_logged_as_not_loaded() -> None:
    from structlog.testing import capture_logs
    from transformers import Qwen3_5ForCausalLM

    hf = Qwen3_5ForCausalLM(tiny_config("qwen3_5", mtp_num_hidden_layers=1)).eval()
    with capture_logs() as logs:
        model_from_hf(hf, max_positions=64)
    assert [e["mtp_layers"] for e in logs if "mtp_layers" in e] == [1]
