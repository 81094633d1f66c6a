"""Token masks (structured output) on the wire: in a step, or in the message that carries a
step's deferred masks after it (`ExecuteRequest.step_masks`)."""

from __future__ import annotations

from typing import Any

from llmserve.steps import MaskKind, TokenMask
from llmserve.v1 import worker_pb2


def add_masks(field: Any, masks: list[TokenMask]) -> None:
    for m in masks:
        field.add(
            seq_id=m.seq_id,
            kind=int(m.kind),
            vocab_size=m.vocab_size,
            token_ids=m.token_ids,
            bitmap=m.bitmap,
            row=m.row,
        )


def step_masks_to_proto(step_id: int, masks: list[TokenMask]) -> worker_pb2.ExecuteRequest:
    """The message that carries a step's deferred masks on the Execute stream."""
    msg = worker_pb2.ExecuteRequest()
    msg.step_masks.step_id = step_id
    add_masks(msg.step_masks.token_masks, masks)
    return msg


def step_masks_from_proto(msg: worker_pb2.StepMasks) -> tuple[int, list[TokenMask]]:
    """(step id, masks). Raises ValueError for a mask of unknown kind."""
    return msg.step_id, [token_mask_from_proto(m) for m in msg.token_masks]


def token_mask_from_proto(msg: worker_pb2.TokenMask) -> TokenMask:
    try:
        kind = MaskKind(msg.kind)
    except ValueError:
        raise ValueError(f"token mask of seq {msg.seq_id}: unknown kind {msg.kind}") from None
    return TokenMask(msg.seq_id, kind, msg.vocab_size, list(msg.token_ids), msg.bitmap, msg.row)
