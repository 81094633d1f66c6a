"""common.proto's FinishReason is the one list: the scheduler's reasons map onto it by name."""

from __future__ import annotations

import pytest

from llmserve.proto_convert import finish_reason_name, finish_reason_to_proto
from llmserve.v1 import common_pb2
from scheduler_service.engine import FinishReason


@pytest.mark.parametrize("reason", list(FinishReason))
def test_every_scheduler_reason_has_a_proto_value(reason: FinishReason) -> None:
    value = finish_reason_to_proto(reason)
    assert value != common_pb2.FINISH_REASON_UNSPECIFIED
    assert FinishReason(finish_reason_name(value)) is reason


def test_examples_and_unknowns() -> None:
    assert finish_reason_to_proto("length") == common_pb2.FINISH_REASON_LENGTH
    assert finish_reason_name(common_pb2.FINISH_REASON_STOP) == "stop"
    assert finish_reason_name(common_pb2.FINISH_REASON_UNSPECIFIED) is None
    with pytest.raises(ValueError):
        finish_reason_to_proto("tired")
    with pytest.raises(ValueError):
        finish_reason_name(99)
