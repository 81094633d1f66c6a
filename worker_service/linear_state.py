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

from dataclasses import dataclass

import torch


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
