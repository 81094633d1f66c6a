"""StatePools (worker_service.linear_state): one slot's states as bytes for a KV transfer, and
back into another slot, bit-exactly and in every recurrent layer."""

from __future__ import annotations

import pytest
import torch

from worker_service.linear_state import StatePools, StateShapes


def _pools() -> StatePools:
    return StatePools(
        (0, 2, 3), StateShapes((3, 6), (2, 4, 5)), 4, torch.bfloat16, torch.device("cpu")
    )


def test_a_slot_read_as_bytes_writes_back_into_another_slot() -> None:
    source, target = _pools(), _pools()
    torch.manual_seed(0)
    source.conv.copy_(torch.randn(source.conv.shape))
    source.recurrent.copy_(torch.randn(source.recurrent.shape))
    data = source.read_slot(2)
    assert len(data) == source.slot_bytes() == 3 * (3 * 6 * 2 + 2 * 4 * 5 * 4)
    target.write_slot(1, data)
    assert torch.equal(target.conv[:, 1], source.conv[:, 2])
    assert torch.equal(target.recurrent[:, 1], source.recurrent[:, 2])
    assert not target.conv[:, [0, 2, 3]].any() and not target.recurrent[:, [0, 2, 3]].any()
    with pytest.raises(ValueError, match="holds 588 bytes, got 587"):
        target.write_slot(0, data[:-1])
