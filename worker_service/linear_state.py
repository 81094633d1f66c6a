"""The per-step inputs of recurrent (linear-attention) layers: which state slot each sequence
of the step reads and writes (DESIGN.md, section 13).

A Gated DeltaNet layer (Qwen3.5, Qwen3-Next) keeps no K/V per token; each sequence has one
state slot, chosen by the scheduler, in two pools per layer:
- the conv state `[num_slots, conv_kernel - 1, conv_dim]` in the model dtype (the last inputs
  of the short causal convolution, `kernels.causal_conv1d`);
- the recurrent state `[num_slots, num_v_heads, k_dim, v_dim]` in float32 (the delta rule's
  matrices, `kernels.gated_delta_rule`; transformers keeps them in float32 too).
`DecoderModel.forward` takes a layer's pair in place of its (key, value) caches.

The step's tokens are laid out as for attention: the sequences that compute several tokens
first (`num_prefills`), then the decode rows of one token each. Every sequence's tokens are
contiguous; `query_start_loc` bounds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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

    @property
    def num_seqs(self) -> int:
        return self.num_prefills + self.num_decodes


@dataclass(frozen=True, slots=True)
class StateShapes:
    """One slot's tensors in one recurrent layer."""

    conv: tuple[int, int]  # [conv_kernel - 1, conv_dim], the model dtype
    recurrent: tuple[int, int, int]  # [num_v_heads, k_dim, v_dim], float32

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
