"""The per-step inputs of recurrent (linear-attention) layers: which state slot each sequence
of the step reads and writes (DESIGN.md, section 13).

A Gated DeltaNet layer (Qwen3.5, Qwen3-Next) keeps no K/V per token; each sequence has one
state slot, chosen by the scheduler, in two pools per layer:
- the conv state `[num_slots, conv_kernel - 1, conv_dim]` in the model dtype (the last inputs
  of the short causal convolution, `llmserve_kernels.causal_conv1d`);
- the recurrent state `[num_slots, num_v_heads, k_dim, v_dim]` in float32 (the delta rule's
  matrices, `llmserve_kernels.gated_delta_rule`; transformers keeps them in float32 too).
`DecoderModel.forward` takes a layer's pair in place of its (key, value) caches.

The step's tokens are laid out as for attention: the sequences that compute several tokens
first (`num_prefills`), then the decode rows of one token each. Every sequence's tokens are
contiguous; `query_start_loc` bounds them. A sequence with drafts (speculative decoding) has
a decode row for its known token and one for each draft, all on its slot: `DraftRows` runs
them one after another and keeps the state after each, so that the state after the last kept
token can be put back once the sampler has settled the drafts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from worker_service.models.arch import ModelArchConfig

# The recurrent state's dtype, whatever the model's.
RECURRENT_DTYPE = torch.float32


@dataclass(slots=True)
class StateMetadata:
    """Per-step inputs shared by every recurrent layer, built once per step by the model
    runner. Tensors live on the model's device."""

    num_prefills: int  # sequences computing more than one token, first in the step
    num_decodes: int  # then sequences computing exactly one token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative token counts
    state_slots: torch.Tensor  # [num_seqs] int32: the slot each sequence reads and writes
    # [num_seqs] bool: False for a sequence computing its first tokens (its slot holds
    # another's leftovers and is read as zeros).
    has_initial_state: torch.Tensor
    # The decode rows of sequences with drafts, in waves (None: every decode row is a
    # sequence of its own).
    draft_rows: DraftRows | None = None

    @property
    def num_seqs(self) -> int:
        return self.num_prefills + self.num_decodes


@dataclass(slots=True)
class DraftRows:
    """The decode rows of a step where some sequences verify drafts. A sequence's rows compute
    its known token, then each draft, from one state, so they run in waves: wave j computes
    every sequence's j-th row. After each wave but the last, the recurrent layers keep the
    state of every sequence that has a row in the next wave (`keep`); once the sampler has
    kept the first `kept` drafts of a sequence, `restore` puts back the state after its
    `kept`-th wave (all kept: its slot already holds the state after its last row)."""

    waves: list[torch.Tensor]  # per wave: [rows] int64, indices among the step's decode rows
    kept_slots: list[list[int]]  # per wave but the last: the slots whose state after it is kept
    # Per recurrent layer: its (conv, recurrent) pools and, per wave, the kept states.
    kept: dict[int, tuple[tuple[torch.Tensor, torch.Tensor], list[tuple[torch.Tensor, ...]]]] = (
        field(default_factory=dict)
    )

    @classmethod
    def build(cls, rows: list[tuple[int, int]], device: torch.device) -> DraftRows | None:
        """From each decode row's (state slot, index among its sequence's rows); None when
        every sequence has one row."""
        num_waves = 1 + max((j for _, j in rows), default=0)
        if num_waves == 1:
            return None
        waves = [[i for i, (_, j) in enumerate(rows) if j == wave] for wave in range(num_waves)]
        kept_slots = [[slot for slot, j in rows if j == wave + 1] for wave in range(num_waves - 1)]
        return cls([torch.tensor(w, dtype=torch.int64, device=device) for w in waves], kept_slots)

    def keep(self, layer: int, wave: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """After `wave` of `layer`: copy the states the next wave's sequences may go back to."""
        pools, states = self.kept.setdefault(layer, ((conv, recurrent), []))
        if wave < len(self.kept_slots):
            index = torch.tensor(self.kept_slots[wave], dtype=torch.int64, device=conv.device)
            states.append((conv[index], recurrent[index]))  # indexing copies

    def restore(self, slot: int, kept: int) -> None:
        """Put the state after wave `kept` back into `slot` in every recurrent layer (its
        sequence kept `kept` drafts, fewer than it had)."""
        row = self.kept_slots[kept].index(slot)
        for (conv, recurrent), states in self.kept.values():
            conv[slot], recurrent[slot] = states[kept][0][row], states[kept][1][row]


@dataclass(frozen=True, slots=True)
class StateShapes:
    """One slot's tensors in one recurrent layer."""

    conv: tuple[int, int]  # [conv_kernel - 1, conv_dim], the model dtype
    recurrent: tuple[int, int, int]  # [num_v_heads, k_dim, v_dim], float32

    @staticmethod
    def of(arch: ModelArchConfig) -> StateShapes | None:
        """One state slot's tensors in each recurrent layer of `arch` (None: it has none)."""
        spec = arch.linear_attention
        if spec is None:
            return None
        return StateShapes(spec.conv_state_shape(), spec.recurrent_state_shape())

    def slot_bytes(self, num_layers: int, dtype: torch.dtype) -> int:
        """Bytes one slot takes over `num_layers` recurrent layers."""
        conv = math.prod(self.conv) * _element_size(dtype)
        recurrent = math.prod(self.recurrent) * _element_size(RECURRENT_DTYPE)
        return num_layers * (conv + recurrent)


class StatePools:
    """The state slots of one worker: per kind, one allocation over every recurrent layer
    (`[num_layers, num_slots, ...]`), so that copying a slot (a fork) is one indexed copy
    per kind whatever the layer count. Zeroed: a fresh sequence reads its slot as zeros
    anyway, and the kernels never see non-finite leftovers."""

    def __init__(
        self,
        layers: tuple[int, ...],  # the recurrent layers, ascending
        shapes: StateShapes,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layers = layers
        self.num_slots = num_slots
        # [num_layers, num_slots, conv_kernel - 1, conv_dim]
        self.conv = torch.zeros((len(layers), num_slots, *shapes.conv), dtype=dtype, device=device)
        # [num_layers, num_slots, num_v_heads, k_dim, v_dim]
        self.recurrent = torch.zeros(
            (len(layers), num_slots, *shapes.recurrent), dtype=RECURRENT_DTYPE, device=device
        )
        # Swap space: as many host slots, written by swap_out before any swap_in reads them.
        pinned = device.type == "cuda"
        self.host_conv = torch.empty(self.conv.shape, dtype=dtype, pin_memory=pinned)
        self.host_recurrent = torch.empty(
            self.recurrent.shape, dtype=RECURRENT_DTYPE, pin_memory=pinned
        )

    def layer_pools(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Layer -> its (conv, recurrent) pools, views of the allocations."""
        return {layer: (self.conv[j], self.recurrent[j]) for j, layer in enumerate(self.layers)}

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device slots to host slots, (device, host) pairs, every recurrent layer."""
        if pairs:
            src, dst = _split(pairs)
            self.host_conv[:, dst] = self.conv[:, src.to(self.conv.device)].cpu()
            self.host_recurrent[:, dst] = self.recurrent[:, src.to(self.conv.device)].cpu()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host slots to device slots, (host, device) pairs, every recurrent layer."""
        if pairs:
            src, dst = _split(pairs)
            dst = dst.to(self.conv.device)
            self.conv[:, dst] = self.host_conv[:, src].to(self.conv.device)
            self.recurrent[:, dst] = self.host_recurrent[:, src].to(self.conv.device)

    def slot_bytes(self) -> int:
        """Bytes of one slot over every recurrent layer (as `read_slot` returns them)."""
        conv, recurrent = self.conv[:, 0], self.recurrent[:, 0]
        return conv.numel() * conv.element_size() + recurrent.numel() * recurrent.element_size()

    def read_slot(self, slot: int) -> bytes:
        """One slot's states as bytes: every layer's conv state, then every recurrent one."""
        parts = (self.conv[:, slot].contiguous().cpu(), self.recurrent[:, slot].contiguous().cpu())
        return b"".join(t.view(torch.uint8).numpy().tobytes() for t in parts)

    def write_slot(self, slot: int, data: bytes | bytearray | memoryview) -> None:
        """Store states laid out as `read_slot` returns them into `slot`."""
        if len(data) != self.slot_bytes():
            raise ValueError(f"a state slot holds {self.slot_bytes()} bytes, got {len(data)}")
        conv = self.conv[:, slot]
        split = conv.numel() * conv.element_size()
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        conv.copy_(raw[:split].view(conv.dtype).view(conv.shape))
        recurrent = self.recurrent[:, slot]
        recurrent.copy_(raw[split:].view(recurrent.dtype).view(recurrent.shape))

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy slots, (source, destination) pairs, in every recurrent layer."""
        if pairs:
            src, dst = (t.to(self.conv.device) for t in _split(pairs))
            self.conv[:, dst] = self.conv[:, src]
            self.recurrent[:, dst] = self.recurrent[:, src]


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _split(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.tensor(pairs, dtype=torch.int64)  # [num_pairs, 2]
    return index[:, 0], index[:, 1]
